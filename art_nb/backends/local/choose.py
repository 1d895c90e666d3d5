"""Which engine and trainer to use, each choice returned with the reason a user is shown."""

from __future__ import annotations

import importlib.util

from ...config import ModelConfig

__all__ = ["choose_engine", "choose_trainer", "cuda_available"]


def cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def choose_engine(config: ModelConfig) -> tuple[str, str]:
    """vLLM where the GPU and the installed release support it, else transformers (T4: see versions.py)."""
    if config.engine != "auto":
        return config.engine, f"{config.engine}: set in ModelConfig.engine"
    if not cuda_available():
        return "hf", "transformers: no CUDA GPU, vLLM needs one"
    import torch

    from ...versions import gpu_path_for, installed_version

    return gpu_path_for(torch.cuda.get_device_capability(), installed_version("vllm"))


def choose_trainer(config: ModelConfig) -> tuple[str, str]:
    if config.trainer != "auto":
        return config.trainer, f"{config.trainer}: set in ModelConfig.trainer"
    if not cuda_available():
        return "peft", "peft: no CUDA GPU, Unsloth needs one"
    from ...trainers.unsloth import unsloth_unavailable_reason

    reason = unsloth_unavailable_reason()
    if reason is not None:
        return "peft", f"peft: {reason}"
    return "unsloth", "Unsloth: CUDA GPU and a tested Unsloth release"
