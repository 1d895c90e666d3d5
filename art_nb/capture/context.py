"""The context variables behind capture scopes.

A scope is the list a trajectory keeps its calls in (`Trajectory.exchanges`): entering pushes it,
leaving pops it, and a hook appends each recorded call to the innermost list. Context variables
make this right under concurrency with no bookkeeping: each asyncio task runs in a copy of its
creator's context, so two rollouts in one `asyncio.gather` record into their own trajectories, and
`asyncio.to_thread` carries the scope into a thread. Work handed to a `ThreadPoolExecutor`
(`pool.submit`, `pool.map`, `loop.run_in_executor`) carries the submitter's scope too (`carried` and
`run_carried`, applied by `hook_threads`). A thread started by hand (`threading.Thread`) starts
with an empty context and records nothing: its calls cannot be told apart from any other
thread's, so they are counted instead (`note_outside_call`), and each trajectory learns how many
were made while it was open (`exit`'s return), which the step's error reports.

A scope records only while it is open: a task or thread that outlives its trajectory records
nothing into it afterwards (the trajectory may be training by then).

Groups work the same way: `with art.TrajectoryGroup() as g:` pushes `g.trajectories`, and a
trajectory scope that closes inside it is appended there.

This module knows nothing of Trajectory (it sits below it): it holds lists.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from .calls import CapturedCall

__all__ = ["Carried", "any_open", "capturing", "carried", "enter", "enter_group", "exit", "exit_group", "group_owner",
           "no_capture", "note_outside_call", "outside", "run_carried", "sink", "trajectory_owner"]

T = TypeVar("T")

_scopes: contextvars.ContextVar[tuple[tuple[Any, list[CapturedCall]], ...]] = contextvars.ContextVar(
    "art_nb_capture_scopes", default=())
_groups: contextvars.ContextVar[tuple[tuple[Any, list[Any]], ...]] = contextvars.ContextVar(
    "art_nb_capture_groups", default=())
_off: contextvars.ContextVar[bool] = contextvars.ContextVar("art_nb_capture_off", default=False)

# Process-wide, for every thread: which scopes are open (by the owner's id: a context that holds the
# owner keeps it alive, so its id is not reused), and how many calls were made outside any scope.
_lock = threading.Lock()
_open: dict[int, int] = {}  # id(owner) -> the outside-call count when it opened
_outside_calls = 0


def enter(owner: Any, calls: list[CapturedCall]) -> None:
    """Open a scope recording into `calls` (the owner, a trajectory, is what `current_trajectory` returns).
    The caller installs the hooks first (`hooks.install`)."""
    if id(owner) in _open:
        raise RuntimeError("this trajectory's scope is already open: a trajectory records one rollout")
    with _lock:
        _open[id(owner)] = _outside_calls
    _scopes.set((*_scopes.get(), (owner, calls)))


def exit(owner: Any) -> int:
    """Close the innermost scope, which must be `owner`'s (scopes close in the order they opened).

    Returns how many calls to an art_nb endpoint were made outside any open scope's context while
    this one was open (`note_outside_call`): 0 unless some code ran where no scope is, typically a
    thread started by hand."""
    current = _scopes.get()
    if not current or current[-1][0] is not owner:
        raise RuntimeError("trajectory scopes must close in the reverse order they opened "
                           "(a `with Trajectory()` block left in another task or out of order)")
    _scopes.set(current[:-1])
    with _lock:
        outside = _outside_calls - _open.pop(id(owner), _outside_calls)
    groups = _groups.get()
    if groups and all(item is not owner for item in groups[-1][1]):
        groups[-1][1].append(owner)
    return outside


def enter_group(owner: Any, trajectories: list[Any]) -> None:
    """Open a group scope: trajectory scopes closing inside it are appended to `trajectories`."""
    _groups.set((*_groups.get(), (owner, trajectories)))


def exit_group(owner: Any) -> None:
    current = _groups.get()
    if not current or current[-1][0] is not owner:
        raise RuntimeError("trajectory group scopes must close in the reverse order they opened")
    _groups.set(current[:-1])


def sink() -> list[CapturedCall] | None:
    """Where a call made now is recorded: the innermost scope's list, or None (no scope, `no_capture`,
    or a scope that has closed since this context was copied from it)."""
    scopes = _scopes.get()
    if not scopes or _off.get() or id(scopes[-1][0]) not in _open:
        return None
    return scopes[-1][1]


def any_open() -> bool:
    """Whether a scope is open anywhere in the process (in any task or thread)."""
    return bool(_open)


def outside() -> bool:
    """Whether a call made here is outside every scope while some scope is open elsewhere, and not
    excluded by `no_capture`: the case `note_outside_call` counts."""
    return not _scopes.get() and not _off.get() and any_open()


def note_outside_call() -> None:
    """Count a call to an art_nb endpoint made `outside()` (the hooks tell when its response says so)."""
    global _outside_calls
    with _lock:
        _outside_calls += 1


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


Carried = tuple[tuple[tuple[Any, list[CapturedCall]], ...], tuple[tuple[Any, list[Any]], ...], bool]
"""What a thread pool's work item takes from the code that submitted it: the scopes, the groups, `no_capture`."""


def carried() -> Carried:
    """This context's capture state, to run work elsewhere as if it ran here (`run_carried`)."""
    return _scopes.get(), _groups.get(), _off.get()


def run_carried(state: Carried, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` with the capture state `state` (from `carried()` where the work was
    submitted), restored afterwards: a pool's worker thread runs many submitters' work in turn, so
    each item sets all three variables, an empty state included, and leaves none behind."""
    tokens = _scopes.set(state[0]), _groups.set(state[1]), _off.set(state[2])
    try:
        return fn(*args, **kwargs)
    finally:
        _off.reset(tokens[2])
        _groups.reset(tokens[1])
        _scopes.reset(tokens[0])


@contextlib.contextmanager
def no_capture() -> Iterator[None]:
    """Calls made in this block are not recorded (a judge, a summariser, another model's help)."""
    token = _off.set(True)
    try:
        yield
    finally:
        _off.reset(token)
