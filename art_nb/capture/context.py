"""The context variables behind capture scopes.

A scope is the list a trajectory keeps its calls in (`Trajectory.exchanges`): entering pushes it,
leaving pops it, and a hook appends each recorded call to the innermost list. Context variables
make this right under concurrency with no bookkeeping: each asyncio task runs in a copy of its
creator's context, so two rollouts in one `asyncio.gather` record into their own trajectories, and
`asyncio.to_thread` / `loop.run_in_executor` with a copied context carry the scope into a thread.
(A thread started by hand without `contextvars.copy_context()` records nothing.)

Groups work the same way: `with art.TrajectoryGroup() as g:` pushes `g.trajectories`, and a
trajectory scope that closes inside it is appended there.

This module knows nothing of Trajectory (it sits below it): it holds lists.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from .calls import CapturedCall

__all__ = ["capturing", "enter", "enter_group", "exit", "exit_group", "group_owner", "no_capture", "sink",
           "trajectory_owner"]

_scopes: contextvars.ContextVar[tuple[tuple[Any, list[CapturedCall]], ...]] = contextvars.ContextVar(
    "art_nb_capture_scopes", default=())
_groups: contextvars.ContextVar[tuple[tuple[Any, list[Any]], ...]] = contextvars.ContextVar(
    "art_nb_capture_groups", default=())
_off: contextvars.ContextVar[bool] = contextvars.ContextVar("art_nb_capture_off", default=False)


def enter(owner: Any, calls: list[CapturedCall]) -> None:
    """Open a scope recording into `calls` (the owner, a trajectory, is what `current_trajectory` returns).
    The caller installs the hooks first (`hooks.install`)."""
    _scopes.set((*_scopes.get(), (owner, calls)))


def exit(owner: Any) -> None:
    """Close the innermost scope, which must be `owner`'s (scopes close in the order they opened)."""
    current = _scopes.get()
    if not current or current[-1][0] is not owner:
        raise RuntimeError("trajectory scopes must close in the reverse order they opened "
                           "(a `with Trajectory()` block left in another task or out of order)")
    _scopes.set(current[:-1])
    groups = _groups.get()
    if groups and all(item is not owner for item in groups[-1][1]):
        groups[-1][1].append(owner)


def enter_group(owner: Any, trajectories: list[Any]) -> None:
    """Open a group scope: trajectory scopes closing inside it are appended to `trajectories`."""
    _groups.set((*_groups.get(), (owner, trajectories)))


def exit_group(owner: Any) -> None:
    current = _groups.get()
    if not current or current[-1][0] is not owner:
        raise RuntimeError("trajectory group scopes must close in the reverse order they opened")
    _groups.set(current[:-1])


def sink() -> list[CapturedCall] | None:
    """Where a call made now is recorded: the innermost scope's list, or None (no scope, or `no_capture`)."""
    scopes = _scopes.get()
    if not scopes or _off.get():
        return None
    return scopes[-1][1]


def trajectory_owner() -> Any | None:
    """The innermost scope's owner (the trajectory), or None outside any scope."""
    scopes = _scopes.get()
    return scopes[-1][0] if scopes else None


def group_owner() -> Any | None:
    """The innermost group scope's owner (the TrajectoryGroup), or None."""
    groups = _groups.get()
    return groups[-1][0] if groups else None


def capturing() -> bool:
    """Whether a model call made here and now would be recorded."""
    return sink() is not None


@contextlib.contextmanager
def no_capture() -> Iterator[None]:
    """Calls made in this block are not recorded (a judge, a summariser, another model's help)."""
    token = _off.set(True)
    try:
        yield
    finally:
        _off.reset(token)
