"""The bounded set of loaded adapters (`ModelConfig.max_loaded_adapters`), engine-agnostic: asking for
60 old steps (`m@2..m@61`) kept each one loaded (12.8 MB a step on SmolLM2, never given back). Here
with an engine that records loads and unloads; tests/faults/test_serve_second_round.py runs the real
transformers engine behind the real endpoint, and vLLM's own cache is sized from the same field."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from art_nb.config import ModelConfig
from art_nb.local.adapters import use_step
from art_nb.local.engines.vllm.args import engine_args
from art_nb.local.state import LoadedAdapters, ModelState
from art_nb.store import CheckpointError, ModelStore


def test_the_least_recently_used_unpinned_step_goes_first_and_never_the_served_one():
    loaded = LoadedAdapters()
    for step in (1, 2, 3, 4):
        loaded.add(step)
    loaded.add(1)  # used again: now the most recent
    assert loaded.beyond(2, keep=4) == [2, 3]
    loaded.pin(2)
    assert loaded.beyond(2, keep=4) == [3, 1]  # a pinned step waits; the next least recently used goes
    assert loaded.beyond(1, keep=4) == [3, 1]  # the count stays over the bound until the pinned one is released
    loaded.pin(2)
    loaded.unpin(2)
    assert loaded.beyond(1, keep=4) == [3, 1]  # pinned twice, released once
    loaded.unpin(2)
    assert loaded.beyond(2, keep=4) == [2, 3]
    assert loaded.beyond(2, keep=2) == [3, 4]
    loaded.discard(3)
    assert list(loaded) == [2, 4, 1] and 3 not in loaded and len(loaded) == 3


class RecordingEngine:
    def __init__(self) -> None:
        self.loaded: set[str] = set()
        self.most = 0

    async def load_adapter(self, name: str, path: Path, weights: Any = None) -> None:
        assert (path / "adapter_model.safetensors").exists()
        self.loaded.add(name)
        self.most = max(self.most, len(self.loaded))

    async def unload_adapter(self, name: str) -> None:
        self.loaded.remove(name)


def _checkpoint(store: ModelStore, step: int, value: float = 0.5) -> None:
    directory = store.checkpoint_dir(step)
    directory.mkdir(parents=True)
    save_file({"layer.lora_A.weight": torch.full((2, 4), value)}, str(directory / "adapter_model.safetensors"))
    (directory / "meta.json").write_text(json.dumps({"step": step, "base_model": "tiny"}))


def _state(tmp_path: Path, steps: int, capacity: int) -> ModelState:
    store = ModelStore(tmp_path, "p", "m")
    for step in range(steps + 1):
        _checkpoint(store, step)
    engine = RecordingEngine()
    state = ModelState("m", "p", "tiny", ModelConfig(max_loaded_adapters=capacity), None, store, engine, None, steps)
    engine.loaded.add(state.adapter_name(steps))  # the served step, as register leaves it
    state.loaded_adapters.add(steps)
    return state


async def test_sixty_old_steps_never_hold_more_than_the_bound(tmp_path):
    state = _state(tmp_path, steps=61, capacity=3)
    for step in range(2, 62):
        release = await use_step(state, step)
        await release()
    assert state.engine.most <= 3 and len(state.loaded_adapters) <= 3
    assert "m@61" in state.engine.loaded  # the served step stays
    assert set(state.loaded_adapters) == {int(n.split("@")[1]) for n in state.engine.loaded}
    with pytest.raises(KeyError):
        await use_step(state, 99)


async def test_steps_in_use_are_not_unloaded_under_a_request(tmp_path):
    state = _state(tmp_path, steps=8, capacity=2)
    releases = [await use_step(state, step) for step in (1, 2, 3, 4)]  # four requests still running
    assert {f"m@{s}" for s in (1, 2, 3, 4)} <= state.engine.loaded  # over the bound while they run
    await asyncio.gather(*(release() for release in releases))
    assert len(state.engine.loaded) == 2 and "m@8" in state.engine.loaded


async def test_a_non_finite_old_step_is_refused_naming_it_and_the_previous_good_one(tmp_path):
    state = _state(tmp_path, steps=4, capacity=4)
    save_file({"layer.lora_A.weight": torch.full((2, 4), float("nan"))},
              str(state.store.checkpoint_dir(3) / "adapter_model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        await use_step(state, 3)
    message = str(info.value)
    assert "checkpoint 0003" in message and "non-finite" in message and "'m@2'" in message
    assert str(tmp_path) not in message and "m@3" not in state.engine.loaded


def test_vllm_keeps_as_many_adapters_in_host_memory_as_the_runtime(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256,
        "max_position_embeddings": 1024, "torch_dtype": "float32"}))
    for capacity in (2, 4, 16):
        kwargs = engine_args(directory, ModelConfig(max_loaded_adapters=capacity, max_seq_len=512), False, True).kwargs
        assert kwargs["max_cpu_loras"] == capacity and kwargs["max_loras"] <= capacity
