"""`UnslothTrainer`: the GPU trainer. Unsloth's FastLanguageModel under the same GRPO step as PeftTrainer.

What Unsloth brings: fused Triton kernels for the decoder layers, its offloaded gradient
checkpointing ("unsloth"), and an optional 4-bit (NF4) base so bigger models fit next to vLLM.
What it does not change: the LoRA is a regular PEFT adapter, the optimizer is the same AdamW over
the LoRA parameters, the loss is `art_nb.grpo`, and checkpoints are the same files. So everything
after the model is built (train_step, save, load, optimizer state) is `PeftTrainer`'s, and so is
taking device, dtype and 4-bit from the plan.

Unsloth is imported lazily (it takes ~40 s and patches transformers/peft as it loads); the plan
asks `unsloth_unavailable_reason()` (the plan's) first and falls back to peft with that reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from art_nb.config import ModelConfig

from ..plan.choices import Plan, unsloth_unavailable_reason
from ..plan.compat import quiet_checkpointing_alias
from .peft_trainer import PeftTrainer

__all__ = ["UnslothTrainer"]


class UnslothTrainer(PeftTrainer):
    """LoRA on an Unsloth FastLanguageModel, resident on the GPU between steps."""

    name = "unsloth"

    def __init__(self, model_path: Path, config: ModelConfig, plan: Plan | None = None) -> None:
        reason = unsloth_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the Unsloth trainer cannot run: {reason}; use ModelConfig(trainer='peft')")
        super().__init__(model_path, config, plan)

    def _build_model(self, model_path: Path, dtype: torch.dtype) -> Any:
        from unsloth import FastLanguageModel

        lora = self.config.lora
        model, _ = FastLanguageModel.from_pretrained(
            model_name=str(model_path),
            max_seq_length=self.config.max_seq_len,
            dtype=dtype,
            load_in_4bit=self.plan.load_in_4bit,
            fast_inference=False,  # vLLM is ours (local/engines/vllm/), not Unsloth's
            full_finetuning=False,
        )
        with quiet_checkpointing_alias():
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
