"""ART's Trajectory, TrajectoryGroup, gather and utils behaviours, as ART code relies on them."""

from __future__ import annotations

import asyncio
import json
import random
import warnings

import pytest
from openai.types.chat.chat_completion import Choice

import art_nb as art
from art_nb import events
from art_nb.records import UnknownMetricError, best_step, record_groups, unrecorded
from art_nb.store import ModelStore
from art_nb.trajectories import History, RolloutException
from art_nb.utils import iterate_dataset, limit_concurrency, retry, strip_logprobs

CALL = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{}"}}


async def ok(reward: float = 1.0, delay: float = 0.0) -> art.Trajectory:
    await asyncio.sleep(delay)
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=reward)


async def boom() -> art.Trajectory:
    raise KeyError("the environment broke")


# ---- Trajectory -------------------------------------------------------------------------------------

def test_log_finish_track_duration_for_logging():
    async def go() -> art.Trajectory:
        t = art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], metadata={"step": 3})
        t.log("started")
        async with t.track_duration("llm"):
            await asyncio.sleep(0.01)
        async with t.track_duration("llm"):
            await asyncio.sleep(0.01)
        return t.finish()

    t = asyncio.run(go())
    assert t.logs == ["started"]
    assert t.metrics["llm_duration"] >= 0.02 and t.metrics["duration"] >= t.metrics["llm_duration"]
    view = t.for_logging()
    assert view["messages"] == [{"role": "user", "content": "q", "trainable": False}]
    assert view["metadata"] == {"step": 3} and json.dumps(view)


def test_additional_histories_are_validated_like_the_main_one():
    ok_history = History(messages_and_choices=[{"role": "assistant", "content": None, "tool_calls": [CALL]},
                                               {"role": "tool", "tool_call_id": "call_1", "content": "r"}])
    t = art.Trajectory(additional_histories=[ok_history])
    assert t.additional_histories[0].messages()[1]["tool_call_id"] == "call_1"
    with pytest.raises(ValueError, match=r"messages_and_choices\[0\] has role 'bot'"):
        History(messages_and_choices=[{"role": "bot", "content": "r"}])


def test_subclass_with_its_own_field_and_equality_ignores_creation_time():
    class ProjectTrajectory(art.Trajectory):
        final_answer: str | None = None

    a = ProjectTrajectory(reward=1.0)
    a.final_answer = "42"
    b = ProjectTrajectory.model_validate(a.model_dump())
    assert b == a and b.final_answer == "42"
    b.reward = 0.5
    assert b != a


# ---- TrajectoryGroup ----------------------------------------------------------------------------------

def test_group_holds_exception_objects_with_arts_fields():
    error = ValueError("bad move")
    group = art.TrajectoryGroup([art.Trajectory(), error], exceptions=[KeyError("k"), "RuntimeError: text"],
                                metrics={"solved": 1}, logs=["a"])
    first = group.exceptions[0]
    assert isinstance(first, RolloutException) and first.exception is error
    assert (first.type, first.message, str(first)) == ("ValueError", "bad move", "ValueError: bad move")
    assert "ValueError: bad move" in first.traceback
    assert [e.type for e in group.exceptions] == ["ValueError", "KeyError", ""]
    group.log("b")
    assert group.logs == ["a", "b"] and group.metrics == {"solved": 1} and len(group) == 1
    wire = json.loads(group.model_dump_json())
    assert wire["exceptions"] == ["ValueError: bad move", "KeyError: 'k'", "RuntimeError: text"]
    back = art.TrajectoryGroup(exceptions=[{"type": "ValueError", "message": "m", "traceback": "tb"}])
    assert (back.exceptions[0].type, back.exceptions[0].traceback, back.exceptions[0]) == ("ValueError", "tb", "ValueError: m")


async def test_awaiting_a_group_runs_its_rollouts_and_raises_the_first_failure():
    group = await art.TrajectoryGroup([art.Trajectory(reward=0), ok(1), ok(2)])
    assert group.rewards() == [0, 1, 2] and not group.pending
    with pytest.raises(KeyError, match="the environment broke"):
        await art.TrajectoryGroup([ok(1), boom()])


# ---- gather -------------------------------------------------------------------------------------------

async def test_group_makers_run_concurrently_and_after_each_lists_are_flattened():
    async def make(r: float) -> art.TrajectoryGroup:
        await asyncio.sleep(0.3)
        return art.TrajectoryGroup([ok(r), ok(r + 1)])

    async def twice(group: art.TrajectoryGroup) -> list[art.TrajectoryGroup]:
        return [group, group]

    started = asyncio.get_running_loop().time()
    groups = await art.gather_trajectory_groups([make(0), make(10), make(20)], pbar_desc=None, after_each=twice)
    assert asyncio.get_running_loop().time() - started < 0.8  # three 0.3 s makers at once, not one after another
    assert [g.rewards() for g in groups] == [[0, 1], [0, 1], [10, 11], [10, 11], [20, 21], [20, 21]]


async def test_an_invalid_trajectory_fails_only_its_rollout():
    async def bad_tool_result() -> art.Trajectory:
        t = art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}])
        t.messages_and_choices.append({"role": "bot", "content": "r"})  # no validator sees an in-place append
        return t

    groups = await art.gather_trajectory_groups([art.TrajectoryGroup([ok(1), bad_tool_result(), ok(2)])],
                                                pbar_desc=None, max_exceptions=1)
    assert groups[0].rewards() == [1, 2]
    assert "'bot'" in groups[0].exceptions[0] and groups[0].exceptions[0].type == "ValueError"
    with pytest.raises(ValueError, match="'bot'"):
        await art.gather_trajectory_groups([art.TrajectoryGroup([bad_tool_result()])], pbar_desc=None)


async def test_no_budget_raises_the_rollouts_own_error_and_cancels_the_rest():
    finished = []

    async def slow() -> art.Trajectory:
        await asyncio.sleep(2)
        finished.append(1)
        return art.Trajectory()

    with pytest.raises(KeyError, match="the environment broke"):
        await art.gather_trajectory_groups([art.TrajectoryGroup([boom(), slow()])], pbar_desc=None)
    await asyncio.sleep(0)
    assert finished == []


async def test_progress_shows_metric_means_capped_by_max_metrics(capsys):
    async def scored(i: int) -> art.Trajectory:
        return art.Trajectory(reward=i, metrics={"moves": i, "won": i % 2})

    seen = []
    unsubscribe = events.subscribe(seen.append)
    try:
        await art.gather_trajectory_groups([art.TrajectoryGroup(scored(i) for i in range(4))], pbar_desc="g",
                                           max_metrics=1)
    finally:
        unsubscribe()
    assert seen[-1]["reward_mean"] == pytest.approx(1.5) and seen[-1]["done"] == 4
    bar = capsys.readouterr().err.splitlines()[-1]
    assert "reward=1.5" in bar and "moves" not in bar  # max_metrics=1: the first mean only
    await art.gather_trajectory_groups([art.TrajectoryGroup(scored(i) for i in range(4))], pbar_desc="g")
    assert "moves=1.5" in capsys.readouterr().err.splitlines()[-1]


async def test_gather_trajectories_keeps_order_lists_and_exceptions_in_place():
    async def pair() -> list[art.Trajectory]:
        return [art.Trajectory(reward=1), art.Trajectory(reward=-1)]

    result = await art.gather_trajectories([ok(3), pair(), boom()], pbar_desc=None, max_exceptions=1)
    assert result[0].reward == 3 and [t.reward for t in result[1]] == [1, -1] and isinstance(result[2], KeyError)
    with pytest.raises(KeyError):
        await art.gather_trajectories([ok(1), boom()], pbar_desc=None)


# ---- utils --------------------------------------------------------------------------------------------

def test_iterate_dataset_gives_arts_order():
    """ART shuffles epoch e with `random.seed(e); random.shuffle(indices)`; the same batches here."""
    data = list(range(11))
    ours = [(b.step, b.epoch, b.epoch_step, b.items)
            for b in iterate_dataset(data, groups_per_step=3, num_epochs=2, use_tqdm=False)]
    state = random.getstate()
    try:
        arts = []
        for epoch in range(2):
            indices = list(range(len(data)))
            random.seed(epoch)
            random.shuffle(indices)
            for i in range(0, len(data), 3):
                arts.append((epoch * 4 + i // 3, epoch, i // 3, [data[j] for j in indices[i:i + 3]]))
    finally:
        random.setstate(state)
    assert ours == arts
    assert [b.items for b in iterate_dataset(data, 3, 2, initial_step=5, use_tqdm=False)] == [a[3] for a in arts[5:]]


def test_retry_sync_stays_sync_with_on_retry_and_backoff_factor():
    seen: list[tuple[str, int]] = []

    @retry(max_attempts=3, delay=0.001, backoff_factor=3.0, exceptions=ConnectionError,
           on_retry=lambda error, attempt: seen.append((type(error).__name__, attempt)))
    def flaky() -> str:
        if len(seen) < 2:
            raise ConnectionError
        return "ok"

    assert not asyncio.iscoroutinefunction(flaky) and flaky() == "ok"
    assert seen == [("ConnectionError", 1), ("ConnectionError", 2)]

    @retry(max_attempts=2, delay=0.001, exceptions=(ConnectionError,))
    def other() -> None:
        raise ValueError("not retried")

    with pytest.raises(ValueError):
        other()


async def test_limit_concurrency_per_derived_key():
    running: dict[str, int] = {}
    peak: dict[str, int] = {}
    together = 0  # the most calls running at once, across hosts

    @limit_concurrency(1, derive_key=lambda host, i: host)
    async def call(host: str, i: int) -> None:
        nonlocal together
        running[host] = running.get(host, 0) + 1
        peak[host] = max(peak.get(host, 0), running[host])
        together = max(together, sum(running.values()))
        await asyncio.sleep(0.01)
        running[host] -= 1

    await asyncio.gather(*(call(host, i) for host in ("a", "b") for i in range(3)))
    assert peak == {"a": 1, "b": 1}
    assert together == 2  # the two hosts ran side by side (counted, not timed: a loaded machine is slow)


def test_strip_logprobs_leaves_the_original_alone():
    choice = Choice.model_validate({"index": 0, "finish_reason": "stop", "token_ids": [1, 2],
                                    "message": {"role": "assistant", "content": "hi"},
                                    "logprobs": {"content": [{"token": "h", "logprob": -0.1, "bytes": None,
                                                              "top_logprobs": []}]}})
    stripped = strip_logprobs({"choice": choice, "nested": [{"logprobs": 1, "keep": 2}]})
    assert stripped["nested"] == [{"keep": 2}] and stripped["choice"].logprobs is None
    assert stripped["choice"].model_extra["token_ids"] == [1, 2]
    assert choice.logprobs is not None  # what trains keeps its logprobs


# ---- records: each step once -------------------------------------------------------------------------

def test_a_group_is_recorded_once_per_split_and_a_steps_metrics_once(tmp_path):
    store = ModelStore(tmp_path, "p", "m")
    group = art.TrajectoryGroup([art.Trajectory(reward=1.0)])
    record_groups(store, "m", "train", 0, [group], skip_recorded=False)  # what the train step writes
    assert record_groups(store, "m", "train", 1, [group]) == {}  # ART's model.log after train: nothing
    assert record_groups(store, "m", "val", 1, [group])["reward"] == 1.0  # another split is new
    assert record_groups(store, "m", "train", 1, [group], {"extra": 2.0}) == {"extra": 2.0}
    lines = store.read_history()
    assert [(line["step"], line["split"]) for line in lines] == [(0, "train"), (1, "val"), (1, "train")]
    assert lines[-1] == {"step": 1, "split": "train", "time": lines[-1]["time"], "train/extra": 2.0}
    assert unrecorded({"loss": 0.1, "extra": 2.0, "lr": 1.0}, {"loss": 0.1, "lr": 0.5}) == {"extra": 2.0, "lr": 1.0}


def test_best_step_is_the_highest_mean_later_on_ties():
    history = [{"step": 0, "val/reward": 0.2}, {"step": 0, "val/reward": 0.6}, {"step": 1, "val/reward": 0.3},
               {"step": 2, "train/reward": 9.0}, {"step": 3, "val/reward": 0.4}, {"step": 4, "val/reward": float("nan")}]
    assert best_step(history, "val/reward") == 3  # means: 0 -> 0.4, 1 -> 0.3, 3 -> 0.4 (ties: the later)
    with pytest.raises(UnknownMetricError, match="'val/correct': no logged step has a value of it, .*nothing was "
                                                 "deleted. Metrics in the history: 'train/reward', 'val/reward'"):
        best_step(history, "val/correct")
    with pytest.raises(UnknownMetricError, match="did you mean 'val/reward'"):
        best_step(history, "val/rewrad")
    with pytest.raises(UnknownMetricError, match="none yet"):
        best_step([], "val/reward")


def test_unknown_art_train_knobs_are_warned_once(recwarn):
    from art_nb.porting import train_config

    for _ in range(3):
        train_config(None, {"learning_rate": 1e-5, "advantage_balance": 0.3, "plot_tensors": False}, "Probe.train")
    messages = [str(w.message) for w in recwarn if "Probe.train" in str(w.message)]
    assert messages == ["Probe.train: accepted but not used by art_nb: advantage_balance (no equivalent in art_nb)"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_config(None, {"plot_tensors": False, "verbose": True, "save_checkpoint": True}, "Probe.quiet")
