"""Validated knobs: `ModelConfig` (how the model is served and trained) and `TrainConfig` (one step).

Defaults are chosen for the common case (LoRA on an instruct model, one optimizer step per batch
of groups); every rejected value says what would be accepted instead.
"""

from __future__ import annotations

import warnings
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["LoraConfig", "ModelConfig", "TrainConfig", "default_microbatch_tokens", "report_ignored"]


def default_microbatch_tokens(device: str) -> int:
    """Padded tokens per forward/backward when `TrainConfig.microbatch_tokens` is None.

    The one owner of this default: the trainer splits batches by it and the GPU memory plan budgets
    activations for it. 1024 on CPU, where activations of 4096 tokens took over 10 GB on
    SmolLM2-135M; 8192 on a GPU.
    """
    return 1024 if device == "cpu" else 8192

_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(8, ge=1, le=512)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: tuple[str, ...] = _ALL_LINEAR


class ModelConfig(BaseModel):
    """How a `TrainableModel` is served and trained. `"auto"` picks from the hardware, with a reason."""

    model_config = ConfigDict(extra="forbid")

    engine: Literal["auto", "hf", "vllm"] = "auto"
    trainer: Literal["auto", "peft", "unsloth"] = "auto"
    lora: LoraConfig = Field(default_factory=LoraConfig)
    max_seq_len: int = Field(2048, ge=64, description="prompt + completion tokens, for serving and training")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    load_in_4bit: bool = False
    cpu_threads: int | None = Field(None, ge=1, description="torch threads on CPU; None = chosen and reported")
    max_batch_size: int = Field(64, ge=1, description="sequences the transformers engine decodes at once")
    prefix_cache_gib: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="memory the transformers engine may keep for reusing the KV "
        "cache of shared prompt prefixes (a conversation's earlier turns, a group's shared prompt); 0 turns it off; "
        "None: 10% of RAM on CPU, 5% of the GPU memory this process may use")
    gpu_memory_utilization: float | None = Field(None, gt=0, lt=1, description="vLLM's share; None = auto")
    sleep_during_training: bool | None = Field(
        None, description="put vLLM to sleep while a step trains; None = only when training would not fit beside it")
    seed: int = 0


class TrainConfig(BaseModel):
    """One GRPO step, with ART's fields and defaults: `TrainConfig(learning_rate=...)` ports unchanged.

    ART's defaults: learning rate 5e-6 and the CISPO loss; `epsilon`/`epsilon_high` default by loss
    as in ART (PPO: 0.2 and `epsilon`; CISPO: 1.0 and 4.0). art_nb's own demo and notebooks pass
    what they were tuned with (`loss="ppo"` and their learning rate) explicitly.
    """

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(5e-6, gt=0, le=1)
    loss: Literal["ppo", "cispo"] = "cispo"
    epsilon: float | None = Field(
        None, gt=0, description="clip below 1 - epsilon (PPO: above 1 + epsilon too); None: 0.2 for PPO, 1.0 for CISPO")
    epsilon_high: float | None = Field(
        None, gt=0, description="clip above 1 + epsilon_high (DAPO 'clip higher'); None: epsilon for PPO, 4.0 for CISPO")
    kl_penalty_coef: float = Field(
        0.0, ge=0, allow_inf_nan=False,
        description="weight of a KL penalty to the base model (the LoRA disabled); 0 computes none")
    scale_rewards: bool = Field(True, description="divide advantages by the group's reward std")
    max_grad_norm: float = Field(1.0, gt=0)
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    grad_accumulation_sequences: int | None = Field(
        None, ge=1, description="ART's field, accepted: art_nb takes one optimizer step per batch, "
        "accumulating over every microbatch (microbatch_tokens bounds memory instead)")
    microbatch_tokens: int | None = Field(
        None, ge=64, description="padded tokens per forward/backward; lower saves memory. None: "
        "default_microbatch_tokens(device), 1024 on CPU and 8192 on a GPU")
    logprob_chunk_tokens: int = Field(512, ge=1, description="tokens (batch x positions) per lm_head chunk when taking logprobs: bounds logits memory")
    max_nonfinite_steps: int = Field(3, ge=1, description="consecutive skipped updates before training stops")

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        for beta in self.adam_betas:
            if not 0 <= beta < 1:  # torch would only complain inside the first optimizer step
                raise ValueError(f"adam_betas={self.adam_betas}: each beta must be in [0, 1), e.g. (0.9, 0.999)")
        # Each loss's defaults (CISPO caps the importance weight at 5: MiniMax-M1's setting). Written
        # to __dict__, not assigned: a default is not the user's choice, so it stays out of
        # model_fields_set and a copy made for another loss (art_nb.porting) gets that loss's default.
        if self.epsilon is None:
            self.__dict__["epsilon"] = 0.2 if self.loss == "ppo" else 1.0
        if self.epsilon_high is None and self.loss == "cispo":
            self.__dict__["epsilon_high"] = 4.0
        if self.grad_accumulation_sequences is not None:
            report_ignored({"grad_accumulation_sequences": "art_nb takes one optimizer step per batch; "
                            "set microbatch_tokens to bound memory"}, "TrainConfig")
        return self


_REPORTED: set[str] = set()


def report_ignored(knobs: dict[str, str], where: str) -> None:
    """Warn once per process about each ART knob that art_nb accepts but has no equivalent for.

    Accepted so ART code runs unchanged; reported (a UserWarning naming it and why) so nothing is
    dropped silently; once, so a training loop does not repeat it every step.
    """
    new = {name: why for name, why in knobs.items() if f"{where}.{name}" not in _REPORTED}
    if not new:
        return
    _REPORTED.update(f"{where}.{name}" for name in new)
    details = "; ".join(f"{name} ({why})" for name, why in new.items())
    warnings.warn(f"{where}: accepted but not used by art_nb: {details}", UserWarning, stacklevel=3)
