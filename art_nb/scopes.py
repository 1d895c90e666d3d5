"""ART's capture entry points: `trajectory(coro)`, `trajectory_group([...])`, `current_trajectory()`,
`no_capture()`, and their older spellings `capture_auto_trajectory(coro)` / `auto_trajectory()` and
`capture_yielded_trajectory(coro)` / `yield_trajectory(t)`.

`await art.trajectory(rollout(...))` runs the coroutine inside a `with Trajectory()` scope and
returns that trajectory, holding every model call the coroutine made (whatever client it used);
the coroutine's own return value is ignored. Inside, `art.current_trajectory(required=True)` is
where the rollout sets its reward, metrics and metadata. `await art.trajectory_group([...])`
runs such coroutines concurrently into one `TrajectoryGroup` (one failure cancels the others,
unless `return_exceptions=True`, which keeps failures as the group's exceptions).

Each coroutine runs in its own task, hence its own copy of the context: concurrent scopes never
see each other's calls (art_nb.capture.context).

`await art.capture_yielded_trajectory(coro)` returns the trajectory the coroutine handed to
`art.yield_trajectory(t)` (the last one, if several), as ART does for rollouts that return
something else; no trajectory yielded is a RuntimeError. `yield_trajectory` outside such a capture
does nothing, as in ART (where it sets a default no one reads).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Iterable
from typing import Any

from .capture import context as capture_scope
from .capture import no_capture
from .trajectories import Trajectory, TrajectoryGroup, gather_or_cancel

__all__ = ["auto_trajectory", "capture_auto_trajectory", "capture_yielded_trajectory", "current_trajectory",
           "current_trajectory_group", "no_capture", "trajectory", "trajectory_group", "yield_trajectory"]

# What `yield_trajectory` fills: a one-item list per `capture_yielded_trajectory`, None outside one.
_yielded: contextvars.ContextVar[list[Trajectory] | None] = contextvars.ContextVar("art_nb_yielded", default=None)


def _raw_coroutine(value: Any) -> Coroutine[Any, Any, Any]:
    if isinstance(value, (asyncio.Task, asyncio.Future)) or not isinstance(value, Coroutine):
        raise TypeError(f"expected a coroutine (call the rollout: `rollout(model, scenario)`), got "
                        f"{type(value).__name__}: a task already running would not run inside the scope")
    return value


async def trajectory(coro: Coroutine[Any, Any, Any]) -> Trajectory:
    """Run `coro` inside a new capture scope and return its trajectory (see the module docstring)."""
    _raw_coroutine(coro)
    with Trajectory() as captured:
        await coro
    return captured


async def trajectory_group(coros: Iterable[Coroutine[Any, Any, Trajectory]], *,
                           return_exceptions: bool = False) -> TrajectoryGroup:
    """Run `art.trajectory(...)` coroutines (or any coroutines returning a Trajectory) concurrently."""
    coroutines = [_raw_coroutine(c) for c in coros]
    if not return_exceptions:
        return TrajectoryGroup(await gather_or_cancel(coroutines))
    results = await asyncio.gather(*coroutines, return_exceptions=True)
    for result in results:  # return_exceptions covers Exceptions, not an interrupt or exit
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result
    return TrajectoryGroup(results)


def current_trajectory(*, required: bool = False) -> Trajectory | None:
    """The trajectory of the innermost open scope (None outside one; RuntimeError if `required`)."""
    owner = capture_scope.trajectory_owner()
    if isinstance(owner, Trajectory):
        return owner
    if required:
        raise RuntimeError("no trajectory scope is open here: call this inside `await art.trajectory(...)` "
                           "or `with art.Trajectory() as t:`")
    return None


def current_trajectory_group(*, required: bool = False) -> TrajectoryGroup | None:
    """The group of the innermost `with TrajectoryGroup()` block (None outside one; RuntimeError if `required`)."""
    owner = capture_scope.group_owner()
    if isinstance(owner, TrajectoryGroup):
        return owner
    if required:
        raise RuntimeError("no `with art.TrajectoryGroup() as group:` block is open here")
    return None



def auto_trajectory(*, required: bool = False, require: bool | None = None) -> Trajectory | None:
    """ART's older name of `current_trajectory` (`require=` is ART's later spelling of `required=`)."""
    return current_trajectory(required=required if require is None else require)


async def capture_auto_trajectory(coro: Coroutine[Any, Any, Any]) -> Trajectory:
    """ART's older name of `trajectory(coro)`: the calls the coroutine makes, as one trajectory."""
    return await trajectory(coro)


def yield_trajectory(trajectory: Trajectory) -> None:
    """Hand `trajectory` to the enclosing `capture_yielded_trajectory` (nothing outside one)."""
    if not isinstance(trajectory, Trajectory):
        raise TypeError(f"yield_trajectory takes an art.Trajectory, got {type(trajectory).__name__}")
    box = _yielded.get()
    if box is not None:
        box[:] = [trajectory]


async def capture_yielded_trajectory(coro: Coroutine[Any, Any, Any]) -> Trajectory:
    """Run `coro` and return the trajectory it passed to `yield_trajectory` (RuntimeError if none)."""
    _raw_coroutine(coro)
    box: list[Trajectory] = []
    token = _yielded.set(box)
    try:
        await coro
    finally:
        _yielded.reset(token)
    if not box:
        raise RuntimeError("No trajectory yielded: the coroutine must call art.yield_trajectory(trajectory) "
                           "before it returns")
    return box[0]
