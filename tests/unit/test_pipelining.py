"""art.pipeline over a fake backend: what runs when, which adapter the rollouts name, and what an
interrupt stops. The real backend's side (the step beside the rollouts, resume, records) is in
tests/faults/test_pipeline_faults.py."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import art_nb as art
from art_nb.pipelining import pinned_step, plan_says, policy_lag, rollouts_beside


class FakeBackend:
    """Serves `step`; `train` takes `train_s` and advances it, recording what ran beside it."""

    def __init__(self, choice: str | None = None, step: int = 0, train_s: float = 0.05) -> None:
        self.step, self.train_s = step, train_s
        self.directory = Path(tempfile.mkdtemp(prefix="art_nb_pipelining_"))
        self._choices = {} if choice is None else {"pipeline": choice}
        self.log: list[tuple[str, int]] = []
        self.beside: list[bool] = []

    def choices(self, model: Any) -> dict[str, str]:
        return dict(self._choices)

    def model_dir(self, model: Any) -> Path:
        return self.directory

    def inference_model_name(self, model: Any, step: int | None = None) -> str:
        return f"{model.name}@{self.step if step is None else step}"

    async def get_step(self, model: Any) -> int:
        return self.step

    async def train(self, model: Any, groups: list[art.TrajectoryGroup], config: Any = None, **_: Any) -> Any:
        self.beside.append(rollouts_beside())
        self.log.append(("train start", self.step))
        await asyncio.sleep(self.train_s)
        self.step += 1
        self.log.append(("train end", self.step))
        return self.step


def make_model(backend: FakeBackend) -> art.TrainableModel:
    model = art.TrainableModel(name="m", project="p", base_model="base")
    model._backend = backend  # type: ignore[assignment]
    return model


def gatherer(model: art.TrainableModel, backend: FakeBackend, rollout_s: float = 0.02, rollouts: int = 4):
    """A gather whose rollouts each sleep, then name the model as a rollout would; records (step, name)."""
    seen: list[tuple[int, str]] = []

    async def rollout(step: int, i: int) -> art.Trajectory:
        await asyncio.sleep(rollout_s * (i + 1))
        name = model.get_inference_name()
        seen.append((step, name))
        return art.Trajectory(reward=float(i), metadata={"name": name})

    async def gather(step: int) -> list[art.TrajectoryGroup]:
        backend.log.append(("gather start", step))
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(step, i) for i in range(rollouts))], pbar_desc=None)
        backend.log.append(("gather end", step))
        return groups

    return gather, seen


async def test_off_each_gather_waits_for_the_train_before_it() -> None:
    backend = FakeBackend()
    model = make_model(backend)
    gather, seen = gatherer(model, backend)
    trained = []
    async for groups in art.pipeline(model, gather, 3, enabled=False):
        trained.append([t.initial_policy_version for g in groups for t in g.trajectories])
        await model.train(groups)
    starts = [entry for entry in backend.log if entry[0] in ("gather start", "train end")]
    assert starts == [("gather start", 0), ("train end", 1), ("gather start", 1), ("train end", 2),
                      ("gather start", 2), ("train end", 3)]
    assert trained == [[0] * 4, [1] * 4, [2] * 4]  # on-policy: sampled from the step they train
    assert {name for _, name in seen} == {"m@0", "m@1", "m@2"} and backend.beside == [False] * 3


async def test_on_the_next_gather_runs_during_the_train_and_samples_the_step_before() -> None:
    backend = FakeBackend(train_s=0.2)
    model = make_model(backend)
    gather, seen = gatherer(model, backend, rollout_s=0.08)  # the last rollout ends after the train
    trained: list[tuple[int, list[int | None]]] = []
    async for groups in art.pipeline(model, gather, 3, enabled=True):
        versions = [t.initial_policy_version for g in groups for t in g.trajectories]
        trained.append((backend.step, versions))
        assert all(t.final_policy_version == versions[0] for g in groups for t in g.trajectories)
        await model.train(groups)
    log = backend.log
    # gather 1 started before train 0 ended, and finished after it: it overlapped the step
    assert log.index(("gather start", 1)) < log.index(("train end", 1)) < log.index(("gather end", 1))
    # every rollout of gather k named the adapter served when it started (k-1 for k > 0), even after
    # the train had moved the served step on
    assert sorted(set(seen)) == [(0, "m@0"), (1, "m@0"), (2, "m@1")]
    assert trained == [(0, [0] * 4), (1, [0] * 4), (2, [1] * 4)]
    assert backend.beside == [True, True, False]  # the last step has nothing gathered beside it
    assert policy_lag(groups, 2) == {"pipeline/lag_steps": 1.0, "pipeline/lag_max": 1.0}
    assert not rollouts_beside()


async def test_auto_follows_the_backends_plan_and_resumes_at_the_served_step() -> None:
    for choice, expected in (("on: vLLM stays awake", True), ("off: CPU", False), (None, False)):
        backend = FakeBackend(choice, step=2)
        model = make_model(backend)
        gather, _ = gatherer(model, backend, rollout_s=0.0, rollouts=1)
        pipe = art.pipeline(model, gather, 4)
        steps = []
        async for groups in pipe:
            steps.append(groups[0].trajectories[0].initial_policy_version)
            await model.train(groups)
        # pipelined, step 3 trains on games sampled from step 2's adapter
        assert steps == ([2, 2] if expected else [2, 3]) and pipe.on is expected, (choice, pipe.reason)
        assert pipe.reason.startswith("on" if expected else "off")
    assert plan_says({}) == (False, "off: this backend's plan makes no pipeline choice")
    backend = FakeBackend(step=5)
    model = make_model(backend)
    assert [g async for g in art.pipeline(model, gatherer(model, backend)[0], 5)] == []  # trained to the end


async def test_an_interrupted_train_cancels_the_rollouts_gathered_beside_it() -> None:
    backend = FakeBackend(train_s=30)
    model = make_model(backend)
    cancelled: list[int] = []
    started = asyncio.Event()

    async def gather(step: int) -> list[art.TrajectoryGroup]:
        if step == 0:
            return [art.TrajectoryGroup([art.Trajectory(reward=0.0)])]
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(step)
            raise
        return []

    async def cell() -> None:
        async for groups in art.pipeline(model, gather, 5, enabled=True):
            await model.train(groups)

    task = asyncio.ensure_future(cell())
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(5):  # no gc.collect(): the iterator goes as the loop unwinds
        await asyncio.sleep(0)
    assert cancelled == [1], "the next step's gather kept running after the cell was interrupted"


async def test_an_interrupt_while_waiting_for_a_gather_cancels_it() -> None:
    backend = FakeBackend()
    model = make_model(backend)
    cancelled: list[int] = []

    async def gather(step: int) -> list[art.TrajectoryGroup]:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(step)
            raise
        return []

    pipe = art.pipeline(model, gather, 3, enabled=True)
    waiting = asyncio.ensure_future(pipe.__anext__())
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert cancelled == [0]  # settled before the interrupt reached the caller


async def test_a_failed_gather_beside_the_train_is_raised_by_the_loop() -> None:
    backend = FakeBackend()
    model = make_model(backend)

    async def gather(step: int) -> list[art.TrajectoryGroup]:
        if step == 1:
            raise art.TooManyExceptionsError("3 rollouts raised")
        return [art.TrajectoryGroup([art.Trajectory(reward=0.0)])]

    trained = 0
    with pytest.raises(art.TooManyExceptionsError):
        async for groups in art.pipeline(model, gather, 3, enabled=True):
            await model.train(groups)
            trained += 1
    assert trained == 1 and backend.step == 1


async def test_aclose_and_a_bad_gather() -> None:
    backend = FakeBackend()
    model = make_model(backend)
    gather, _ = gatherer(model, backend, rollout_s=1.0)
    pipe = art.pipeline(model, gather, 3, enabled=True)
    await anext(pipe)
    assert pipe.gathering
    await pipe.aclose()
    assert not pipe.gathering

    async def wrong(step: int) -> Any:
        return art.TrajectoryGroup([])

    with pytest.raises(TypeError, match="list of TrajectoryGroups"):
        await anext(art.pipeline(model, wrong, 3))
    with pytest.raises(ValueError, match="enabled="):
        art.pipeline(model, wrong, 3, enabled="yes")  # type: ignore[arg-type]


async def test_the_pin_is_per_model_and_only_inside_the_gather() -> None:
    backend = FakeBackend(step=4)
    model, judge = make_model(backend), art.TrainableModel(name="judge", project="p", base_model="base")
    judge._backend = backend  # type: ignore[assignment]
    names: list[tuple[str, str, int | None]] = []

    async def gather(step: int) -> list[art.TrajectoryGroup]:
        backend.step = 9  # the served step moves on while the gather runs
        names.append((model.get_inference_name(), judge.get_inference_name(), pinned_step(model)))
        return [art.TrajectoryGroup([art.Trajectory(reward=0.0)])]

    await anext(art.pipeline(model, gather, 5, enabled=False))
    assert names == [("m@4", "judge@9", 4)]
    assert model.get_inference_name() == "m@9" and pinned_step(model) is None
    assert model.get_inference_name(2) == "m@2"


class ListingModel:
    """A trainable model whose endpoint lists `listed` (what `/v1/models` says is served)."""

    name, project, trainable = "m", "p", True

    def __init__(self, backend: FakeBackend, listed: list[str]) -> None:
        self.backend, self.listed = backend, listed

    async def get_step(self) -> int:
        return self.backend.step

    def get_inference_name(self, step: int | None = None) -> str:
        return self.backend.inference_model_name(self, pinned_step(self) if step is None else step)

    def openai_client(self) -> Any:
        async def models() -> Any:
            for name in self.listed:
                yield SimpleNamespace(id=name)

        return SimpleNamespace(models=SimpleNamespace(list=models))


@pytest.mark.parametrize("history, listed, sampled", [
    ({"train/pipeline/beside": 1.0}, ["m@2", "m@3"], 2),  # the step before trained beside a gather: as it did
    ({"train/pipeline/beside": 1.0}, ["m@3"], 3),  # its checkpoint is gone: the served step
    ({"train/loss": 0.1}, ["m@2", "m@3"], 3),  # a synchronous step (or SFT) made step 3: the served step
])
async def test_a_resumed_pipelined_loop_samples_what_the_unstopped_run_did(history: dict[str, float],
                                                                          listed: list[str], sampled: int) -> None:
    backend = FakeBackend(step=3)
    (backend.directory / "history.jsonl").write_text(json.dumps({"step": 2, "split": "train", **history}) + "\n")
    model = ListingModel(backend, listed)
    names: list[str] = []

    async def gather(step: int) -> list[art.TrajectoryGroup]:
        names.append(model.get_inference_name())
        return [art.TrajectoryGroup([art.Trajectory(reward=0.0)])]

    groups = await anext(art.pipeline(model, gather, 5, enabled=True))
    assert names == [f"m@{sampled}"] and groups[0].trajectories[0].initial_policy_version == sampled


def test_the_plan_pipelines_only_where_the_engine_serves_through_a_step_on_a_gpu() -> None:
    from art_nb.local.plan.choices import Plan, pipeline_choice

    cpu = Plan("cpu", "float32", "hf", "peft", False, 1)
    gpu = Plan("cuda", "bfloat16", "vllm", "unsloth", False, None, (9, 0))
    assert pipeline_choice(cpu, serves_while_training=True).startswith("off: CPU")
    assert "enabled=True" in pipeline_choice(cpu, True)  # how to force it is in the reason
    assert pipeline_choice(gpu, True).startswith("on: vLLM stays awake")
    assert pipeline_choice(gpu, False).startswith("off: vLLM sleeps")
    assert pipeline_choice(Plan("cuda", "float16", "hf", "unsloth", False, None, (7, 5)), False).startswith(
        "off: the transformers engine")
    for serves in (True, False):  # what art.pipeline(enabled="auto") reads from it
        assert plan_says({"pipeline": pipeline_choice(gpu, serves)})[0] is serves


def test_the_plan_leaves_small_models_unpipelined_on_a_gpu_as_measured() -> None:
    """On an H200 a 135M model's pipelined step was slower, a 3B model's faster: the size decides."""
    from art_nb.local.plan.choices import Plan, pipeline_choice

    gpu = Plan("cuda", "bfloat16", "vllm", "unsloth", False, None, (9, 0))
    small = pipeline_choice(gpu, True, parameters=135_000_000)
    assert small.startswith("off: a 135M-parameter model") and "enabled=True" in small and "3.40 s" in small
    assert plan_says({"pipeline": small})[0] is False
    large = pipeline_choice(gpu, True, parameters=3_100_000_000)
    assert large.startswith("on: vLLM stays awake") and "1.25x" in large
    assert pipeline_choice(gpu, False, parameters=3_100_000_000).startswith("off: vLLM sleeps")


def test_the_demo_takes_the_pipeline_switch() -> None:
    import argparse

    from art_nb.cli import _demo_parser

    parser = argparse.ArgumentParser()
    _demo_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["demo", "--pipeline"]).pipeline == "on"
    assert parser.parse_args(["demo"]).pipeline == "auto"
    assert parser.parse_args(["demo", "--pipeline", "off"]).pipeline == "off"
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--pipeline", "yes"])


def test_art_nb_serve_learns_of_the_clients_pipeline_from_its_request() -> None:
    from pydantic import ValidationError

    from art_nb.pipelining import rollouts_run_beside
    from art_nb.wire import TrainBody

    assert not rollouts_beside()
    with rollouts_run_beside(True):
        assert rollouts_beside()
    assert not rollouts_beside()
    assert TrainBody.model_validate({"beside": True}).beside and not TrainBody().beside
    with pytest.raises(ValidationError):
        TrainBody.model_validate({"beside": "yes"})
