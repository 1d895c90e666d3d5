"""Disk full while saving: a clear error, the previous checkpoint intact, the next step works.

No small filesystem can be mounted here, so the full disk is made two ways:
- in-process, each writer of a checkpoint fails the way it fails on a full disk (safetensors and
  torch.save with their own error types after writing part of a file, meta.json with ENOSPC,
  fsync with ENOSPC as delayed allocation reports it), through the real LocalBackend.train;
- in a worker process, the kernel itself refuses the writes (RLIMIT_FSIZE: EFBIG, the sibling of
  ENOSPC), inside the real safetensors/torch writers.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pathlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError

import art_nb as art
from art_nb.store import CheckpointError, ModelStore
from faults.conftest import (
    Zygote,
    adapter_equals_checkpoint,
    gather_groups,
    read_events,
    rollout,
    tiny_trainable,
)

pytestmark = pytest.mark.slow

NO_SPACE = "No space left on device"


@pytest.fixture(scope="module")
async def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("disk"))
    model = tiny_trainable("disk-full", tiny_model_dir)
    await model.register(backend)
    yield backend, model, backend._state(model)
    await backend.close()


def _write_part(path: Any, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data[: len(data) // 2])


def full_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch

    def save_file(tensors: dict, filename: str, metadata: Any = None) -> None:
        _write_part(filename, safetensors.torch.save(tensors, metadata=metadata))
        raise SafetensorError(f"Error while serializing: I/O error: {NO_SPACE} (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)  # what store.write_adapter calls


def full_trainer_state(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    save = torch.save

    def partial_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        buffer = io.BytesIO()
        save(obj, buffer)
        _write_part(f, buffer.getvalue())
        raise RuntimeError(f"PytorchStreamWriter failed writing file data/0: file write failed ({NO_SPACE})")

    monkeypatch.setattr(torch, "save", partial_save)


def full_meta(monkeypatch: pytest.MonkeyPatch) -> None:
    write_text = pathlib.Path.write_text

    def write(self: Path, *args: Any, **kwargs: Any) -> int:
        if self.name == "meta.json":
            raise OSError(errno.ENOSPC, NO_SPACE)
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", write)


def full_at_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if ".tmp-" in os.readlink(f"/proc/self/fd/{fd}"):  # a checkpoint file being written
            raise OSError(errno.ENOSPC, NO_SPACE)  # delayed allocation: the write "worked", the flush does not
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)


FAULTS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "adapter safetensors": full_adapter,
    "trainer_state.pt": full_trainer_state,
    "meta.json": full_meta,
    "fsync": full_at_fsync,
}


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("where", sorted(FAULTS))
async def test_disk_full_while_saving(where: str, served, monkeypatch: pytest.MonkeyPatch) -> None:
    backend, model, state = served
    groups = await gather_groups(model, seed=sorted(FAULTS).index(where))
    await backend.wait_for_checkpoint(model)  # the case before ends with a step whose commit runs in the background
    step = state.step
    previous = digest(state.store.checkpoint_dir(step))
    with monkeypatch.context() as patch:
        FAULTS[where](patch)
        with pytest.raises(CheckpointError) as caught:
            # The checkpoint is written in the background (train hands the adapter over in memory),
            # so a full disk is reported by the wait (or by the next train).
            await model.train(groups)
            await backend.wait_for_checkpoint(model)
    message = str(caught.value)
    assert f"could not write checkpoint {step + 1:04d}" in message and NO_SPACE in message
    assert f"the previous checkpoint (step {step}) is intact" in message
    assert state.step == step and state.store.steps()[-1] == step
    assert digest(state.store.checkpoint_dir(step)) == previous
    assert not [p.name for p in state.store.checkpoints.iterdir() if p.name.startswith(".tmp")]
    assert adapter_equals_checkpoint(state, step), "the unsaved update stayed in the trainer"
    await rollout(model, 1)  # still serving
    result = await model.train(groups)  # space is back: the next step works
    assert result.step == step + 1 and result.metrics["tokens_trained"] > 0


async def test_disk_full_while_logging_rollouts_trains_nothing(served, monkeypatch: pytest.MonkeyPatch) -> None:
    backend, model, state = served
    groups = await gather_groups(model, seed=77)
    step = state.step

    def no_space(path: Path, records: Any) -> None:
        raise OSError(errno.ENOSPC, NO_SPACE, str(path))

    monkeypatch.setattr(ModelStore, "_append_lines", staticmethod(no_space))
    with pytest.raises(OSError, match=NO_SPACE):
        await model.train(groups)
    monkeypatch.undo()
    assert state.step == step and adapter_equals_checkpoint(state, step)
    assert (await model.train(groups)).step == step + 1


def test_kernel_refuses_the_write_in_a_real_process(zygote: Zygote, tiny_model_dir: Path, tmp_path: Path) -> None:
    assert zygote.run(scenario="disk_full", run_dir=tmp_path, model_dir=tiny_model_dir) == 0, zygote.log()
    full = next(e for e in read_events(tmp_path) if e["event"] == "disk_full")
    assert "could not write checkpoint 0002" in full["error"] and "File too large" in full["error"], full
    assert "the previous checkpoint (step 1) is intact" in full["error"]
    assert full["step"] == 1 and full["trainer_matches_checkpoint"]
    after = next(e for e in read_events(tmp_path) if e["event"] == "after_disk_full")
    assert after["step"] == 2 and after["tokens_trained"] > 0
    checkpoints = tmp_path / "art" / "faults" / "models" / "killme" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["0000", "0001", "0002"]
