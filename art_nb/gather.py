"""Run many rollouts at once, with a progress bar, an exception budget and resumable iteration.

Only `Exception` counts against `max_exceptions`: a Ctrl-C (`KeyboardInterrupt`) or a cancelled
cell (`CancelledError`) is not a failed rollout, it stops the gather and propagates.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import random
import traceback
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from . import events
from .trajectory import Trajectory, TrajectoryGroup

__all__ = [
    "gather_trajectory_groups",
    "gather_trajectories",
    "retry",
    "limit_concurrency",
    "iterate_dataset",
    "DatasetBatch",
    "TooManyExceptionsError",
]

T = TypeVar("T")


class TooManyExceptionsError(RuntimeError):
    """More rollouts raised than `max_exceptions` allows; the first traceback is attached."""


def _budget(max_exceptions: int | float, total: int) -> int:
    if isinstance(max_exceptions, bool) or max_exceptions < 0:
        raise ValueError(f"max_exceptions must be a count >= 0 or a fraction in (0, 1); got {max_exceptions!r}")
    if isinstance(max_exceptions, float) and max_exceptions < 1:
        return int(max_exceptions * total)
    return int(max_exceptions)


class _Progress:
    """tqdm.auto bar with a running mean reward, plus events for the dashboard."""

    def __init__(self, desc: str | None, total: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, disable=desc is None, dynamic_ncols=True)
        self.rewards: list[float] = []
        self.exceptions = 0
        self.desc = desc

    def done(self, trajectory: Trajectory | None) -> None:
        if trajectory is None:
            self.exceptions += 1
        else:
            self.rewards.append(trajectory.reward)
        postfix = {"reward": f"{sum(self.rewards) / len(self.rewards):.3f}"} if self.rewards else {}
        if self.exceptions:
            postfix["exceptions"] = str(self.exceptions)
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)
        events.emit(
            "gather_progress",
            desc=self.desc,
            done=self.bar.n,
            total=self.bar.total,
            reward_mean=(sum(self.rewards) / len(self.rewards)) if self.rewards else None,
            exceptions=self.exceptions,
        )

    def close(self) -> None:
        self.bar.close()


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def gather_trajectory_groups(
    groups: Iterable[TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
    after_each: Callable[[TrajectoryGroup], Any] | None = None,
) -> list[TrajectoryGroup]:
    """Await every rollout of every group concurrently; return the finished groups in order.

    A rollout that raises is recorded in its group's `exceptions` and dropped from it; more than
    `max_exceptions` (a count, or a fraction of all rollouts) raises `TooManyExceptionsError`.
    `after_each(group)` may return a replacement group, or None to drop the group.
    """
    groups = [await g if not isinstance(g, TrajectoryGroup) and inspect.isawaitable(g) else g for g in groups]
    for i, group in enumerate(groups):
        if not isinstance(group, TrajectoryGroup):
            raise TypeError(f"groups[{i}] is a {type(group).__name__}; expected TrajectoryGroup")
    total = sum(len(g.trajectories) + len(g.pending) for g in groups)
    budget = _budget(max_exceptions, total)
    progress = _Progress(pbar_desc, total)
    failures: list[BaseException] = []

    async def run_one(awaitable: Awaitable[Trajectory]) -> Trajectory | str:
        try:
            result = await awaitable
        except Exception as error:  # noqa: BLE001 - counted against the budget, by design
            failures.append(error)
            progress.done(None)
            if len(failures) > budget:
                raise TooManyExceptionsError(
                    f"{len(failures)} rollouts raised (max_exceptions={max_exceptions}); first:\n"
                    + "".join(traceback.format_exception(failures[0]))
                ) from failures[0]
            return "".join(traceback.format_exception_only(type(error), error)).strip()
        if not isinstance(result, Trajectory):
            raise TypeError(f"a rollout returned {type(result).__name__}; rollouts must return art_nb.Trajectory")
        progress.done(result)
        return result

    async def run_group(group: TrajectoryGroup) -> TrajectoryGroup | None:
        for trajectory in group.trajectories:
            progress.done(trajectory)
        results = await asyncio.gather(*(run_one(p) for p in group.pending))
        finished = TrajectoryGroup(
            list(group.trajectories) + [r for r in results if isinstance(r, Trajectory)],
            exceptions=list(group.exceptions) + [r for r in results if isinstance(r, str)],
            metadata=group.metadata,
        )
        if after_each is not None:
            return await _maybe_await(after_each(finished))
        return finished

    tasks = [asyncio.ensure_future(run_group(g)) for g in groups]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        progress.close()
    return [g for g in results if g is not None]


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory]],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
) -> list[Trajectory]:
    """Like `gather_trajectory_groups` for a flat list (evaluation): failed rollouts are dropped."""
    groups = await gather_trajectory_groups(
        [TrajectoryGroup(trajectories)], pbar_desc=pbar_desc, max_exceptions=max_exceptions
    )
    return list(groups[0].trajectories)


def retry(
    max_attempts: int = 3, delay: float = 0.5, backoff: float = 2.0, exceptions: tuple[type[Exception], ...] = (Exception,)
) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
    """Retry an async function on `exceptions` with exponential backoff and jitter."""

    def decorate(func: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> T:
            for attempt in range(1, max_attempts + 1):
                try:
                    return await func(*args, **kwargs)
                except exceptions:
                    if attempt == max_attempts:
                        raise
                    await asyncio.sleep(delay * backoff ** (attempt - 1) * (0.5 + random.random()))
            raise AssertionError("unreachable")

        return wrapper

    return decorate


def limit_concurrency(n: int) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
    """At most `n` calls of the decorated async function run at once (per event loop)."""
    # Keyed by the loop object, weakly: a closed loop's semaphore goes with it (an id can be reused).
    semaphores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()

    def decorate(func: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> T:
            semaphore = semaphores.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(n))
            async with semaphore:
                return await func(*args, **kwargs)

        return wrapper

    return decorate


@dataclass(frozen=True)
class DatasetBatch(Generic[T]):
    items: list[T]
    step: int
    epoch: int
    epoch_step: int


def iterate_dataset(
    dataset: Sequence[T],
    groups_per_step: int = 1,
    num_epochs: int = 1,
    initial_step: int = 0,
    shuffle: bool = True,
    seed: int = 42,
    use_tqdm: bool = True,
) -> Iterator[DatasetBatch[T]]:
    """Batches of scenarios, one per training step, resumable: `initial_step=await model.get_step()`
    yields exactly the batches a run that was never interrupted would have seen from that step on."""
    if groups_per_step < 1:
        raise ValueError("groups_per_step must be >= 1")
    if len(dataset) == 0:
        raise ValueError("dataset is empty")
    steps_per_epoch = -(-len(dataset) // groups_per_step)
    total = steps_per_epoch * num_epochs
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=min(initial_step, total), desc="steps", dynamic_ncols=True)
    try:
        for epoch in range(num_epochs):
            order = list(range(len(dataset)))
            if shuffle:
                random.Random(seed + epoch).shuffle(order)
            for epoch_step in range(steps_per_epoch):
                step = epoch * steps_per_epoch + epoch_step
                if step < initial_step:
                    continue
                picked = order[epoch_step * groups_per_step : (epoch_step + 1) * groups_per_step]
                yield DatasetBatch([dataset[i] for i in picked], step, epoch, epoch_step)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
