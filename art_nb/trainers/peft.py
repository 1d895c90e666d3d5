"""The trainer that runs everywhere: transformers + peft LoRA + AdamW, CPU or GPU.

The model stays resident between steps (loading it is the slow part). The GRPO math is
`art_nb.grpo`, shared with the Unsloth trainer; this file only owns weights, optimizer and files.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig, TrainConfig
from ..grpo.advantages import prepare_batch
from ..grpo.step import grpo_step
from ..trajectory import TrajectoryGroup
from .base import TRAINER_STATE

__all__ = ["PeftTrainer", "pick_dtype"]

_log = logging.getLogger("art_nb")


def pick_dtype(config: ModelConfig, device: str) -> tuple[torch.dtype, str]:
    """The training dtype and why: fp32 on CPU, bf16 where the GPU has it, else fp16."""
    if config.dtype != "auto":
        return getattr(torch, config.dtype), f"{config.dtype}: set in ModelConfig.dtype"
    if device == "cpu":
        return torch.float32, "float32: CPU (bf16 matmuls are slow or emulated on most CPUs)"
    if torch.cuda.is_bf16_supported():
        return torch.bfloat16, "bfloat16: the GPU supports it"
    major, minor = torch.cuda.get_device_capability()
    return torch.float16, f"float16: this GPU (sm{major}{minor}) has no bf16"


class PeftTrainer:
    name = "peft"

    def __init__(self, model_path: Path, config: ModelConfig, device: str | None = None) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.config = config
        dtype, reason = pick_dtype(config, self.device)
        _log.info("trainer: peft on %s, %s", self.device, reason)
        self.dtype_reason = reason
        torch.manual_seed(config.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device)
        base.config.use_cache = False
        lora = LoraConfig(
            r=config.lora.rank,
            lora_alpha=config.lora.alpha,
            lora_dropout=config.lora.dropout,
            target_modules=list(config.lora.target_modules),
            task_type="CAUSAL_LM",
        )
        self.model = get_peft_model(base, lora)
        self.model.train()
        self._optimizer: torch.optim.Optimizer | None = None
        self._optimizer_key: tuple[float, float, tuple[float, float]] | None = None
        self._pending_optimizer_state: dict[str, Any] | None = None

    def _optimizer_for(self, config: TrainConfig) -> torch.optim.Optimizer:
        """AdamW over the LoRA parameters; its moments survive steps and checkpoints."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(
                params, lr=config.learning_rate, betas=config.adam_betas, weight_decay=config.weight_decay
            )
            if self._pending_optimizer_state is not None:
                self._optimizer.load_state_dict(self._pending_optimizer_state)
                self._pending_optimizer_state = None
        for group in self._optimizer.param_groups:  # the user may change these between steps
            group["lr"] = config.learning_rate
            group["betas"] = config.adam_betas
            group["weight_decay"] = config.weight_decay
        return self._optimizer

    def train_step(self, groups: list[TrajectoryGroup], config: TrainConfig, should_stop: Any = None) -> dict[str, float]:
        batch = prepare_batch(groups, self.tokenizer, config, self.config.max_seq_len)
        metrics: dict[str, float] = {
            "groups": float(batch.groups),
            "zero_variance_groups": float(batch.zero_variance_groups),
            "truncated": float(batch.truncated),
            "skipped_trajectories": float(batch.skipped_trajectories),
            "reward_mean": batch.reward_mean,
            "reward_std": batch.reward_std,
        }
        if not batch.items:
            metrics["skipped_empty"] = 1.0
            return metrics
        optimizer = self._optimizer_for(config)
        self.model.train()
        metrics.update(grpo_step(self.model, optimizer, batch, config, device=self.device))
        return metrics

    def save(self, directory: Path) -> None:
        self.model.save_pretrained(directory, safe_serialization=True)
        state = {
            "optimizer": self._optimizer.state_dict() if self._optimizer is not None else self._pending_optimizer_state,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        torch.save(state, directory / TRAINER_STATE)

    def load(self, directory: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        weights = load_file(str(directory / "adapter_model.safetensors"), device=self.device)
        result = set_peft_model_state_dict(self.model, weights)
        if getattr(result, "unexpected_keys", None):
            raise RuntimeError(f"checkpoint {directory} has unexpected adapter keys: {result.unexpected_keys[:3]}")
        state_path = directory / TRAINER_STATE
        if state_path.exists():
            state = torch.load(state_path, weights_only=True, map_location=self.device)
            self._pending_optimizer_state = state.get("optimizer")
            self._optimizer = None
            if state.get("torch_rng") is not None:
                torch.set_rng_state(state["torch_rng"].cpu())
            if state.get("python_rng") is not None:
                python_rng = state["python_rng"]
                random.setstate((python_rng[0], tuple(python_rng[1]), python_rng[2]))
