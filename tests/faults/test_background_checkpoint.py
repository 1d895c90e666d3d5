"""The checkpoint a step writes in the background: off the step's path, and never silently lost.

`train` returns once the new adapter is served from a staged directory; the optimizer state, the
fsyncs and the rename land later, while the next rollouts run. These tests hold that background
write at the store and check what a user sees meanwhile and afterwards, when it works and when it fails.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

import pytest

import art_nb as art
from art_nb.store import CheckpointError, ModelStore
from faults.conftest import adapter_equals_checkpoint, gather_groups, tiny_trainable

pytestmark = pytest.mark.slow


class HeldCommit:
    """Replaces `ModelStore.write_checkpoint` for staged checkpoints: waits for `release`, then writes or fails."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        self.entered, self.release, self.fail = threading.Event(), threading.Event(), fail
        write = ModelStore.write_checkpoint

        def held(store: ModelStore, step: int, *args: Any, staged: Path | None = None, **kwargs: Any) -> Path:
            if staged is None:  # checkpoint 0 at register: not the one under test
                return write(store, step, *args, **kwargs)
            self.entered.set()
            assert self.release.wait(60), "never released"
            if self.fail:
                def no_space(directory: Path) -> None:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return write(store, step, no_space, staged=staged)
            return write(store, step, *args, staged=staged, **kwargs)

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
    assert completion.model == "background@1"  # served from the staged adapter
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
