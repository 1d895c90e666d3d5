"""tests/integration/test_qwen25_real.py's check with vLLM serving and Unsloth training: a tool-using
agent on Qwen2.5's real tokenizer and template (random weights in a small Qwen2 shape, built offline as
tests/qwen25.py says) trains on exactly the ids vLLM sampled, its forced calls held by vLLM's guidance
backend to the grammar the transformers engine uses. What it saw goes to the results file.

Run it in a process of its own (`pytest -k qwen25 tests/gpu`, as run_on_h200.sh does): vLLM starts one
engine per process, and test_gpu_path.py's engine comes first."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
from agent_frameworks import Served
from qwen25 import needs_qwen_vocabulary, qwen25_tool_agent_trains_exactly, random_qwen25

import art_nb as art

from .conftest import record

pytestmark = pytest.mark.gpu


def test_qwen25_tool_agent_trains_on_what_vllm_sampled(tmp_path, monkeypatch) -> None:
    if "vllm" in sys.modules:  # another test of this process started vLLM ("CuMem allocator ... one instance")
        pytest.skip("vLLM starts one engine per process: run `pytest -k qwen25 tests/gpu` on its own")
    folder = random_qwen25(tmp_path / "qwen25-random", needs_qwen_vocabulary())
    backend = art.LocalBackend(path=tmp_path / "art")
    model = art.TrainableModel(name="qwen25", project="gpu", base_model=str(folder), config=art.ModelConfig(
        engine="vllm", trainer="unsloth", max_seq_len=2048, lora=art.LoraConfig(rank=8, alpha=16)))
    loop = asyncio.new_event_loop()  # the GPU machine may lack pytest-asyncio (test_gpu_path.py says more)
    try:
        started = time.perf_counter()
        loop.run_until_complete(model.register(backend))
        record("qwen25_register_s", round(time.perf_counter() - started, 1))
        record("qwen25_tools_rendering", backend.choices(model)["tools"])
        counts = loop.run_until_complete(qwen25_tool_agent_trains_exactly(Served(backend, model, monkeypatch)))
        record("qwen25_tool_agent", counts)
        assert counts["called the tool"] == counts["rollouts"]
    finally:
        loop.run_until_complete(backend.close())
        loop.close()
