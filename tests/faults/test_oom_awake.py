"""Out of GPU memory while training beside an awake vLLM: the step sleeps the engine and is taken again.

No GPU here, so the engine's memory plan is set by hand (`train_awake = True`, as it is on a GPU with
room for both) and the first train_step raises torch.OutOfMemoryError before the optimizer steps,
as an allocation that fails mid-forward does; the real LocalBackend, trainer and checkpoint run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import art_nb as art
from faults.conftest import gather_groups, tiny_trainable

pytestmark = pytest.mark.slow


async def test_oom_beside_an_awake_engine_falls_back_to_sleeping(tiny_model_dir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    backend = art.LocalBackend(path=tmp_path)
    model = tiny_trainable("oom-awake", tiny_model_dir)
    await model.register(backend)
    try:
        state = backend._runtime.models["oom-awake"]
        engine, trainer = state.engine, state.trainer
        sleeps: list[int] = []
        real_sleep, real_step = engine.sleep, trainer.train_step

        async def counting_sleep() -> None:
            sleeps.append(state.step)
            await real_sleep()

        calls = {"n": 0}

        def first_step_runs_out(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return real_step(*args, **kwargs)

        monkeypatch.setattr(engine, "train_awake", True, raising=False)
        monkeypatch.setattr(engine, "sleep", counting_sleep)
        monkeypatch.setattr(trainer, "train_step", first_step_runs_out)

        groups = await gather_groups(model, seed=3)
        result = await model.train(groups)
        assert result.step == 1 and result.metrics["tokens_trained"] > 0
        assert calls["n"] == 2 and sleeps == [0]  # slept once, for the retry
        assert engine.train_awake is False  # and sleeps for every later step

        result = await model.train(await gather_groups(model, seed=4))
        assert result.step == 2 and sleeps == [0, 1]
    finally:
        await backend.close()
