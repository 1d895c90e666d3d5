"""The step asks the engine to arrange its memory (`Engine.train_with`) once per step, around the trainer,
and hands the caller's `on_progress` to the trainer: the backend side of the protocol the engines implement."""

from __future__ import annotations

from pathlib import Path

import pytest

import art_nb as art
from faults.conftest import gather_groups, tiny_trainable

pytestmark = pytest.mark.slow


async def test_each_step_runs_the_trainer_inside_one_train_with(tiny_model_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    backend = art.LocalBackend(path=tmp_path)
    model = tiny_trainable("choreography", tiny_model_dir)
    await model.register(backend)
    try:
        state = backend._state(model)
        engine, trainer = state.engine, state.trainer
        log: list[str] = []
        real_with, real_step = engine.train_with, trainer.train_step

        async def watched_with(step, hold=None):
            log.append("enter")
            try:
                return await real_with(step, hold)
            finally:
                log.append("exit")

        def watched_step(*args, **kwargs):
            log.append("train_step")
            return real_step(*args, **kwargs)

        monkeypatch.setattr(engine, "train_with", watched_with)
        monkeypatch.setattr(trainer, "train_step", watched_step)
        progress: list[dict] = []
        result = await model.train(await gather_groups(model, seed=5), on_progress=progress.append)
        assert log == ["enter", "train_step", "exit"]
        assert result.step == 1 and progress and progress[-1]["done"] == progress[-1]["total"]
        assert all(p["phase"] == "train" for p in progress)
    finally:
        await backend.close()
