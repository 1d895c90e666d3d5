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
    vllm_startup: Literal["fast", "compiled", "eager"] | None = Field(
        None, description="how vLLM starts on a GPU: 'fast' (no torch.compile, CUDA graphs for decoding only), "
        "'compiled' (vLLM's default: slowest start, fastest decoding), 'eager' (no graphs); None: art_nb's "
        "default, now 'fast'. The environment variable ART_NB_VLLM_STARTUP overrides it")
    vllm_4bit: bool | None = Field(
        None, description="vLLM serves the base model in 4-bit NF4 (bitsandbytes, quantised as it loads): a 3B "
        "model's weights take ~2 GiB instead of ~6 GiB and, with load_in_4bit, are exactly the weights the trainer "
        "trains; decoding is slower. None: on when load_in_4bit and the installed vLLM has bitsandbytes (0.25 does, "
        "0.32 does not)")
    sleep_during_training: bool | None = Field(
        None, description="put vLLM to sleep while a step trains; None = only when training would not fit beside it")
    seed: int = 0


class TrainConfig(BaseModel):
    """One GRPO step, with ART's fields and defaults: `TrainConfig(learning_rate=...)` ports unchanged.

    ART's defaults: learning rate 5e-6 and the CISPO loss; `epsilon`/`epsilon_high` default by loss
    as in ART (PPO: 0.2 and `epsilon`; CISPO: 1.0 and 4.0). art_nb's own demo and notebooks pass
    what they were tuned with (`loss="ppo"` and their learning rate) explicitly.

    The loss menu (art_nb/grpo/losses.py says what each one computes): "cispo" (ART's default),
    "ppo" (TRL's "grpo"), "dapo" (token mean over the batch, clip-higher 0.28), "dr_grpo" (no length
    normalisation, advantages not divided by the std unless `scale_rewards` is set), "gspo"
    (sequence-level ratio, epsilon 3e-4 / 4e-4 as in the GSPO paper). The engine/trainer mismatch
    correction and truncated-completion masking follow TRL's `GRPOConfig` (names without "vllm_").
    """

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(5e-6, gt=0, le=1)
    loss: Literal["cispo", "ppo", "dapo", "dr_grpo", "gspo"] = "cispo"
    epsilon: float | None = Field(
        None, gt=0, description="clip below 1 - epsilon (PPO: above 1 + epsilon too); None: 1.0 for CISPO, "
        "3e-4 for GSPO, 0.2 for the others")
    epsilon_high: float | None = Field(
        None, gt=0, description="clip above 1 + epsilon_high (DAPO 'clip higher'); None: 4.0 for CISPO, 0.28 for "
        "DAPO, 4e-4 for GSPO, epsilon for the others")
    importance_sampling_level: Literal["token", "sequence"] | None = Field(
        None, description="the policy ratio per token, or one per trajectory (GSPO); None: 'sequence' for gspo, "
        "'token' otherwise")
    max_completion_length: int | None = Field(
        None, ge=1, description="dr_grpo's constant: each trajectory's summed token loss is divided by it; None: "
        "the model's max_seq_len")
    importance_sampling_correction: bool = Field(
        True, description="weigh each token by pi_trainer / pi_engine (detached, bounded) where the engine sent "
        "logprobs, with the trainer's own logprobs as the old policy; False: the engine's logprobs are the old "
        "policy (ART's way) and only the loss's clip bounds the mismatch")
    importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field(
        "token_truncate", description="bound per token or per trajectory (the product over its tokens); "
        "truncate = clamp to the bounds, mask = weight 0 outside them")
    importance_sampling_cap: float | None = Field(
        3.0, gt=0, allow_inf_nan=False, description="upper bound of the mismatch weight (TRL's clip_max); None: none")
    importance_sampling_floor: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="lower bound of the mismatch weight (TRL's clip_min); None: none")
    mask_truncated_completions: bool = Field(
        False, description="leave out of the loss a trajectory whose last completion stopped at the token limit "
        "(finish_reason 'length') or that max_seq_len cut (DAPO's overlong filtering)")
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
            self.__dict__["epsilon"] = {"cispo": 1.0, "gspo": 3e-4}.get(self.loss, 0.2)
        if self.epsilon_high is None and self.loss in ("cispo", "dapo", "gspo"):
            self.__dict__["epsilon_high"] = {"cispo": 4.0, "dapo": 0.28, "gspo": 4e-4}[self.loss]
        if self.importance_sampling_level is None:
            self.__dict__["importance_sampling_level"] = "sequence" if self.loss == "gspo" else "token"
        elif self.loss == "gspo" and self.importance_sampling_level != "sequence":
            raise ValueError("loss='gspo' is the sequence-level ratio: leave importance_sampling_level unset, or use "
                             "loss='ppo' for token-level ratios")
        if self.loss == "dr_grpo" and "scale_rewards" not in self.model_fields_set:
            self.__dict__["scale_rewards"] = False  # Dr. GRPO: the std's division is the question-level bias it removes
        if (self.importance_sampling_cap is not None and self.importance_sampling_floor is not None
                and self.importance_sampling_floor >= self.importance_sampling_cap):
            raise ValueError(f"importance_sampling_floor={self.importance_sampling_floor} must be below "
                             f"importance_sampling_cap={self.importance_sampling_cap}, e.g. floor 0.5 and cap 3.0")
        if self.importance_sampling_cap is not None and self.importance_sampling_cap < 1:
            raise ValueError(f"importance_sampling_cap={self.importance_sampling_cap} is below 1, so even tokens "
                             "where engine and trainer agree would be cut; use a cap >= 1 (TRL's default is 3.0)")
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
