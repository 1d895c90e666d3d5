"""How vLLM starts on a GPU: torch.compile or not, which CUDA graphs, how many. One choice, with its reason.

Measured on the H200 (SmolLM2-135M, vLLM 0.25, the 2048 notebook): vLLM's defaults spent 49 s in
torch.compile and 37 s capturing 204 CUDA graphs (51 batch sizes, each with and without a LoRA,
each FULL and PIECEWISE) of a 153 s start. art_nb's engine serves a LoRA on every step after the
first, so the graphs without one are waste, and a notebook's rollouts decode far more than they
prefill. Hence three modes (`ModelConfig.vllm_startup`, or ART_NB_VLLM_STARTUP for benchmarks):

- "fast" (the default): no torch.compile; full CUDA graphs for decode batches only, at a short list
  of batch sizes, LoRA-active graphs only. Decoding runs graph-replayed; prefill runs eager.
- "compiled": vLLM's default path (torch.compile, FULL_AND_PIECEWISE graphs), with the same short
  size list and LoRA-active graphs only: the slowest start. vLLM 0.19-0.31 cannot compile a
  model with LoRA enabled; there it is "fast", with the reason.
- "eager": `enforce_eager`, no compile and no graphs (the old ART_NB_VLLM_ENFORCE_EAGER=1).

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

from art_nb.config import ModelConfig
from art_nb.local.plan.versions import installed_version, parse_version

__all__ = ["STARTUP_ENV", "StartupMode", "capture_sizes", "import_vllm", "startup_kwargs", "startup_mode"]

_log = logging.getLogger("art_nb")
StartupMode = Literal["fast", "compiled", "eager"]
STARTUP_ENV = "ART_NB_VLLM_STARTUP"
_EAGER_ENV = "ART_NB_VLLM_ENFORCE_EAGER"
_DEFAULT: StartupMode = "fast"
# Batch sizes with a CUDA graph: a batch pads up to the next one (vLLM's default list has 51 up to
# 512). vLLM captures decode graphs only up to its max_num_seqs and none above max_num_batched_tokens;
# its in-process scheduler runs at least 256 sequences (1024 on an H100/H200), hence up to 512 as
# vLLM's own rule (2 x max_num_seqs, at most 512) has it.
_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def startup_mode(config: ModelConfig, enforce_eager: bool | None = None) -> tuple[StartupMode, str]:
    """The mode and why: `enforce_eager=True` (a caller's order), then ART_NB_VLLM_STARTUP, then
    ART_NB_VLLM_ENFORCE_EAGER=1 (unless `enforce_eager=False`), then `ModelConfig.vllm_startup`;
    "compiled" becomes "fast" where the installed vLLM cannot compile a LoRA model (`_compile_fails_with_lora`)."""
    mode, why = _asked_mode(config, enforce_eager)
    if mode == "compiled" and (broken := _compile_fails_with_lora()):
        return "fast", f"compiled asked ({why}), but {broken}: fast instead"
    return mode, why


def _asked_mode(config: ModelConfig, enforce_eager: bool | None) -> tuple[StartupMode, str]:
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


def _compile_fails_with_lora() -> str | None:
    """Why the installed vLLM's torch.compile cannot start with LoRA enabled (art_nb always enables it), or None.

    vLLM 0.19 added a pass that rewrites `x.size()` nodes before splitting the compiled graph; it
    misses a size nested in a tuple, which its own LoRA kernels' buffers have
    (`torch.empty((n, x.size(0), r))`), and start-up fails with "Tried to erase Node size_2 but it
    still had 1 users" (vLLM 0.25 on the H200, a 3B model with a rank-64 LoRA). vLLM 0.32's pass leaves
    `x.size(dim)` alone; the releases between are not known to be fixed.
    """
    version = installed_version("vllm")
    if version is None or not (0, 19) <= parse_version(version)[:2] < (0, 32):
        return None
    return f"vLLM {version}'s torch.compile fails on a LoRA model (its size-rewriting pass; fixed by 0.32)"


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
