"""Four registers at once on the real SmolLM2-135M: every one loads, and so does a later one.

Before loads were serialised per process, this failed every one of the four with "Cannot copy out
of meta tensor" (transformers builds a model on the meta device through process-wide state, and
two loads in threads interleaved), and poisoned every later register in the process. The tiny test
model loads too fast to show it: the real weights are what the probe that found it used.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import art_nb as art
from art_nb.local.plan.base_models import TINY_MODEL

pytestmark = pytest.mark.slow


async def test_four_models_registered_at_once_all_load(tmp_path: Path) -> None:
    backend = art.LocalBackend(path=tmp_path)
    config = art.ModelConfig(max_seq_len=256)
    models = [art.TrainableModel(name=f"m{i}", project="it", base_model=TINY_MODEL, config=config) for i in range(4)]
    try:
        outcomes = await asyncio.gather(*(m.register(backend) for m in models), return_exceptions=True)
        assert outcomes == [None] * 4, outcomes
        later = art.TrainableModel(name="later", project="it", base_model=TINY_MODEL, config=config)
        await later.register(backend)
        for model in (*models, later):
            reply = await model.openai_client().chat.completions.create(
                model=model.get_inference_name(), messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
            assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        await backend.close()
