"""The vLLM engine's arguments for a model, each automatic choice with the reason shown to the user.

Decided here, once, before vLLM is built: the context length (the model's positions limit wins over
`max_seq_len`), the LoRA rank slot, how vLLM starts (startup.py: torch.compile and CUDA graphs), and
the memory: on a GPU, vLLM's share from the memory plan (which also says whether training fits
beside an awake engine); on vLLM's CPU build, a KV cache sized in bytes. The dtype is not decided here: it comes from the backend's `Plan` (the one
owner of that choice), so engine and trainer logprobs agree.

Pure apart from reading the accelerator's free memory when `memory` is not given (CUDA only), and
reading the installed vLLM's source for the compilation keys it knows (startup.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_nb.config import ModelConfig
from art_nb.local.plan.memory import (
    VLLM_STEP_TOKENS,
    ModelShape,
    count_parameters,
    plan_gpu_memory,
    read_model_shape,
)

from ..base import EngineError
from .grammar import BACKEND as GRAMMAR_BACKEND
from .startup import startup_kwargs, startup_mode

__all__ = ["VLLMSetup", "capped_memory", "engine_args", "memory_snapshot", "planned_memory", "bitsandbytes_missing"]

_log = logging.getLogger("art_nb")
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM accepts for max_lora_rank
# Adapters resident on the accelerator at once: the newest step, plus an older one a rollout may
# still ask for by "{name}@{step}" while the swap happens. vLLM's host cache (max_cpu_loras) holds
# what the runtime keeps loaded, `ModelConfig.max_loaded_adapters` (adapters.py), so neither evicts
# what the other still counts on (it is at least 2, so max_cpu_loras >= max_loras, as vLLM requires).
_MAX_LORAS = 2
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class VLLMSetup:
    """`EngineArgs` keywords, the reason for each automatic choice, and whether training fits beside
    an awake engine (the memory plan's answer; always False off CUDA, where sleeping frees nothing)."""

    kwargs: dict[str, Any]
    reasons: list[str]
    train_awake: bool = False


def engine_args(model_path: Path, config: ModelConfig, on_cuda: bool, enforce_eager: bool | None = None,
                memory: tuple[int, int] | None = None, *, dtype: str | None = None) -> VLLMSetup:
    """Everything vLLM is built with for `config`: what `VLLMEngine.create` and the benchmarks use.

    `dtype` is the `Plan`'s ("float32", "bfloat16", "float16"); None applies the plan's rule for this
    device. `memory` is (free, total) accelerator bytes for the memory plan (CUDA only; None: the
    snapshot of `planned_memory`, else the device now). `enforce_eager=True` starts eager whatever
    else is set; otherwise the start-up mode is chosen by `startup.startup_mode`.
    """
    if dtype is None:
        dtype, why = _default_dtype(config, on_cuda)
    else:
        why = f"{dtype}: the plan's, which the trainer shares (their logprobs must agree)"
    reasons = [f"dtype {why}"]
    max_len, why = _max_model_len(model_path, config)
    if why:
        reasons.append(why)
    mode, why = startup_mode(config, enforce_eager)
    kwargs: dict[str, Any] = dict(
        model=str(model_path),
        tokenizer=str(model_path),
        dtype=dtype,
        seed=config.seed,
        max_model_len=max_len,
        enable_lora=True,
        max_lora_rank=next((r for r in _LORA_RANKS if r >= config.lora.rank), _LORA_RANKS[-1]),
        max_loras=_MAX_LORAS,
        max_cpu_loras=config.max_loaded_adapters,
        enable_prefix_caching=True,
        logprobs_mode="raw_logprobs",
        structured_outputs_config=dict(GRAMMAR_BACKEND),  # llguidance, as the transformers engine (grammar.py)
        disable_log_stats=True,
    )
    start, start_reasons = startup_kwargs(mode, on_cuda, max(VLLM_STEP_TOKENS, max_len))
    kwargs.update(start)
    reasons.append(f"start-up {mode}: {why}")
    reasons.extend(start_reasons)
    four_bit, why = _serve_4bit(config, on_cuda)
    if why:
        reasons.append(why)
    if four_bit:
        kwargs["quantization"] = "bitsandbytes"
    shape = read_model_shape(model_path)
    if not on_cuda:
        kv, why = _cpu_kv_cache(shape, _DTYPE_BYTES[dtype], config.max_batch_size * max_len, max_len)
        return VLLMSetup({**kwargs, "kv_cache_memory_bytes": kv}, [*reasons, why])
    gpu_kwargs, gpu_reasons, train_awake = _gpu_share(model_path, config, shape, dtype, max_len, mode != "eager",
                                                      memory, four_bit)
    return VLLMSetup({**kwargs, **gpu_kwargs}, reasons + gpu_reasons, train_awake)


def capped_memory(free: int, total: int, fraction: float, reserved: int) -> tuple[int, int]:
    """(free, total) bytes as this process may use them, under `torch.cuda.set_per_process_memory_fraction`.

    A capped process (a shared GPU, or a bigger GPU standing in for a smaller one) must plan within
    its cap, not within the device: `total` becomes the cap and `free` what is left of it after what
    torch has already reserved.
    """
    if not 0 < fraction < 1:
        return free, total
    cap = int(fraction * total)
    return max(0, min(free, cap - reserved)), cap


def _default_dtype(config: ModelConfig, on_cuda: bool) -> tuple[str, str]:
    """The `Plan`'s dtype rule, for callers (benchmarks) that build no `Plan`."""
    from art_nb.local.plan.choices import compute_dtype
    from art_nb.local.plan.hardware import detect_hardware

    capability = detect_hardware().gpu_capability if on_cuda else None
    return compute_dtype(config.dtype, "cuda" if on_cuda else "cpu", capability)


def bitsandbytes_missing() -> str | None:
    """Why the installed vLLM cannot quantise to NF4 as it loads, or None when it can (vLLM 0.25 can;
    0.32 dropped the method)."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed"
    try:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    except ImportError:
        return "vLLM is not installed"
    if "bitsandbytes" not in QUANTIZATION_METHODS:
        from art_nb.local.plan.versions import installed_version

        return f"vLLM {installed_version('vllm')} has no bitsandbytes quantisation (0.25 has it; 0.32 dropped it)"
    return None


def _serve_4bit(config: ModelConfig, on_cuda: bool) -> tuple[bool, str | None]:
    """Whether vLLM serves NF4 weights (ModelConfig.vllm_4bit; None follows load_in_4bit), and why.

    Why follow the trainer: a 4-bit trainer computes the policy's logprobs with NF4 weights; vLLM
    quantises the same checkpoint the same way (nf4, double-quantised statistics, blocks of 64), so
    the sampler then serves the weights that are trained, and holds a third of the memory.
    """
    wanted = config.load_in_4bit if config.vllm_4bit is None else config.vllm_4bit
    source = "ModelConfig.vllm_4bit" if config.vllm_4bit is not None else "load_in_4bit"
    if not wanted:
        return False, None
    if not on_cuda:
        if config.vllm_4bit:
            raise EngineError("ModelConfig.vllm_4bit=True needs a CUDA GPU (bitsandbytes quantises on CUDA only)")
        return False, None
    missing = bitsandbytes_missing()
    if missing is not None:
        if config.vllm_4bit:
            raise EngineError(f"ModelConfig.vllm_4bit=True, but {missing}; set vllm_4bit=None or False")
        return False, f"weights unquantised ({source} asked for 4-bit serving, but {missing})"
    return True, (f"weights 4-bit NF4 (bitsandbytes, {source}): "
                  + ("the weights the trainer trains, " if config.load_in_4bit else "")
                  + "about a third of the memory, slower decoding")


def _max_model_len(model_path: Path, config: ModelConfig) -> tuple[int, str | None]:
    """`max_seq_len`, unless the model has fewer positions (vLLM refuses a longer max_model_len)."""
    try:
        model_config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return config.max_seq_len, None
    limit = model_config.get("text_config", model_config).get("max_position_embeddings")
    if isinstance(limit, int) and limit < config.max_seq_len:
        return limit, f"max_model_len {limit}: the model's positions limit (max_seq_len={config.max_seq_len} asked)"
    return config.max_seq_len, None


def _cpu_kv_cache(shape: ModelShape | None, dtype_bytes: int, batch_tokens: int, max_len: int) -> tuple[int, str]:
    """vLLM's CPU build sizes its KV cache in bytes; a modest slice of RAM is plenty for tests."""
    per_token = shape.kv_bytes_per_token(dtype_bytes) if shape else 64 * 1024
    kv = min(per_token * batch_tokens, max(per_token * max_len * 4, 1 << 30))
    return kv, f"KV cache {kv / 2**30:.2f} GiB of RAM (CPU build: sized in bytes)"


def _gpu_share(model_path: Path, config: ModelConfig, shape: ModelShape | None, dtype: str, max_len: int,
               cuda_graphs: bool, memory: tuple[int, int] | None,
               four_bit: bool = False) -> tuple[dict[str, Any], list[str], bool]:
    """Sleep mode, step size and vLLM's memory share on a GPU, and whether training fits beside it awake."""
    reasons: list[str] = []
    free, total, device_total, cap_reason = _plannable_memory(memory)
    if cap_reason:
        reasons.append(cap_reason)
    # vLLM's gpu_memory_utilization is a share of the whole device; the plan works within `total`.
    to_plan = total / device_total
    override = config.gpu_memory_utilization
    plan = plan_gpu_memory(
        free, total, count_parameters(model_path), _DTYPE_BYTES[dtype], config.lora.rank, max_len,
        config.max_batch_size * max_len, config.load_in_4bit, shape=shape,
        override=None if override is None else override / to_plan, cuda_graphs=cuda_graphs, engine_4bit=four_bit,
    )
    for warning in plan.warnings:
        _log.warning("memory: %s", warning)
    if not plan.fits and override is None:
        raise EngineError("the model does not fit next to the trainer: " + "; ".join(plan.warnings))
    reasons.extend(f"memory: {r}" for r in plan.reasons)
    train_awake = plan.train_awake
    if config.sleep_during_training is not None:
        train_awake = not config.sleep_during_training
        reasons.append(f"vLLM {'sleeps' if config.sleep_during_training else 'stays awake'} while training: "
                       f"set in ModelConfig.sleep_during_training")
    kwargs = {
        "enable_sleep_mode": True,
        # The memory plan budgets vLLM's activations for this many tokens a step (vLLM's default
        # for an offline engine on a large GPU is 16384, which overruns a T4-sized cap).
        "max_num_batched_tokens": max(VLLM_STEP_TOKENS, max_len),
        "gpu_memory_utilization": override if override is not None else round(plan.gpu_memory_utilization * to_plan, 4),
    }
    return kwargs, reasons, train_awake


MemorySnapshot = tuple[int, int, int, str | None]
_SNAPSHOT: ContextVar[MemorySnapshot | None] = ContextVar("art_nb_vllm_memory", default=None)


def memory_snapshot() -> MemorySnapshot:
    """(free, total within this process's cap, device total, why capped), read from the device now."""
    return _plannable_memory(None)


@contextlib.contextmanager
def planned_memory(snapshot: MemorySnapshot | None) -> Iterator[None]:
    """Plan vLLM's share from `snapshot` (taken earlier) instead of the device's memory at build time.

    Why: register builds the trainer before vLLM (local/runtime.py says why) and the plan
    budgets the resident trainer itself, so it must see the memory as it was before the trainer
    loaded; read afterwards, the trainer would be counted twice. A context variable, because
    `VLLMEngine.create` reads the memory through `engine_args` and takes no snapshot itself.
    """
    token = _SNAPSHOT.set(snapshot)
    try:
        yield
    finally:
        _SNAPSHOT.reset(token)


def _plannable_memory(memory: tuple[int, int] | None) -> MemorySnapshot:
    """(free, total within this process's cap, device total, why capped) from `memory` or the device."""
    if memory is not None:
        return memory[0], memory[1], memory[1], None
    snapshot = _SNAPSHOT.get()
    if snapshot is not None:
        return snapshot
    import torch

    free, device_total = torch.cuda.mem_get_info()
    fraction = 1.0  # a cap set with torch.cuda.set_per_process_memory_fraction (torch >= 2.6 reads it back)
    if hasattr(torch.cuda, "get_per_process_memory_fraction"):  # third-party: absent before torch 2.6
        fraction = float(torch.cuda.get_per_process_memory_fraction())
    free, total = capped_memory(free, device_total, fraction, torch.cuda.memory_reserved() if fraction < 1 else 0)
    if total >= device_total:
        return free, total, device_total, None
    return free, total, device_total, (f"memory: planned within this process's cap of {total / 2**30:.1f} GiB "
                                       f"(torch.cuda.set_per_process_memory_fraction({fraction:g}))")
