"""Non-finite loss, gradients or weights: the update is skipped, counted, reported; then training stops.

Three different faults in a row on the real trainer (TrainConfig.max_nonfinite_steps = 3):
NaN activations (NaN loss), an infinite gradient (finite loss), and an update whose finite
settings overflow the weights (weight decay 1e300 in float32). The first two change nothing; the
third is rolled back to the last checkpoint. The third raises `TrainingStoppedError` naming the last
good checkpoint. No checkpoint ever holds a non-finite number, and a good step afterwards trains.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import art_nb as art
from art_nb.local import TrainingStoppedError
from art_nb.store import CheckpointError
from faults.conftest import adapter_equals_checkpoint, gather_groups, rollout, tiny_trainable

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
async def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("nonfinite"))
    model = tiny_trainable("nonfinite", tiny_model_dir)
    await model.register(backend)
    yield backend, model, backend._state(model)
    await backend.close()


def assert_every_checkpoint_finite(state) -> None:
    for step in state.store.steps():
        directory = state.store.checkpoint_dir(step)
        weights = load_file(str(directory / "adapter_model.safetensors"))
        assert all(torch.isfinite(t).all() for t in weights.values()), f"checkpoint {step} has non-finite weights"
        trainer_state = torch.load(directory / "trainer_state.pt", weights_only=True)
        moments = [t for s in (trainer_state["optimizer"] or {}).get("state", {}).values() for t in s.values()]
        assert all(torch.isfinite(t).all() for t in moments if t.is_floating_point()), f"checkpoint {step}: optimizer"


async def test_three_nonfinite_updates_in_a_row_stop_training_naming_the_last_good_checkpoint(served) -> None:
    backend, model, state = served
    config = art.TrainConfig(learning_rate=1e-2)
    groups = await gather_groups(model)
    assert (await model.train(groups, config=config)).metrics["skipped_nonfinite"] == 0
    good = state.step
    decoder = state.trainer.model.get_base_model().get_decoder()

    # 1. NaN activations: the loss is NaN.
    def nan_hidden(module, args, output):
        output["last_hidden_state"] = output["last_hidden_state"] * float("nan")

    handle = decoder.register_forward_hook(nan_hidden)
    try:
        first = await model.train(groups, config=config)
    finally:
        handle.remove()
    assert first.metrics["skipped_nonfinite"] == 1 and first.metrics["nonfinite_in_row"] == 1
    assert first.metrics["tokens_trained"] == 0
    assert adapter_equals_checkpoint(state, good), "a NaN loss changed the weights"

    # 2. An infinite gradient behind a finite loss.
    param = next(p for p in state.trainer.model.parameters() if p.requires_grad)
    handle = param.register_hook(lambda grad: grad * float("inf"))
    try:
        second = await model.train(groups, config=config)
    finally:
        handle.remove()
    assert second.metrics["skipped_nonfinite"] == 1 and second.metrics["nonfinite_in_row"] == 2
    assert second.metrics["loss"] == second.metrics["loss"]  # the loss itself was finite
    assert adapter_equals_checkpoint(state, good), "an infinite gradient changed the weights"

    # 3. Finite settings, non-finite result: the update overflows the float32 weights. Rolled back, third in a row.
    last_good = state.step
    with pytest.raises(TrainingStoppedError, match=f"3 consecutive.*last good checkpoint is step {last_good}") as stopped:
        await model.train(groups, config=art.TrainConfig(learning_rate=1.0, weight_decay=1e300))
    assert str(state.store.checkpoint_dir(last_good)) in str(stopped.value)
    assert state.step == last_good and state.store.latest_step() == last_good
    assert adapter_equals_checkpoint(state, good), "the overflowed weights were kept in memory"
    assert_every_checkpoint_finite(state)

    history = state.store.read_history()
    assert [r["train/skipped_nonfinite"] for r in history if "train/skipped_nonfinite" in r][-2:] == [1.0, 1.0]

    # The engine serves on, and a good step trains and resets the count.
    await rollout(model, 3)
    recovered = await model.train(groups, config=config)
    assert recovered.metrics["skipped_nonfinite"] == 0 and recovered.metrics["nonfinite_in_row"] == 0
    assert recovered.metrics["tokens_trained"] > 0 and not adapter_equals_checkpoint(state, good)
    assert_every_checkpoint_finite(state)


async def test_nonfinite_weights_are_never_written(served) -> None:
    backend, model, state = served
    param = next(p for p in state.trainer.model.parameters() if p.requires_grad)
    before, steps = param.detach().clone(), state.store.steps()
    with torch.no_grad():
        param[0, 0] = float("inf")
    try:
        with pytest.raises(CheckpointError, match="refusing to save non-finite adapter weights"):
            state.store.write_checkpoint(99, state.trainer.save)
    finally:
        with torch.no_grad():
            param.copy_(before)
    assert state.store.steps() == steps
    assert not [p for p in state.store.checkpoints.iterdir() if p.name.startswith(".tmp")]
