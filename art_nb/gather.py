"""Run many rollouts at once, with a progress bar and an exception budget, as ART's gather does.

Only `Exception` counts against `max_exceptions`: a Ctrl-C (`KeyboardInterrupt`) or a cancelled
cell (`CancelledError`) is not a failed rollout, it stops the gather and propagates. With the
default `max_exceptions=0` the first failure is raised as the rollout raised it (as in ART); a
larger budget, once exceeded, raises `TooManyExceptionsError` naming the count, chained from the
first failure.

`trajectory_group_batches` is ART's streaming form: batches of groups as they finish, while later
groups already run, each batch with its own exception budget.

`retry`, `limit_concurrency` and `iterate_dataset` live in `art_nb.utils` (where ART keeps them)
and are re-exported here, their older home.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from . import events
from .trajectories import Trajectory, TrajectoryGroup, gather_or_cancel
from .utils import DatasetBatch, iterate_dataset, limit_concurrency, retry

__all__ = [
    "DatasetBatch",
    "TooManyExceptionsError",
    "gather_trajectories",
    "gather_trajectory_groups",
    "iterate_dataset",
    "limit_concurrency",
    "retry",
    "trajectory_group_batches",
]

AfterEach = Callable[[TrajectoryGroup], Any]


class TooManyExceptionsError(RuntimeError):
    """More rollouts raised than `max_exceptions` allows; the first traceback is attached."""


def _budget(max_exceptions: float, total: int) -> int:
    if isinstance(max_exceptions, bool) or max_exceptions < 0:
        raise ValueError(f"max_exceptions must be a count >= 0 or a fraction in (0, 1); got {max_exceptions!r}")
    if isinstance(max_exceptions, float) and max_exceptions < 1:
        return int(max_exceptions * total)
    return int(max_exceptions)


class _Tally:
    """The progress bar (tqdm.auto) with running metric means, the exception budget, and the
    dashboard's "gather_progress" events."""

    def __init__(self, desc: str | None, total: int, max_exceptions: float, max_metrics: int | None) -> None:
        from .utils.progress import progress_bar  # leaves its final state in a saved notebook, not "0%"

        self.bar = progress_bar(total=total, desc=desc, disable=desc is None, dynamic_ncols=True)
        self.desc, self.max_exceptions, self.max_metrics = desc, max_exceptions, max_metrics
        self.budget = _budget(max_exceptions, total)
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.failures: list[BaseException] = []

    def outcome(self, trajectory: Trajectory | None, error: BaseException | None) -> None:
        """Count one finished rollout; raise when the failures exceed the budget."""
        if error is not None:
            self.failures.append(error)
        else:
            assert trajectory is not None
            for key, value in {"reward": trajectory.reward, **trajectory.metrics}.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.sums[key] = self.sums.get(key, 0.0) + float(value)
                    self.counts[key] = self.counts.get(key, 0) + 1
        self._show()
        if error is not None and len(self.failures) > self.budget:
            if self.max_exceptions == 0:
                raise error
            raise TooManyExceptionsError(
                f"{len(self.failures)} rollouts raised (max_exceptions={self.max_exceptions}); first:\n"
                + "".join(traceback.format_exception(self.failures[0]))
            ) from self.failures[0]

    def _show(self) -> None:
        means = {key: self.sums[key] / self.counts[key] for key in self.sums}
        shown = list(means)[: self.max_metrics] if self.max_metrics is not None else list(means)
        postfix = {key: f"{means[key]:.3g}" for key in shown}
        if self.failures:
            postfix["exceptions"] = str(len(self.failures))
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)
        events.emit("gather_progress", desc=self.desc, done=self.bar.n, total=self.bar.total,
                    reward_mean=means.get("reward"), exceptions=len(self.failures))

    def close(self) -> None:
        self.bar.close()


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def gather_trajectory_groups(
    groups: Iterable[TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    pbar_desc: str | None = "gather",
    pbar_total_completion_tokens: bool = False,
    max_exceptions: float = 0,
    max_metrics: int | None = None,
    after_each: AfterEach | None = None,
) -> list[TrajectoryGroup]:
    """Run every rollout of every group concurrently; return the finished groups in order.

    `groups` holds TrajectoryGroups, or awaitables that return one (ART's `async def` group makers
    included). A rollout that raises is recorded in its group's `exceptions` and dropped from it;
    `max_exceptions` is a count, or a fraction of all rollouts (module docstring). `after_each(group)`,
    sync or async, may return a replacement group, a list of groups (flattened into the result), or
    None to drop it. `max_metrics` caps how many running means the progress bar shows.
    `pbar_total_completion_tokens` is accepted for ART code and does nothing (ART deprecated it).
    """
    items = list(groups)
    for i, item in enumerate(items):
        if not isinstance(item, TrajectoryGroup) and not inspect.isawaitable(item):
            raise TypeError(f"groups[{i}] is a {type(item).__name__}; expected TrajectoryGroup")
    total = sum(len(g.trajectories) + len(g.pending) if isinstance(g, TrajectoryGroup) else 1 for g in items)
    tally = _Tally(pbar_desc, total, max_exceptions, max_metrics)

    async def run_group(item: TrajectoryGroup | Awaitable[TrajectoryGroup]) -> list[TrajectoryGroup]:
        group = item if isinstance(item, TrajectoryGroup) else await item
        if not isinstance(group, TrajectoryGroup):
            raise TypeError(f"a group awaitable returned {type(group).__name__}; expected TrajectoryGroup")
        for trajectory in group.trajectories:
            tally.outcome(trajectory, None)
        finished = await group.finished(tally.outcome)
        result = finished if after_each is None else await _maybe_await(after_each(finished))
        if result is None:
            return []
        return list(result) if isinstance(result, (list, tuple)) else [result]

    try:
        results = await gather_or_cancel([run_group(item) for item in items])
    finally:
        tally.close()
    return [group for result in results for group in result]


def _size(item: TrajectoryGroup | Awaitable[TrajectoryGroup]) -> int:
    """How many rollouts an item is known to hold (a group maker counts as one until it has run)."""
    return len(item.trajectories) + len(item.pending) if isinstance(item, TrajectoryGroup) else 1


async def trajectory_group_batches(
    groups: Iterable[TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    batch_size: int,
    max_batch_exceptions: float = 0,
    max_concurrent_batches: int = 4,
    skip_batches: int = 0,
    pbar_desc: str | None = "batches",
    pbar_total_completion_tokens: bool = True,
) -> AsyncIterator[list[TrajectoryGroup]]:
    """Yield lists of `batch_size` finished groups, in the order they finish (the last may be shorter).

    As ART's: up to `batch_size * max_concurrent_batches` groups run at once, so the next batches are
    being played while the caller trains on this one; `skip_batches` leaves out the first batches'
    groups (resume at a step). A failed rollout stays in its group's `exceptions`; more failures
    within one batch than `max_batch_exceptions` (a count, or a fraction of the batch's rollouts)
    raise as `gather_trajectory_groups` does, the rollout's own error when the budget is 0. An error,
    or closing the generator (`contextlib.aclosing`, or its collection after the loop is left),
    cancels the groups still running. `pbar_total_completion_tokens` is accepted for ART code and
    does nothing.
    """
    if isinstance(batch_size, bool) or batch_size < 1 or max_concurrent_batches < 1 or skip_batches < 0:
        raise ValueError(f"trajectory_group_batches needs batch_size >= 1, max_concurrent_batches >= 1 and "
                         f"skip_batches >= 0; got {batch_size}, {max_concurrent_batches}, {skip_batches}")
    items = list(groups)
    skipped, unstarted = items[:batch_size * skip_batches], items[batch_size * skip_batches:]
    for item in skipped:  # never run: closed, so Python does not warn of coroutines never awaited
        for pending in item.pending if isinstance(item, TrajectoryGroup) else [item]:
            if inspect.iscoroutine(pending):
                pending.close()
    if not unstarted:
        return
    per_group = max(1, round(sum(map(_size, unstarted)) / len(unstarted)))
    window: list[_Tally] = []  # the tally of the batch being filled: rollouts report to it as they end

    def new_window() -> None:
        if window:
            window[0].close()
        window[:] = [_Tally(pbar_desc, batch_size * per_group, max_batch_exceptions, None)]

    async def run_group(item: TrajectoryGroup | Awaitable[TrajectoryGroup]) -> TrajectoryGroup | None:
        try:
            group = item if isinstance(item, TrajectoryGroup) else await item
        except Exception as error:  # noqa: BLE001 - a group maker that failed counts as one failed rollout
            window[0].outcome(None, error)
            return None
        if not isinstance(group, TrajectoryGroup):
            raise TypeError(f"a group awaitable returned {type(group).__name__}; expected TrajectoryGroup")
        for trajectory in group.trajectories:
            window[0].outcome(trajectory, None)
        return await group.finished(lambda t, e: window[0].outcome(t, e))

    new_window()
    running: set[asyncio.Task[TrajectoryGroup | None]] = set()
    batch: list[TrajectoryGroup] = []
    try:
        while unstarted or running:
            while unstarted and len(running) < batch_size * max_concurrent_batches:
                running.add(asyncio.ensure_future(run_group(unstarted.pop(0))))
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            errors = [error for task in done if (error := task.exception()) is not None]  # each one retrieved
            if errors:
                raise errors[0]
            batch += [group for task in done if (group := task.result()) is not None]
            while len(batch) >= batch_size:
                ready, batch = batch[:batch_size], batch[batch_size:]
                new_window()
                yield ready
        if batch:
            yield batch
    finally:
        window[0].close()
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory | Iterable[Trajectory]]],
    *,
    pbar_desc: str | None = "gather",
    pbar_total_completion_tokens: bool = False,
    max_exceptions: float = 0,
) -> list[Any]:
    """Run rollouts concurrently (evaluation); results in the order given, as ART returns them.

    A rollout that raised stands in its place as the exception object (within `max_exceptions`);
    a rollout may return one Trajectory or a list of them (e.g. both players of a self-play game).
    """
    awaitables = list(trajectories)
    tally = _Tally(pbar_desc, len(awaitables), max_exceptions, None)

    async def one(awaitable: Awaitable[Any]) -> Any:
        try:
            result = await awaitable
        except Exception as error:  # noqa: BLE001 - a failed rollout, counted against the budget
            tally.outcome(None, error)
            return error
        finished = [result] if isinstance(result, Trajectory) else list(result)
        for trajectory in finished:
            if not isinstance(trajectory, Trajectory):
                raise TypeError(f"a rollout returned {type(trajectory).__name__}; rollouts must return "
                                "art_nb.Trajectory (or a list of them)")
        tally.outcome(finished[0] if finished else Trajectory(), None)
        return result

    try:
        return await gather_or_cancel([one(a) for a in awaitables])
    finally:
        tally.close()
