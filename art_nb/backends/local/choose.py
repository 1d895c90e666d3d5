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
    if config.engine != "auto":
        return config.engine, f"{config.engine}: set in ModelConfig.engine"
    if not cuda_available():
        return "hf", "transformers: no CUDA GPU, vLLM needs one"
    if importlib.util.find_spec("vllm") is None:
        return "hf", "transformers: vLLM is not installed (pip install 'art-nb[gpu]')"
    return "vllm", "vLLM: CUDA GPU and vLLM installed"


def choose_trainer(config: ModelConfig) -> tuple[str, str]:
    if config.trainer != "auto":
        return config.trainer, f"{config.trainer}: set in ModelConfig.trainer"
    if not cuda_available():
        return "peft", "peft: no CUDA GPU, Unsloth needs one"
    if importlib.util.find_spec("unsloth") is None:
        return "peft", "peft: Unsloth is not installed (pip install 'art-nb[gpu]')"
    return "unsloth", "Unsloth: CUDA GPU and Unsloth installed"
