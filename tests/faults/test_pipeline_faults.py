"""Pipelined training (art.pipeline, forced on: the CPU plan leaves it off) keeps every guarantee of
the synchronous loop, on the real LocalBackend, HFEngine and PeftTrainer with the tiny model:

- the games of step N+1 are played while step N trains, from step N's adapter, and the records say
  so: each trajectory of step N+1 names adapter N, the history records the lag;
- killed anywhere (mid-step with the next gather running, mid-gather, mid-checkpoint) and
  restarted, a pipelined run resumes at its newest checkpoint and ends bit-identical to a run that
  was never killed, having trained each step on the same scenarios (tests/faults/worker.py
  `pipeline_run`; the checks after each kill are test_sigkill_resume.py's);
- an interrupt mid-step settles the step as in the synchronous loop (abandoned before the optimizer
  steps, finished after) and cancels the rollouts gathered beside it: nothing of them is recorded,
  no request is left in the engine, and running the loop again carries on.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

import art_nb as art
from faults.conftest import Zygote, adapter_equals_checkpoint, read_events, rollout, tiny_trainable, wait_for_commit
from faults.test_interrupts import Hold, wait_until
from faults.test_sigkill_resume import Chain, adapter, complete_steps, model_dir, trained_scenarios
from faults.worker import STEPS

pytestmark = pytest.mark.slow

# Where a pipelined run is killed, one restart after another, each early in its run so that every
# point is reached: in the first step's backward pass (the next step's games being played beside it),
# in a request of the first gather and of the one beside the step (a gather is 8 requests), once that
# gather is done, as a checkpoint is renamed into place, as an update is handed over (the first load
# of a resumed run is its register's), and right after a step returned.
KILLS = ["backward:1", "request:3", "request:11", "gathered:2", "renamed:1", "adapter_loaded:2", "trained:1"]


def train_records(model_root: Path, step: int) -> list[dict[str, Any]]:
    """The train trajectories recorded for `step` in a model's directory."""
    path = model_root / "trajectories" / "train" / f"{step:04d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def pipelined(zygote: Zygote, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pipelined run that is never killed."""
    run_dir = tmp_path_factory.mktemp("pipelined")
    assert zygote.run(scenario="pipeline", run_dir=run_dir, model_dir=tiny_model_dir) == 0, zygote.log()
    assert complete_steps(run_dir) == list(range(STEPS + 1))
    return run_dir


def test_each_step_trains_games_from_the_adapter_before_it(pipelined: Path) -> None:
    trained = [e for e in read_events(pipelined) if e["event"] == "trained"]
    assert [e["step"] for e in trained] == list(range(1, STEPS + 1))
    # rollouts ran beside every step but the last (nothing is left to gather then)
    assert [e["beside"] for e in trained] == [1.0] * (STEPS - 1) + [0.0]
    assert [e["lag"] for e in trained] == [0.0] + [1.0] * (STEPS - 1)
    for step in range(STEPS):
        sampled_from = max(step - 1, 0)
        versions = {(r["initial_policy_version"], r["final_policy_version"]) for r in train_records(model_dir(pipelined), step)}
        assert versions == {(sampled_from, sampled_from)}, (step, versions)
    history = [json.loads(line) for line in (model_dir(pipelined) / "history.jsonl").read_text().splitlines()]
    lags = {r["step"]: r["train/pipeline/lag_steps"] for r in history if "train/pipeline/lag_steps" in r}
    assert lags == {0: 0.0, **{step: 1.0 for step in range(1, STEPS)}}
    # the games of step N+1 started before step N had finished training (its "trained" event names N+1)
    events = read_events(pipelined)
    started = {e["step"]: i for i, e in enumerate(events) if e["event"] == "gather_started"}
    finished = {e["step"]: i for i, e in enumerate(events) if e["event"] == "trained"}
    assert all(started[step] < finished[step] for step in range(1, STEPS)), "a gather waited for the step before"


def test_a_killed_pipelined_run_resumes_exactly(zygote: Zygote, tiny_model_dir: Path, pipelined: Path,
                                               tmp_path: Path) -> None:
    run = Chain(zygote, tmp_path / "killed", tiny_model_dir, scenario="pipeline")
    for point in KILLS:
        run.kill_at(point)
    run.finish()
    assert trained_scenarios(run.run_dir) == trained_scenarios(pipelined), "a step trained on other scenarios"
    ours, theirs = adapter(run.run_dir), adapter(pipelined)
    diff = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
    assert diff == 0.0, f"the killed pipelined run ends {diff} away from the one never killed"
    resumed = [e["step"] for e in read_events(run.run_dir) if e["event"] == "resumed"]
    assert len(resumed) == len(KILLS) + 1 and max(resumed) > 1, resumed


# ---- interrupts, in this process -----------------------------------------------------------------


@pytest.fixture
async def served(tiny_model_dir: Path, tmp_path: Path):
    backend = art.LocalBackend(path=tmp_path / "art")
    model = tiny_trainable("pipelined", tiny_model_dir)
    await model.register(backend)
    yield backend, model, backend._state(model)
    await backend.close()


def slow_gather(model: Any, started: list[int]) -> Any:
    """Games of 6 turns with a pause between turns: a gather that is still running when a step ends."""

    async def one(step: int, index: int) -> art.Trajectory:
        trajectory = await rollout(model, step * 100 + index, max_tokens=6, turns=6)
        await asyncio.sleep(0.2)
        return trajectory

    async def gather(step: int) -> list[art.TrajectoryGroup]:
        started.append(step)
        return await art.gather_trajectory_groups(
            [art.TrajectoryGroup(one(step, 10 * g + i) for i in range(3)) for g in range(2)], pbar_desc=None)

    return gather


@pytest.mark.parametrize("when", ["before_the_optimizer", "after_the_optimizer"])
async def test_an_interrupt_settles_the_step_and_stops_the_games_beside_it(served, when: str) -> None:
    backend, model, state = served
    gate = backend._runtime.gate
    started: list[int] = []
    hold = Hold()
    if when == "before_the_optimizer":  # the first microbatch's forward pass of step 0
        handle = state.trainer.model.get_base_model().get_decoder().register_forward_pre_hook(hold)
        release = handle.remove
    else:  # the optimizer has stepped; the update is being handed over
        copy = state.trainer.adapter_weights
        state.trainer.adapter_weights = lambda: (hold(), copy())[1]

        def release() -> None:
            del state.trainer.adapter_weights

    async def cell() -> None:
        async for groups in art.pipeline(model, slow_gather(model, started), 3, enabled=True):
            await model.train(groups)

    task = asyncio.ensure_future(cell())
    try:
        await hold.wait_reached()
        await wait_until(lambda: started == [0, 1] and gate.in_flight > 0)  # step 1's games are being played
        task.cancel()
        await asyncio.sleep(0.2)
        assert not task.done(), "the interrupt returned before the trainer had settled"
        hold.release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        hold.release.set()
        release()
    await wait_until(lambda: gate.in_flight == 0 and not state.engine._batch.rows, timeout=10)
    assert not gate.paused
    expected = 0 if when == "before_the_optimizer" else 1
    assert state.step == expected
    wait_for_commit(state)
    assert state.store.steps() == list(range(expected + 1))
    assert adapter_equals_checkpoint(state, expected)
    recorded = sorted(p.name for p in (state.store.dir / "trajectories" / "train").glob("*.jsonl"))
    assert recorded == ["0000.jsonl"], f"the games gathered beside the step were recorded: {recorded}"
    assert len(train_records(state.store.dir, 0)) == 6  # step 0's games, recorded before it trained
    trained = [r for r in state.store.read_history() if "train/loss" in r]
    assert [r["step"] for r in trained] == ([] if expected == 0 else [0]), "a step left half its records"

    started.clear()  # running the loop again carries on from the served step
    async for groups in art.pipeline(model, slow_gather(model, started), expected + 2, enabled=True):
        result = await model.train(groups)
    assert result.step == expected + 2
    versions = {r["initial_policy_version"] for r in train_records(state.store.dir, expected + 1)}
    assert versions == {expected}, "step N+1's games did not name adapter N"

