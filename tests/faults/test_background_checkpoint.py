"""The checkpoint a step writes in the background: off the step's path, and never silently lost.

`train` returns once the new adapter is served from memory; the checkpoint (adapter files, optimizer
state, fsyncs, rename) lands later, while the next rollouts and the next step's forward and backward
passes run (its optimizer waits for it). These tests hold that background
write at the store and check what a user sees meanwhile and afterwards, when it works and when it
fails, and that what it writes is the step it belongs to, not a later one.
"""

from __future__ import annotations

import asyncio
import errno
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import art_nb as art
from art_nb.store import TRAINER_STATE, CheckpointError, ModelStore
from faults.conftest import adapter_equals_checkpoint, gather_groups, tiny_trainable

pytestmark = pytest.mark.slow


class HeldCommit:
    """Replaces `ModelStore.write_checkpoint` for a step's checkpoint: waits for `release`, then writes or fails."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        self.entered, self.release, self.fail = threading.Event(), threading.Event(), fail
        write = ModelStore.write_checkpoint

        def held(store: ModelStore, step: int, *args: Any, **kwargs: Any) -> Path:
            if step == 0:  # checkpoint 0 at register: not the one under test
                return write(store, step, *args, **kwargs)
            self.entered.set()
            assert self.release.wait(60), "never released"
            if self.fail:
                def no_space(directory: Path) -> None:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return write(store, step, no_space)
            return write(store, step, *args, **kwargs)

        monkeypatch.setattr(ModelStore, "write_checkpoint", held)


@pytest.fixture
async def fresh(tiny_model_dir: Path, tmp_path: Path):
    backend = art.LocalBackend(path=tmp_path / "art")
    model = tiny_trainable("background", tiny_model_dir)
    await model.register(backend)
    yield backend, model, backend._state(model)
    await backend.close()


async def test_train_returns_while_the_checkpoint_is_written_and_serves_the_new_step(fresh, monkeypatch) -> None:
    backend, model, state = fresh
    held = HeldCommit(monkeypatch)
    result = await model.train(await gather_groups(model, seed=1))
    assert result.step == 1 and held.entered.wait(10)
    assert state.store.latest_step() == 0, "the rename must wait for the background write"
    client = model.openai_client()
    completion = await client.chat.completions.create(
        model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert completion.model == "background@1"  # served from the tensors handed over in memory
    assert "background@1" in [m.id for m in (await client.models.list()).data]

    held.release.set()
    assert await backend.wait_for_checkpoint(model) == 1
    assert state.store.latest_step() == 1 and adapter_equals_checkpoint(state, 1)
    assert not [p for p in state.store.checkpoints.iterdir() if p.name.startswith(".tmp")]
    following = await model.train(await gather_groups(model, seed=2))
    assert following.metrics["time/commit_previous"] > 0 and following.metrics["time/commit_wait"] >= 0


async def test_a_failed_background_write_is_raised_by_the_next_train_after_rolling_back(fresh, monkeypatch) -> None:
    backend, model, state = fresh
    held = HeldCommit(monkeypatch, fail=True)
    groups = await gather_groups(model, seed=3)
    assert (await model.train(groups)).step == 1
    held.release.set()
    with pytest.raises(CheckpointError, match="could not write checkpoint 0001.*No space left"):
        await model.train(groups)  # raised before anything of this step happens
    assert state.step == 0 and state.store.steps() == [0]
    assert adapter_equals_checkpoint(state, 0), "the trainer kept the update that never reached the disk"
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert completion.model == "background@0"  # the failed step is no longer served
    assert 1 not in state.loaded_adapters
    monkeypatch.undo()
    assert (await model.train(groups)).step == 1  # space is back: the step is taken again
    assert await backend.wait_for_checkpoint(model) == 1 and adapter_equals_checkpoint(state, 1)


def optimizer_moments(trainer: Any) -> dict[int, dict[str, torch.Tensor]]:
    return {index: {key: value.detach().clone() for key, value in moments.items() if key != "step"}
            for index, moments in trainer._optimizer.state_dict()["state"].items()}


async def test_the_checkpoint_holds_its_own_step_even_when_written_after_the_next_step_began(fresh, monkeypatch) -> None:
    """The optimizer state is read by the background write, not copied when the step ends; that is
    right only because the next step waits for the write. Here the write is held until after the next
    `train` has started: the checkpoint must still hold step 1's moments and RNG, not step 2's."""
    backend, model, state = fresh
    held = HeldCommit(monkeypatch)
    groups = await gather_groups(model, seed=4)
    assert (await model.train(groups)).step == 1 and held.entered.wait(10)
    after_first, rng_after_first = optimizer_moments(state.trainer), torch.get_rng_state()
    groups = await gather_groups(model, seed=5)  # rollouts draw from the generator before the write lands
    train_step = state.trainer.train_step

    def update_then_release(*args: Any, **kwargs: Any) -> dict[str, float]:
        metrics = train_step(*args, **kwargs)
        held.release.set()  # were the write not awaited first, it would now see step 2's state
        return metrics

    monkeypatch.setattr(state.trainer, "train_step", update_then_release)
    threading.Timer(1.0, held.release.set).start()  # what lets it go when `train` rightly waits for it
    assert (await model.train(groups)).step == 2
    assert any(not torch.equal(after_first[i][k], v) for i, m in optimizer_moments(state.trainer).items()
               for k, v in m.items()), "the second step did not change the optimizer state"
    saved = torch.load(state.store.checkpoint_dir(1) / TRAINER_STATE, weights_only=True)
    for index, moments in after_first.items():
        for key, value in moments.items():
            assert torch.equal(saved["optimizer"]["state"][index][key], value), f"moment {index}/{key} is step 2's"
    assert torch.equal(saved["torch_rng"], rng_after_first)


async def test_the_next_step_runs_forward_and_backward_while_the_checkpoint_is_written(fresh, monkeypatch) -> None:
    """Only the optimizer's update must wait for the write: the gradient is computed meanwhile."""
    backend, model, state = fresh
    held = HeldCommit(monkeypatch)
    assert (await model.train(await gather_groups(model, seed=6))).step == 1 and held.entered.wait(10)
    after_first = optimizer_moments(state.trainer)
    groups = await gather_groups(model, seed=7)
    gradient_ready = threading.Event()

    def on_progress(event: dict[str, Any]) -> None:
        if event.get("phase") == "train" and event["done"] == event["total"]:
            gradient_ready.set()

    step = asyncio.ensure_future(model.train(groups, on_progress=on_progress))
    assert await asyncio.to_thread(gradient_ready.wait, 60), "the backward passes waited for the checkpoint"
    await asyncio.sleep(0.5)
    assert not step.done() and state.store.latest_step() == 0
    assert all(torch.equal(after_first[i][k], v) for i, m in optimizer_moments(state.trainer).items()
               for k, v in m.items()), "the optimizer stepped before the checkpoint was written"
    held.release.set()
    result = await step
    assert result.step == 2 and result.metrics["time/commit_wait"] >= 0.5
    assert await backend.wait_for_checkpoint(model) == 2 and adapter_equals_checkpoint(state, 2)


async def test_a_write_failing_while_the_next_step_trains_abandons_that_step_and_rolls_back(fresh, monkeypatch) -> None:
    backend, model, state = fresh
    held = HeldCommit(monkeypatch, fail=True)
    assert (await model.train(await gather_groups(model, seed=8))).step == 1 and held.entered.wait(10)
    groups = await gather_groups(model, seed=9)
    train_step = state.trainer.train_step
    updated: list[float] = []

    def fail_while_training(*args: Any, **kwargs: Any) -> dict[str, float]:
        held.release.set()  # the write fails while this step computes its gradient
        metrics = train_step(*args, **kwargs)
        updated.append(metrics.get("stopped", 0.0))
        return metrics

    monkeypatch.setattr(state.trainer, "train_step", fail_while_training)
    with pytest.raises(CheckpointError, match="could not write checkpoint 0001.*No space left"):
        await model.train(groups)
    assert updated == [1.0], "the step updated the weights on top of a checkpoint that never landed"
    assert state.step == 0 and state.store.steps() == [0] and adapter_equals_checkpoint(state, 0)
    assert 1 not in state.loaded_adapters
