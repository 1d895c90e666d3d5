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

import gc
import importlib.util
import logging
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig, TrainConfig
from ..trajectory import TrajectoryGroup
from .peft import PeftTrainer, pick_dtype

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
        from transformers import AutoTokenizer

        # The same state PeftTrainer.__init__ sets up; only the model is built differently.
        self.device = device or "cuda"
        self.config = config
        dtype, self.dtype_reason = pick_dtype(config, self.device)
        _log.info("trainer: unsloth on %s, %s%s", self.device, self.dtype_reason,
                  ", 4-bit base" if config.load_in_4bit else "")
        torch.manual_seed(config.seed)
        # The tokenizer the server and the engine use: tokens trained must be tokens served.
        # (Unsloth returns its own, possibly "fixed" one; we do not use it.)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = self._build_model(Path(model_path), dtype)
        self.model.train()
        self._optimizer: torch.optim.Optimizer | None = None
        self._optimizer_key: tuple[float, float, tuple[float, float]] | None = None
        self._pending_optimizer_state: dict[str, Any] | None = None

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

    def train_step(
        self, groups: list[TrajectoryGroup], config: TrainConfig, should_stop: Any = None
    ) -> dict[str, float]:
        try:
            return super().train_step(groups, config, should_stop)
        finally:
            # Hand the step's activation memory back to the driver: vLLM re-allocates its KV cache
            # outside PyTorch's caching allocator when it wakes, and would not see cached blocks as free.
            gc.collect()
            torch.cuda.empty_cache()
