"""Out of GPU memory while training beside an awake vLLM: the engine sleeps and the step is taken again.

The fallback lives in `VLLMEngine.train_with`, so it is tested there. No GPU here: the engine is
built around a stand-in for vLLM's in-process core that records sleep and wake, with the memory
plan set by hand (`train_awake=True`, as it is on a GPU with room for both), and the step raises
torch.OutOfMemoryError the first time, before the optimizer steps, as an allocation that fails
mid-forward does. The backend's part (one `train_with` call around the trainer) is covered by the
local backend's tests.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from art_nb.local.engines.vllm.engine import VLLMEngine
from art_nb.local.engines.vllm.thread import VLLMThread


class FakeCore:
    """The two calls of vLLM's LLMEngine that `train_with` makes, recorded in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.asleep = False

    def sleep(self, level: int) -> None:
        assert level == 1 and not self.asleep
        self.calls.append("sleep")
        self.asleep = True

    def wake_up(self) -> None:
        assert self.asleep
        self.calls.append("wake_up")
        self.asleep = False


@pytest.fixture
def core() -> FakeCore:
    return FakeCore()


@pytest.fixture
def worker() -> Iterator[VLLMThread]:
    thread = VLLMThread()
    yield thread
    thread.stop()
    thread.join()


def engine_around(core: FakeCore, worker: VLLMThread, train_awake: bool) -> VLLMEngine:
    return VLLMEngine(core, worker, tokenizer=None, max_context=256, on_cuda=True, reasons=[], train_awake=train_awake)


class Step:
    """A train step that records whether vLLM slept while it ran, and fails the first `fail` times."""

    def __init__(self, core: FakeCore, fail: int = 0, error: type[Exception] = torch.OutOfMemoryError) -> None:
        self.core, self.fail, self.error = core, fail, error
        self.ran_asleep: list[bool] = []

    async def __call__(self) -> dict[str, float]:
        self.ran_asleep.append(self.core.asleep)
        if len(self.ran_asleep) <= self.fail:
            raise self.error("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"loss": 0.5}


async def test_oom_beside_an_awake_engine_falls_back_to_sleeping(core, worker, caplog) -> None:
    engine = engine_around(core, worker, train_awake=True)
    step = Step(core, fail=1)
    with caplog.at_level(logging.WARNING, logger="art_nb"):
        assert await engine.train_with(step) == {"loss": 0.5}
    assert step.ran_asleep == [False, True]  # tried beside the awake engine, retried exactly once asleep
    assert core.calls == ["sleep", "wake_up"]  # slept once, for the retry, and awake on return
    assert any("ran out of GPU memory beside an awake vLLM" in r.getMessage() for r in caplog.records)

    later = Step(core)  # and sleeps for every later step
    assert await engine.train_with(later) == {"loss": 0.5}
    assert later.ran_asleep == [True] and core.calls == ["sleep", "wake_up"] * 2
    await engine.train_with(later)
    assert later.ran_asleep == [True, True] and core.calls == ["sleep", "wake_up"] * 3


async def test_an_engine_planned_awake_stays_awake_while_training_fits(core, worker) -> None:
    engine = engine_around(core, worker, train_awake=True)
    for _ in range(2):
        step = Step(core)
        await engine.train_with(step)
        assert step.ran_asleep == [False]
    assert core.calls == []


async def test_oom_while_asleep_is_raised_not_retried(core, worker) -> None:
    engine = engine_around(core, worker, train_awake=False)
    step = Step(core, fail=1)
    with pytest.raises(torch.OutOfMemoryError):
        await engine.train_with(step)
    assert step.ran_asleep == [True]  # slept first (the plan said so), ran once
    assert core.calls == ["sleep", "wake_up"]  # awake again although the step failed


async def test_other_errors_beside_an_awake_engine_are_raised_and_the_plan_stands(core, worker) -> None:
    engine = engine_around(core, worker, train_awake=True)
    step = Step(core, fail=1, error=ValueError)
    with pytest.raises(ValueError):
        await engine.train_with(step)
    assert step.ran_asleep == [False] and core.calls == []
    after = Step(core)
    await engine.train_with(after)
    assert after.ran_asleep == [False]  # only running out of memory changes the plan


async def test_a_second_oom_after_sleeping_is_raised(core, worker) -> None:
    engine = engine_around(core, worker, train_awake=True)
    step = Step(core, fail=2)
    with pytest.raises(torch.OutOfMemoryError):
        await engine.train_with(step)
    assert step.ran_asleep == [False, True]  # one retry, not a loop
    assert core.calls == ["sleep", "wake_up"]
