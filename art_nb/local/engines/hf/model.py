"""What `HFEngine` does to a transformers model and its peft adapters, one function per job.

Loading, the forward that decoding needs (last-position logits under one adapter, or under the
base weights with every adapter disabled), adding and deleting adapters, and moving the weights.
These hide the differences between transformers and peft releases from the engine's scheduler.
Every function here runs on the engine's model thread.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from art_nb.local.plan.compat import quiet_checkpointing_alias

from ..base import AdapterWeights

__all__ = ["cache_keyword", "context_window", "eos_ids", "last_logits", "load", "move", "with_adapter",
           "without_adapters"]


def load(path: Path, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    """The model in `dtype` on `device`, in eval mode, and its tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tokenizer


def context_window(model: Any, max_seq_len: int) -> int:
    """`max_seq_len`, or fewer when the model has fewer positions."""
    window = getattr(model.config, "max_position_embeddings", None)  # third-party: not every config has one
    return min(max_seq_len, window or max_seq_len)


def eos_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    """Every id that ends a sequence: the tokenizer's EOS and the generation config's (often a list)."""
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):  # third-party: may be unset
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return frozenset(ids)


def cache_keyword(model: Any) -> str:
    """transformers renamed `past_key_values` to `cache` (5.x): the keyword this version's forward takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def last_logits(model: Any, cache_keyword: str, adapter: str | None, ids: torch.Tensor, mask: torch.Tensor,
                positions: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """Last-position logits in float32, under `adapter` (the base weights when None)."""
    kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "use_cache": True,
              "logits_to_keep": 1, cache_keyword: cache}
    if adapter is None and _is_peft(model):
        with model.disable_adapter():
            out = model(**kwargs)
    else:
        if adapter is not None and model.active_adapter != adapter:
            model.set_adapter(adapter)
        out = model(**kwargs)
    return out.logits[:, -1].float()


def with_adapter(model: Any, name: str, source: Path | AdapterWeights, device: torch.device) -> Any:
    """`model` with a PEFT adapter added as `name` (the first one wraps it in a PeftModel): read from
    the directory `source`, or built from the tensors in memory (a train step's hand-over: nothing is
    read from disk, and the adapter's weights are those tensors, not a copy).

    Either way the new slot is made on the meta device and filled (`low_cpu_mem_usage`): peft's
    usual random init of a slot about to be overwritten draws from torch's global generator, whose
    state the trainer's checkpoints keep, so a run resumed from disk (whose adapter is loaded from a
    directory) would sample and train differently from one never stopped (served from memory).
    For the same reason both end with the weights in the same layout (`_aligned`).
    """
    from peft import PeftModel

    with torch.no_grad(), quiet_checkpointing_alias():
        if not isinstance(source, AdapterWeights):
            if _is_peft(model):
                model.load_adapter(str(source), adapter_name=name, is_trainable=False, low_cpu_mem_usage=True)
            else:
                model = PeftModel.from_pretrained(model, str(source), adapter_name=name, is_trainable=False,
                                                  low_cpu_mem_usage=True)
        else:
            model = _inject(model, name, source)
        _aligned(model, name)
        return model.to(device).eval()


def _aligned(model: Any, name: str) -> None:
    """Give each weight of adapter `name` that does not start on a 64-byte boundary its own
    (aligned) memory, as every tensor torch allocates has.

    Same numbers are not the same results: MKL's one-row sgemm (a decode step's LoRA matmuls) sums
    in an order that depends on where the weight starts on some CPUs (AMD EPYC; an Intel CPU with
    MKL_ENABLE_INSTRUCTIONS=SSE4_2), so a misaligned copy serves logprobs that differ in the 6th
    digit. Weights read from a directory are views of the mapped file at the offsets its header
    leaves (8-byte aligned); handed-over ones are views of one packed buffer, aligned when every
    tensor before them fills whole 64-byte lines. Copying the others makes a run resumed from disk
    serve, and so train, exactly as one never stopped.
    """
    for key, param in model.named_parameters():
        if f".{name}." in key and param.data_ptr() % 64:
            param.data = param.data.clone(memory_format=torch.contiguous_format)


def _inject(model: Any, name: str, weights: AdapterWeights) -> Any:
    """What `PeftModel.load_adapter` does after reading the files: an empty adapter slot (on the meta
    device, so no random init), then the tensors assigned into it."""
    from peft import PeftConfig, get_peft_model, set_peft_model_state_dict

    config = PeftConfig.from_peft_type(**weights.config)
    config.inference_mode = True  # frozen, as loading with is_trainable=False
    if _is_peft(model):
        model.add_adapter(name, config, low_cpu_mem_usage=True)
    else:
        model = get_peft_model(model, config, adapter_name=name, low_cpu_mem_usage=True)
    _check_fit(name, set_peft_model_state_dict(model, weights.tensors, adapter_name=name, low_cpu_mem_usage=True))
    return model


def refill(model: Any, name: str, weights: AdapterWeights) -> None:
    """Copy `weights` into the existing adapter slot `name`, made earlier for the same config: no peft
    module surgery, so ~7x faster than `with_adapter` (batch.AdapterTable says when)."""
    from peft import set_peft_model_state_dict

    with torch.no_grad():
        _check_fit(name, set_peft_model_state_dict(model, weights.tensors, adapter_name=name))


def _check_fit(name: str, result: Any) -> None:
    """Refuse tensors that left parts of adapter `name` unset or named modules it lacks (peft's load result)."""
    missing = [key for key in result.missing_keys if f".{name}." in key]
    if result.unexpected_keys or missing:
        raise ValueError(f"adapter {name}: tensors do not fit its config (unexpected {result.unexpected_keys[:3]}, "
                         f"missing {missing[:3]})")


def without_adapters(model: Any, names: list[str]) -> Any:
    """`model` with the adapters `names` deleted; the plain model once none is left."""
    for name in names:
        remaining = [a for a in model.peft_config if a != name]
        if not remaining:  # peft cannot run with zero adapters: take the LoRA layers out entirely
            model = model.unload()
            continue
        if model.active_adapter == name:
            model.set_adapter(remaining[0])
        model.delete_adapter(name)
    return model


def move(model: Any, device: torch.device) -> None:
    """Move the weights; leaving CUDA also returns the freed blocks, so training can allocate them."""
    model.to(device)
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")  # third-party: a PeftModel or not
