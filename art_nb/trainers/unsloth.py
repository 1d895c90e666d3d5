"""`UnslothTrainer`: the GPU trainer. Unsloth's FastLanguageModel under the same GRPO step as PeftTrainer.

What Unsloth brings: fused Triton kernels for the decoder layers, its offloaded gradient
checkpointing ("unsloth"), and an optional 4-bit (NF4) base so bigger models fit next to vLLM.
What it does not change: the LoRA is a regular PEFT adapter, the optimizer is the same AdamW over
the LoRA parameters, the loss is `art_nb.grpo`, and checkpoints are the same files. So everything
after the model is built (train_step, save, load, optimizer state) is `PeftTrainer`'s.

Unsloth is imported lazily (it takes ~40 s and patches transformers/peft as it loads); choose.py
asks `unsloth_unavailable_reason()` first and falls back to peft with that reason.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from .peft import PeftTrainer

__all__ = ["UnslothTrainer", "unsloth_unavailable_reason"]

_log = logging.getLogger("art_nb")


def unsloth_unavailable_reason() -> str | None:
    """Why the Unsloth trainer cannot run here (shown to the user), or None when it can."""
    from ..versions import VersionError, check_versions

    if importlib.util.find_spec("unsloth") is None:
        return "Unsloth is not installed (pip install 'art-nb[gpu]')"
    if not torch.cuda.is_available():
        return "Unsloth needs a CUDA GPU"
    try:
        warnings = check_versions("unsloth")
    except VersionError as exc:
        return str(exc)
    for warning in warnings:
        _log.warning("%s", warning)
    return None


class UnslothTrainer(PeftTrainer):
    """LoRA on an Unsloth FastLanguageModel, resident on the GPU between steps."""

    name = "unsloth"

    def __init__(self, model_path: Path, config: ModelConfig, device: str | None = None) -> None:
        reason = unsloth_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the Unsloth trainer cannot run: {reason}; use ModelConfig(trainer='peft')")
        super().__init__(model_path, config, device or "cuda")

    def _build_model(self, model_path: Path, dtype: torch.dtype) -> Any:
        from unsloth import FastLanguageModel

        lora = self.config.lora
        model, _ = FastLanguageModel.from_pretrained(
            model_name=str(model_path),
            max_seq_length=self.config.max_seq_len,
            dtype=dtype,
            load_in_4bit=self.config.load_in_4bit,
            fast_inference=False,  # vLLM is ours (engines/vllm.py), not Unsloth's
            full_finetuning=False,
        )
        return FastLanguageModel.get_peft_model(
            model,
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            bias="none",
            use_gradient_checkpointing="unsloth",
            random_state=self.config.seed,
        )

