"""Every automatic choice for a model, decided once, each with the reason a user is shown.

Device, compute dtype, engine, trainer, 4-bit loading and CPU threads are decided here and nowhere
else: engines and trainers receive the `Plan` and do not decide again, so a T4 cannot get bf16 from
one owner and float16 from another. The dtype comes from the compute capability, not
`torch.cuda.is_bf16_supported()`, which answers True on a T4 (sm75) because torch emulates bf16
there, slowly.

`plan_for(config, hardware)` reads the machine only through `hardware` (detected when None, in
hardware.py), so a notebook shows the choices register will make, with the same reasons, before
anything loads; the notebooks leave engine, trainer and dtype on "auto" so that these are the
choices that run (and on a T4 the transformers engine can take over when vLLM cannot start:
`engine_fallback`, for choices that were the plan's only).
"""

from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass, field, replace
from typing import Any

from art_nb.config import ModelConfig

from . import hardware as detection  # detection.detect_hardware(), looked up per call: one place to simulate a GPU
from .hardware import Hardware

__all__ = ["Plan", "compute_dtype", "engine_fallback", "import_unsloth", "pipeline_choice", "plan_for",
           "unsloth_unavailable_reason"]


@dataclass(frozen=True)
class Plan:
    """What runs where for one model. `reasons` maps each choice to the sentence shown to the user."""

    device: str  # "cuda" or "cpu"
    dtype: str  # "float32", "bfloat16" or "float16": engine and trainer alike (their logprobs must agree)
    engine: str  # "hf" or "vllm"
    trainer: str  # "peft" or "unsloth"
    load_in_4bit: bool
    cpu_threads: int | None  # torch intra-op threads on CPU; None on a GPU
    capability: tuple[int, int] | None = None
    reasons: dict[str, str] = field(default_factory=dict)

    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype)


def compute_dtype(requested: str, device: str, capability: tuple[int, int] | None) -> tuple[str, str]:
    """The dtype to serve and train in, and why: float32 on CPU, bf16 from sm80 (Ampere) on, else float16."""
    if requested != "auto":
        return requested, f"{requested}: set in ModelConfig.dtype"
    if device != "cuda":
        return "float32", "float32: CPU (bf16 matmuls are slow or emulated on most CPUs)"
    sm = f"sm{capability[0]}{capability[1]}" if capability else "this GPU"
    if capability is not None and capability >= (8, 0):
        return "bfloat16", f"bfloat16: {sm} has native bf16"
    return "float16", f"float16: {sm} has no native bf16 (torch would emulate it, slowly)"


def plan_for(config: ModelConfig, hardware: Hardware | None = None) -> Plan:
    """Decide everything `config` leaves on "auto" for `hardware` (None: this machine, detected).
    Raises for what cannot run there."""
    hw = detection.detect_hardware() if hardware is None else hardware
    capability = hw.gpu_capability
    device = "cuda" if capability is not None else "cpu"
    reasons: dict[str, str] = {}
    dtype, reasons["dtype"] = compute_dtype(config.dtype, device, capability)
    engine, reasons["engine"] = _engine(config, hw)
    trainer, reasons["trainer"] = _trainer(config, hw)
    if config.load_in_4bit:
        reasons["load_in_4bit"] = _four_bit_reason(hw, trainer)
    threads = None
    if device == "cpu":
        from .threads import choose_cpu_threads

        threads, reasons["cpu_threads"] = choose_cpu_threads(config.cpu_threads)
    return Plan(device, dtype, engine, trainer, config.load_in_4bit, threads, capability, reasons)


def _engine(config: ModelConfig, hw: Hardware) -> tuple[str, str]:
    """vLLM where the GPU and the installed release support it, else transformers (T4: see versions.py)."""
    if config.engine != "auto":
        return config.engine, f"{config.engine}: set in ModelConfig.engine"
    if hw.gpu_capability is None:
        return "hf", "transformers: no CUDA GPU, vLLM needs one"
    from .versions import gpu_path_for

    return gpu_path_for(hw.gpu_capability, hw.version("vllm"))


def engine_fallback(plan: Plan, config: ModelConfig, error: BaseException) -> Plan | None:
    """The plan with the transformers engine, where vLLM failed to start on a GPU older than sm80 and
    the engine was art_nb's choice; None where the error must stand.

    On a T4 the T4 set installs vLLM 0.11.2 (the release Unsloth's notebooks install there), which
    art_nb has run on vLLM's CPU build but not on a Turing GPU: if it fails there, the notebook goes
    on with the engine that ran in the T4 configuration rather than stopping at register. On sm80+
    a vLLM failure is a fault to see, and an engine the user chose is theirs.
    """
    if plan.engine != "vllm" or config.engine != "auto" or not isinstance(error, Exception):
        return None
    if plan.capability is None or plan.capability >= (8, 0):
        return None
    major, minor = plan.capability
    first_line = (str(error).strip().splitlines() or [""])[0][:300]
    why = (f"transformers: vLLM failed to start on this sm{major}{minor} GPU ({type(error).__name__}: {first_line}); "
           "set ModelConfig(engine='vllm') to see the whole error instead")
    return replace(plan, engine="hf", reasons={**plan.reasons, "engine": why})


def pipeline_choice(plan: Plan, serves_while_training: bool, parameters: int | None = None) -> str:
    """Whether `art_nb.pipeline(enabled="auto")` runs step N+1's rollouts while step N trains, and why:
    "on: ..." or "off: ...". On where the engine keeps serving through a step on a GPU and the model
    is large enough for the overlap to pay (`parameters`: the base model's count, None when unknown);
    forced on (enabled=True) it works everywhere, the rollouts waiting where the engine pauses."""
    if plan.device != "cuda":
        return (f"off: CPU: rollouts and training share its cores; pipelined, {_PIPELINE_ON_CPU}, one step "
                "off-policy, and what that lag costs a short CPU run's learning is not measured yet, so it is "
                "yours to turn on: art.pipeline(..., enabled=True)")
    if not serves_while_training:
        what = "vLLM sleeps" if plan.engine == "vllm" else "the transformers engine moves its weights off the GPU"
        return (f"off: {what} while training (the memory reasons say why), so the next step's rollouts "
                "would only wait for the step")
    if parameters is not None and parameters < _PIPELINE_MIN_PARAMETERS:
        return (f"off: a {parameters / 1e6:.0f}M-parameter model trains and decodes in short kernels whose launches "
                f"are Python, which the two share in this process: {_PIPELINE_SMALL}; turn it on with "
                "art.pipeline(..., enabled=True)")
    return ("on: vLLM stays awake while training (the memory plan fits training beside it), so the next "
            f"step's rollouts run during the step, sampled from the adapter before it (one step off-policy): "
            f"{_PIPELINE_LARGE}")


# bench/cpu_pipeline.py on a shared 2-core machine (SmolLM2, tic-tac-toe, 3 interleaved rounds): the trainer
# takes one thread (plan/threads.py) and the engine decodes on the core it leaves; each step trains slower
# beside the rollouts (its time/train in the file), but no step waits for its games any more.
_PIPELINE_ON_CPU = ("a step took 21 s instead of 33 s on 2 cores (1.58x the steps per hour, 1.11-1.58x in each of 3 "
                    "rounds; bench/results/cpu_pipeline.json)")
# On an H200 both sides of a pipelined step slowed beside each other (training about 2x, rollouts 1.5-1.9x): a
# 3B model still gained, a 135M one lost. Between the two sizes it is not measured; 1B splits them.
_PIPELINE_MIN_PARAMETERS = 1_000_000_000
_PIPELINE_SMALL = ("on an H200, SmolLM2-135M's tic-tac-toe step took 3.40 s pipelined vs 2.88 s (median of 11; "
                   "bench/results/h200/pipeline_curves)")
_PIPELINE_LARGE = ("on an H200 a 3B model's GRPO step took 2.14 s vs 2.67 s (1.25x, median of 3 interleaved rounds; "
                   "bench/results/h200/gpu_step.json)")


def _trainer(config: ModelConfig, hw: Hardware) -> tuple[str, str]:
    if config.trainer != "auto":
        return config.trainer, f"{config.trainer}: set in ModelConfig.trainer"
    if not hw.has_gpu:
        return "peft", "peft: no CUDA GPU, Unsloth needs one"
    reason = unsloth_unavailable_reason(hw)
    if reason is not None:
        return "peft", f"peft: {reason}"
    return "unsloth", "Unsloth: CUDA GPU and a tested Unsloth release"


def _four_bit_reason(hw: Hardware, trainer: str) -> str:
    """Why the base can be loaded in 4-bit here; raises where it cannot (better than a silent full-precision load)."""
    if not hw.has_gpu:
        raise ValueError(
            "ModelConfig(load_in_4bit=True) needs a CUDA GPU: 4-bit (NF4) weights come from bitsandbytes, which "
            "quantises on CUDA only. On this CPU set load_in_4bit=False (a small model fits in float32)."
        )
    if trainer == "unsloth":
        return "4-bit: the trainer's base weights are NF4 (Unsloth's loader)"
    if hw.version("bitsandbytes") is None:
        raise ValueError(
            "ModelConfig(load_in_4bit=True) needs bitsandbytes for the peft trainer: pip install bitsandbytes "
            "(or install Unsloth: pip install 'art-nb[gpu]'), or set load_in_4bit=False"
        )
    return ("4-bit: the trainer's linear layers are NF4 (bitsandbytes), computing in the plan's dtype; "
            "embeddings, norms and lm head stay in it; LoRA weights are float32")


_log = logging.getLogger("art_nb")


def unsloth_unavailable_reason(hardware: Hardware | None = None) -> str | None:
    """Why the Unsloth trainer cannot run on `hardware` (None: this machine), shown to the user; None when it can."""
    from .versions import COMPONENTS, VersionError, check_package

    hw = detection.detect_hardware() if hardware is None else hardware
    if hw.version("unsloth") is None:
        return "Unsloth is not installed (pip install 'art-nb[gpu]')"
    if not hw.has_gpu:
        return "Unsloth needs a CUDA GPU"
    try:
        warnings = [w for package in COMPONENTS["unsloth"] if (w := check_package(package, hw.version(package)))]
    except VersionError as exc:
        return str(exc)
    for warning in warnings:
        _log.warning("%s", warning)
    return None


def import_unsloth() -> str:
    """Import Unsloth before transformers, as it asks; the sentence for the log.

    Unsloth patches transformers' classes as it loads; imported after them it warns "may run
    slower". Register calls this before vLLM or a trainer imports transformers (trainers/peft_trainer.py does
    at module level). Unsloth imports vLLM too, when installed. Seconds: Unsloth's import is the
    slowest part of building its trainer.
    """
    late = "transformers" in sys.modules and "unsloth" not in sys.modules
    importlib.import_module("unsloth")
    if late:  # the kernel imported transformers earlier (a notebook cell, a GGUF conversion): too late to help
        return "Unsloth imported after transformers (already loaded in this process): it may run slower"
    return "Unsloth imported before transformers, as it asks"
