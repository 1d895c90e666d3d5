import asyncio

import pytest

from art_nb import (
    TooManyExceptionsError,
    Trajectory,
    TrajectoryGroup,
    gather_trajectories,
    gather_trajectory_groups,
    iterate_dataset,
    limit_concurrency,
    retry,
)
from art_nb import events


async def ok(reward: float, delay: float = 0.0) -> Trajectory:
    await asyncio.sleep(delay)
    return Trajectory(reward=reward)


async def boom() -> Trajectory:
    raise ValueError("rollout broke")


async def test_groups_keep_order_and_run_concurrently():
    started = asyncio.get_running_loop().time()
    groups = await gather_trajectory_groups(
        (TrajectoryGroup(ok(r, 0.2) for r in (g, g + 1)) for g in range(5)), pbar_desc=None
    )
    assert [g.rewards() for g in groups] == [[g, g + 1] for g in range(5)]
    assert asyncio.get_running_loop().time() - started < 1.0  # 10 rollouts of 0.2 s, at once


async def test_exceptions_within_budget_are_recorded():
    groups = await gather_trajectory_groups(
        [TrajectoryGroup([ok(1), boom()]), TrajectoryGroup([ok(0), ok(1)])], pbar_desc=None, max_exceptions=1
    )
    assert groups[0].rewards() == [1] and "rollout broke" in groups[0].exceptions[0]


async def test_exceptions_over_budget_raise_with_traceback():
    with pytest.raises(TooManyExceptionsError, match="rollout broke"):
        await gather_trajectory_groups([TrajectoryGroup([boom(), boom(), ok(1)])], pbar_desc=None, max_exceptions=1)


async def test_fraction_budget():
    groups = await gather_trajectory_groups(
        [TrajectoryGroup([boom()] + [ok(1) for _ in range(9)])], pbar_desc=None, max_exceptions=0.1
    )
    assert len(groups[0]) == 9
    with pytest.raises(TooManyExceptionsError):
        await gather_trajectory_groups([TrajectoryGroup([boom(), boom()] + [ok(1) for _ in range(8)])], pbar_desc=None,
                                       max_exceptions=0.1)


async def test_cancellation_is_not_a_rollout_failure():
    async def interrupted() -> Trajectory:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await gather_trajectory_groups([TrajectoryGroup([interrupted(), ok(1)])], pbar_desc=None,
                                       max_exceptions=10)


async def test_cancelling_the_gather_cancels_every_rollout():
    finished = []

    async def slow() -> Trajectory:
        await asyncio.sleep(5)
        finished.append(1)
        return Trajectory(reward=1)

    task = asyncio.ensure_future(
        gather_trajectory_groups([TrajectoryGroup([slow() for _ in range(4)])], pbar_desc=None, max_exceptions=10)
    )
    await asyncio.sleep(0.05)
    task.cancel()  # what a notebook's interrupt button does to the cell
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished == []


async def test_after_each_can_drop_groups_and_events_flow():
    seen = []
    unsubscribe = events.subscribe(seen.append)
    try:
        groups = await gather_trajectory_groups(
            [TrajectoryGroup([ok(1), ok(1)]), TrajectoryGroup([ok(0), ok(1)])],
            pbar_desc="test",
            after_each=lambda g: None if len(set(g.rewards())) == 1 else g,
        )
    finally:
        unsubscribe()
    assert [g.rewards() for g in groups] == [[0, 1]]
    progress = [e for e in seen if e["type"] == "gather_progress"]
    assert progress[-1]["done"] == 4 and progress[-1]["reward_mean"] == pytest.approx(0.75)


async def test_wrong_return_type_is_a_clear_error():
    async def bad():
        return {"reward": 1}

    with pytest.raises(TypeError, match="must return art_nb.Trajectory"):
        await gather_trajectory_groups([TrajectoryGroup([bad()])], pbar_desc=None)


async def test_gather_trajectories_flat():
    result = await gather_trajectories([ok(1), ok(2), boom()], pbar_desc=None, max_exceptions=1)
    # As ART returns them: in order, the failed rollout in its place as the exception it raised.
    assert [t.reward for t in result[:2]] == [1, 2]
    assert isinstance(result[2], ValueError) and str(result[2]) == "rollout broke"


async def test_retry_and_limit_concurrency():
    calls = []

    @retry(max_attempts=3, delay=0.001)
    async def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError
        return "ok"

    assert await flaky() == "ok" and len(calls) == 3

    running, peak = 0, 0

    @limit_concurrency(2)
    async def work():
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1

    await asyncio.gather(*(work() for _ in range(8)))
    assert peak == 2


def test_iterate_dataset_resumes_exactly():
    data = list(range(10))
    full = [(b.step, b.items) for b in iterate_dataset(data, groups_per_step=3, num_epochs=2, use_tqdm=False)]
    resumed = [(b.step, b.items) for b in iterate_dataset(data, groups_per_step=3, num_epochs=2, initial_step=5,
                                                          use_tqdm=False)]
    assert len(full) == 8 and resumed == full[5:]
    assert sorted(x for _, items in full[:4] for x in items) == data  # each epoch sees everything once
    with pytest.raises(ValueError):
        list(iterate_dataset([], use_tqdm=False))
