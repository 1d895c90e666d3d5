"""LoRA adapters handed to vLLM in memory: a train step's update served before its files exist.

vLLM (0.25 on the GPU, 0.11.2 and 0.32's CPU builds) loads an adapter only from a path: the worker's
`WorkerLoRAManager._load_adapter` reads adapter_config.json and adapter_model.safetensors. Its
engine core runs in this process, so `install` puts, once, a loader on that manager (through
`LLMEngine.collective_rpc`, which hands a callable the worker) that builds the `LoRAModel` from
tensors for the LoRA ids held here, with the same steps as vLLM's `_load_adapter`
(`PEFTHelper.from_dict` with the model's max positions, `validate_legal`, the module check,
`LoRAModel.from_lora_tensors`, 0.32's validators), and calls vLLM's own loader for every other id.
vLLM 0.11 builds the `LoRAModel` with keywords of its own (embedding padding instead of the model's
vocabulary size, the checkpoint's weight mapper as it is, no skipped prefixes): `_from_tensors` asks
`from_lora_tensors` which ones it takes.
A held adapter stays held until it is unloaded: vLLM's LRU cache may evict it and load it again by id.

Where that structure is missing (an unknown vLLM), `install` raises an EngineError naming the
version; the engine then writes the tensors to a temporary directory and loads by path (`spill`).
"""

from __future__ import annotations

import functools
import inspect
import json
import tempfile
from pathlib import Path
from typing import Any

from ..base import AdapterWeights, EngineError, packed_copies

__all__ = ["install", "spill"]

_MARK = "_art_nb_held"  # the attribute on vLLM's manager that says our loader is installed


def install(engine: Any, held: dict[int, AdapterWeights], version: str) -> None:
    """Install the in-memory loader on `engine`'s worker (on the vLLM thread; idempotent).

    `held` is shared with the engine, which adds an id's weights before `add_lora` and drops them
    after `remove_lora`: the engine core is in this process, so the worker sees the same dict.
    """
    try:
        engine.collective_rpc(functools.partial(_install_on_worker, held=held))
    except _Unsupported as exc:
        raise EngineError(f"vLLM {version} cannot take an adapter from memory here ({exc}); "
                          "art_nb loads it from a temporary directory instead") from exc


def spill(weights: AdapterWeights, root: Path | None = None) -> Path:
    """`weights` as a PEFT directory (adapter_model.safetensors + adapter_config.json) in a new temporary one."""
    from safetensors.torch import save_file

    directory = Path(tempfile.mkdtemp(prefix="art_nb-lora-", dir=root))
    tensors = {name: tensor.detach().contiguous() for name, tensor in weights.on_host().items()}
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    (directory / "adapter_config.json").write_text(json.dumps(weights.config))
    return directory


class _Unsupported(RuntimeError):
    """vLLM's worker lacks the structure the in-memory loader relies on."""


def _install_on_worker(worker: Any, held: dict[int, AdapterWeights]) -> None:
    # third-party: vLLM's model runners (LoRAModelRunnerMixin, 0.25 and 0.32) keep the WorkerLoRAManager here
    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    if manager is None:
        raise _Unsupported("the worker's model_runner has no lora_manager")
    if getattr(manager, _MARK, None) is held:  # third-party: our own mark on vLLM's manager
        return
    needed = ("_load_adapter", "_adapter_manager", "_lora_model_cls", "lora_config", "vocab_size",
              "max_position_embeddings")
    # third-party: WorkerLoRAManager's private members, as vLLM 0.25 and 0.32 have them
    missing = [name for name in needed if not hasattr(manager, name)]
    # third-party: LoRAModel.from_lora_tensors is what from_local_checkpoint ends in (0.25, 0.32)
    if not hasattr(getattr(manager, "_lora_model_cls", None), "from_lora_tensors"):
        missing.append("_lora_model_cls.from_lora_tensors")
    if missing:
        raise _Unsupported(f"{type(manager).__name__} has no {', '.join(missing)}")
    from_disk = manager._load_adapter

    def load(lora_request: Any) -> Any:
        weights = held.get(lora_request.lora_int_id)
        if weights is None:
            return from_disk(lora_request)
        return _from_tensors(manager, lora_request, weights)

    manager._load_adapter = load  # an instance attribute: add_adapter calls self._load_adapter
    setattr(manager, _MARK, held)


def _from_tensors(manager: Any, lora_request: Any, weights: AdapterWeights) -> Any:
    """What `WorkerLoRAManager._load_adapter` does, with the files' content taken from `weights`."""
    import torch
    from vllm.lora.peft_helper import PEFTHelper

    adapters = manager._adapter_manager
    peft_helper = PEFTHelper.from_dict({**weights.config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    peft_helper.validate_legal(manager.lora_config)
    model = adapters.model
    # third-party: vLLM 0.25 and 0.32 take the model's vocabulary size; 0.11 pads embedding LoRAs instead
    legacy = "model_vocab_size" not in inspect.signature(manager._lora_model_cls.from_lora_tensors).parameters
    # third-party: some models (Qwen2-VL) rename checkpoint weights; absent on most
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None and not legacy:  # names only, no fusion: 0.25 calls it get_unstacked_mapper, 0.32 get_rename_mapper
        # third-party: the method's name differs between vLLM 0.25 and 0.32
        narrow = getattr(mapper, "get_unstacked_mapper", None) or mapper.get_rename_mapper
        mapper = narrow()
    # third-party: model-defined prefixes vLLM skips (e.g. MTP layers); absent on most models (and on 0.11)
    skip_prefixes = getattr(model, "lora_skip_prefixes", None)
    _check_modules(weights.tensors, _expected_modules(adapters), mapper, skip_prefixes, peft_helper,
                   manager._lora_model_cls)
    # Built on the host, as vLLM's own loader does (pinned copies, moved to its GPU slots when activated).
    # Built on the GPU instead, an adapter served greedy logprobs 0.011 away from its files in 2 of 3
    # H200 checks, never when built on the host (tests/gpu/check_vllm_memory_adapter.py).
    # Copies, because vLLM scales lora_b in place (LoRALayerWeights.optimize) and these tensors are also
    # the checkpoint being written: converted to vLLM's LoRA dtype where they are (a step's adapter is
    # still on the trainer's GPU), then to the host in one transfer, into page-locked memory (vLLM pins
    # each LoRA tensor it builds on the host, ~500 at 3B, r16, every linear layer, and skips the ones
    # already pinned). `dict(...)`: one view of them, as the checkpoint writer may swap in host copies meanwhile.
    lora_dtype = manager.lora_config.lora_dtype
    tensors = packed_copies(dict(weights.tensors), to_host=True,
                            dtype=lora_dtype if isinstance(lora_dtype, torch.dtype) else None)
    if legacy:  # vLLM 0.11's _load_adapter: embedding LoRAs padded to the vocabulary and its extra slots
        layout = {"target_embedding_padding": manager.vocab_size + manager.lora_config.lora_extra_vocab_size,
                  "embedding_modules": manager.embedding_modules,
                  "embedding_padding_modules": manager.embedding_padding_modules}
    else:
        layout = {"model_vocab_size": manager.vocab_size, "skip_prefixes": skip_prefixes}
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_request.lora_int_id, tensors=tensors, peft_helper=peft_helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, weights_mapper=mapper, **layout)
    # third-party: the on-disk MoE layout flag (0.25, 0.32); our adapters come from peft's save layout
    lora.is_3d_lora_weight = getattr(lora_request, "is_3d_lora_weight", False)
    for check in ("_validate_moe_lora_format", "_validate_modules_to_save", "_validate_token_classification_lora"):
        # third-party: 0.32 validates the loaded model with these; 0.25 has none of them
        validate = getattr(adapters, check, None)
        if validate is not None:
            validate(lora)
    return lora


def _expected_modules(adapters: Any) -> set[str]:
    expected: list[str] = []
    for module in adapters.supported_lora_modules:
        expected.extend(adapters.packed_modules_mapping.get(module, [module]))
        if module == "experts":
            expected.append(module)
    return set(expected)


def _check_modules(tensors: dict[str, Any], expected: set[str], mapper: Any, skip_prefixes: list[str] | None,
                   peft_helper: Any, lora_model_cls: Any) -> None:
    """Refuse tensors for modules vLLM would not apply (from_local_checkpoint's check): serving part of
    the update silently would sample from a policy the trainer never had."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    try:
        from vllm.lora.utils import is_base_embedding_weights
    except ImportError:  # vLLM 0.11 has none: its check passes over base_layer keys only

        def is_base_embedding_weights(key: str) -> bool:
            return False

    # third-party: 0.32's PEFTHelper knows modules_to_save heads; 0.25 refuses them in validate_legal
    full_modules = getattr(peft_helper, "modules_to_save", None) or ()
    unexpected = []
    for key in tensors:
        if is_base_embedding_weights(key) or "base_layer" in key:
            continue
        if skip_prefixes and lora_model_cls._should_skip_module(key, skip_prefixes):
            continue
        module_name, _ = parse_fine_tuned_lora_name(key, mapper)
        if ".experts" in module_name:
            if module_name[module_name.find(".experts") + 1:] not in expected:
                unexpected.append(module_name)
        elif module_name.rsplit(".", 1)[-1] not in expected and module_name.rsplit(".", 1)[-1] not in full_modules:
            unexpected.append(module_name)
    if unexpected:
        raise ValueError(f"the adapter holds modules vLLM does not serve for this model: {sorted(set(unexpected))} "
                         f"(it serves {sorted(expected)})")
