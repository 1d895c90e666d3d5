"""A tool-using agent on Qwen2.5's real tokenizer and template (random weights, tests/qwen25.py says how
they are built offline) trains on exactly what the transformers engine sampled: the calls Qwen's template
re-serialises go back to the engine as the ids it sampled. The same check runs on the H200 with vLLM and
Unsloth (tests/gpu/test_qwen25_gpu.py)."""

from __future__ import annotations

import pytest
from agent_frameworks import Served
from qwen25 import needs_qwen_vocabulary, qwen25_tool_agent_trains_exactly, random_qwen25

import art_nb as art

pytestmark = pytest.mark.slow


async def test_qwen25_tool_agent_trains_on_the_sampled_ids(tmp_path, monkeypatch) -> None:
    folder = random_qwen25(tmp_path / "qwen25-random", needs_qwen_vocabulary())
    backend = art.LocalBackend(path=tmp_path / "art")
    model = art.TrainableModel(name="qwen25", project="it", base_model=str(folder),
                               config=art.ModelConfig(max_seq_len=2048, lora=art.LoraConfig(rank=8, alpha=16)))
    try:
        await model.register(backend)
        assert "own rendering" in backend.choices(model)["tools"]  # Qwen's template shows tools itself
        counts = await qwen25_tool_agent_trains_exactly(Served(backend, model, monkeypatch))
        assert counts["called the tool"] == counts["rollouts"]
    finally:
        await backend.close()
