"""How vLLM starts on a GPU: torch.compile or not, which CUDA graphs, how many. One choice, with its reason.

Measured on the H200 (SmolLM2-135M, vLLM 0.25, the 2048 notebook): vLLM's defaults spent 49 s in
torch.compile and 37 s capturing 204 CUDA graphs (51 batch sizes, each with and without a LoRA,
each FULL and PIECEWISE) of a 153 s start. art_nb's engine serves a LoRA on every step after the
first, so the graphs without one are waste, and a notebook's rollouts decode far more than they
prefill. Hence three modes (`ModelConfig.vllm_startup`, or ART_NB_VLLM_STARTUP for benchmarks):

- "fast" (the default): no torch.compile; full CUDA graphs for decode batches only, at a short list
  of batch sizes, LoRA-active graphs only. Decoding runs graph-replayed; prefill runs eager.
- "compiled": vLLM's default path (torch.compile, FULL_AND_PIECEWISE graphs), with the same short
  size list and LoRA-active graphs only: the fastest decoding, the slowest start.
- "eager": `enforce_eager`, no compile and no graphs (the old ART_NB_VLLM_ENFORCE_EAGER=1).

Where the engine core runs (`ModelConfig.vllm_core`, or ART_NB_VLLM_CORE; `core_mode`):

- "process": vLLM's own `SyncMPClient`, the core in a child process. Measured on the H200 (3B,
  decode CUDA graphs): in this process the core's ~0.4 ms of Python per step shares one GIL with the
  endpoint and the notebook's client, and 256 concurrent requests ran at 0.58x plain vLLM. In a
  child it waits for nobody. It costs a second CUDA context (~0.5 GiB) and a copy of each adapter's
  tensors through vLLM's message socket, and a per-process memory cap cannot bind the child.
- "thread": the core in this process, on art_nb's vLLM thread (vllm_thread.py): the choice on small
  GPUs (a T4's 15 GiB) and under a memory cap, and on vLLM's CPU build.

On vLLM's CPU build only "eager" changes anything (the rest is vLLM's own CPU choice). vLLM's
`CompilationConfig` refuses unknown keys, so the keys sent are those the installed vLLM declares,
read from its source without importing it (an import takes ~20 s and belongs on vLLM's thread).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any, Literal, get_args

from ..config import ModelConfig

__all__ = ["CORE_ENV", "CHILD_CONTEXT_BYTES", "STARTUP_ENV", "CoreMode", "StartupMode", "capture_sizes", "core_mode",
           "import_vllm", "startup_kwargs", "startup_mode"]

_log = logging.getLogger("art_nb")
StartupMode = Literal["fast", "compiled", "eager"]
STARTUP_ENV = "ART_NB_VLLM_STARTUP"
_EAGER_ENV = "ART_NB_VLLM_ENFORCE_EAGER"
_DEFAULT: StartupMode = "fast"
CoreMode = Literal["process", "thread"]
CORE_ENV = "ART_NB_VLLM_CORE"
# The child's own CUDA context (~0.5 GiB on an H100/H200) and torch's start-up allocations: vLLM
# takes its memory snapshot after creating them, so they sit outside its share; the plan leaves them out.
CHILD_CONTEXT_BYTES = 2**30
_CHILD_MIN_DEVICE_BYTES = 24 * 2**30  # below this (a T4's 15 GiB, a 16 GiB card) the child's context is memory training needs
# Batch sizes with a CUDA graph: a batch pads up to the next one (vLLM's default list has 51 up to
# 512). vLLM captures decode graphs only up to its max_num_seqs and none above max_num_batched_tokens;
# its in-process scheduler runs at least 256 sequences (1024 on an H100/H200), hence up to 512 as
# vLLM's own rule (2 x max_num_seqs, at most 512) has it.
_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def startup_mode(config: ModelConfig, enforce_eager: bool | None = None) -> tuple[StartupMode, str]:
    """The mode and why: `enforce_eager=True` (a caller's order), then ART_NB_VLLM_STARTUP, then
    ART_NB_VLLM_ENFORCE_EAGER=1 (unless `enforce_eager=False`), then `ModelConfig.vllm_startup`."""
    if enforce_eager:
        return "eager", "enforce_eager asked by the caller (no compile, no CUDA graphs)"
    env = os.environ.get(STARTUP_ENV, "").strip().lower()
    if env:
        if env not in get_args(StartupMode):
            raise ValueError(f"{STARTUP_ENV}={env!r}: expected one of {', '.join(get_args(StartupMode))}")
        return env, f"{STARTUP_ENV} is set"  # type: ignore[return-value]
    if enforce_eager is None and os.environ.get(_EAGER_ENV, "").strip().lower() in {"1", "true", "yes"}:
        return "eager", f"{_EAGER_ENV} is set (faster start, slower decoding)"
    if config.vllm_startup is not None:
        return config.vllm_startup, "set in ModelConfig.vllm_startup"
    return _DEFAULT, ("art_nb's default: no torch.compile, CUDA graphs for decoding only (starts ~1 min "
                      "sooner than vLLM's compiled default; prefill runs eager)")


def core_mode(config: ModelConfig, on_cuda: bool, device_total: int | None = None,
              capped: bool = False) -> tuple[CoreMode, str]:
    """Where vLLM's engine core runs, and why: ART_NB_VLLM_CORE, then `ModelConfig.vllm_core`, then the
    device (see the module docstring). `device_total`: the GPU's bytes; `capped`: this process runs
    under `torch.cuda.set_per_process_memory_fraction`, which a child process would not be held to."""
    env = os.environ.get(CORE_ENV, "").strip().lower()
    if env:
        if env not in get_args(CoreMode):
            raise ValueError(f"{CORE_ENV}={env!r}: expected one of {', '.join(get_args(CoreMode))}")
        return env, f"{CORE_ENV} is set"  # type: ignore[return-value]
    if config.vllm_core is not None:
        return config.vllm_core, "set in ModelConfig.vllm_core"
    return "thread", ("art_nb's default: in this process (a child process measured slower through the endpoint "
                      "on the H200, bench/results/h200/gpu_throughput_core_process.json)")
    if not on_cuda:
        return "thread", "vLLM's CPU build: the engine core runs in this process"
    if capped:
        return "thread", "this process runs under a memory cap, which a child process would not be held to"
    if device_total is not None and device_total < _CHILD_MIN_DEVICE_BYTES:
        return "thread", (f"a {device_total / 2**30:.0f} GiB GPU: a child process's CUDA context would take "
                          "memory training needs")
    return "process", ("a child process, so its scheduling and kernel launches never wait for the notebook's "
                       "Python (one GIL for vLLM, the endpoint and the client cost 20-40% at 64-256 requests)")


def import_vllm() -> None:
    """Import the vLLM modules `VLLMEngine.create` builds with: the CPU-only first part of its start
    (~20 s), which register runs while the trainer builds. Touches no GPU."""
    importlib.import_module("vllm.engine.arg_utils")
    importlib.import_module("vllm.v1.engine.llm_engine")


def capture_sizes(max_tokens: int) -> list[int]:
    """The batch sizes to capture, none above `max_tokens` (vLLM's max_num_batched_tokens)."""
    return [size for size in _SIZES if size <= max_tokens]


def startup_kwargs(mode: StartupMode, on_cuda: bool, max_tokens: int) -> tuple[dict[str, Any], list[str]]:
    """`EngineArgs` keywords for `mode` and the reasons to show (one more when a key had to be left out)."""
    if mode == "eager":
        return {"enforce_eager": True}, []
    if not on_cuda:
        return {"enforce_eager": False}, ["CPU build: vLLM's own compile settings"]
    compilation: dict[str, Any] = {
        "cudagraph_capture_sizes": capture_sizes(max_tokens),
        "cudagraph_specialize_lora": False,  # a LoRA is served on every step after the first
    }
    if mode == "fast":
        compilation = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", **compilation}  # mode 0: no torch.compile
    known = _compilation_fields()
    reasons = [f"CUDA graphs for batch sizes {compilation['cudagraph_capture_sizes']}, LoRA-active only"]
    if known is not None:
        dropped = sorted(set(compilation) - known)
        if dropped:
            reasons.append(f"vLLM here has no compilation key {', '.join(dropped)}: its default is used")
            compilation = {k: v for k, v in compilation.items() if k in known}
    return {"enforce_eager": False, "compilation_config": compilation}, reasons


@functools.cache
def _compilation_fields() -> frozenset[str] | None:
    """The fields of the installed vLLM's `CompilationConfig`, or None when vLLM or its source is not found."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "config" / "compilation.py"
    try:
        return compilation_fields(source.read_text())
    except (OSError, SyntaxError, ValueError) as error:
        _log.warning("could not read vLLM's compilation keys from %s (%s); sending them unchecked", source, error)
        return None


def compilation_fields(source: str) -> frozenset[str]:
    """The annotated fields of `class CompilationConfig` in vLLM's config/compilation.py source."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == "CompilationConfig":
            return frozenset(item.target.id for item in node.body
                             if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name))
    raise ValueError("no class CompilationConfig")
