"""Validated knobs: `ModelConfig` (how the model is served and trained), `TrainConfig` (one step)
and `LOSSES`, the loss menu `TrainConfig.loss` picks from.

Defaults are chosen for the common case (LoRA on an instruct model, one optimizer step per batch
of groups); every rejected value says what would be accepted instead.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "LOSSES",
    "LoraConfig",
    "LossSpec",
    "ModelConfig",
    "TrainConfig",
    "canonical_loss",
    "default_microbatch_tokens",
    "loss_choices",
    "report_ignored",
]

Objective = Literal["clip", "cispo"]
RatioLevel = Literal["token", "sequence"]
Aggregation = Literal["trajectory", "token", "constant"]


@dataclass(frozen=True)
class LossSpec:
    """One loss of the menu: three choices art_nb/grpo/losses.py computes, and the defaults that go with them.

    `objective`: the per-token objective over the policy ratio, "clip" (PPO, as in GRPO) or "cispo"
    (MiniMax-M1). `ratio_level`: the default `importance_sampling_level`; "sequence" is what makes a
    loss GSPO, so that one cannot be changed, while "token" can. `aggregation`: how token losses add
    up to the batch loss (`losses.trajectory_divisors`). `epsilon`, `epsilon_high` (None: `epsilon`)
    and `scale_rewards`: the defaults of those TrainConfig fields. `aliases`: other libraries' names
    for the same loss (TRL's `loss_type`), which `art_nb.porting` accepts. `serverless`: the hosted W&B
    Training API trains it (it has ART's two losses only).
    """

    objective: Objective
    ratio_level: RatioLevel
    aggregation: Aggregation
    epsilon: float
    epsilon_high: float | None = None
    scale_rewards: bool = True
    aliases: tuple[str, ...] = ()
    serverless: bool = False


# CISPO caps the importance weight at 5 (MiniMax-M1's setting) and puts no floor under it (ART's
# epsilon 1.0); GSPO's epsilons are the paper's; Dr. GRPO leaves advantages unscaled because the
# std's division is the question-level bias it removes. TRL's "grpo" is the per-trajectory mean of
# the clip objective; its "bnpo" divides by the tokens of the local batch, which here is the whole
# batch (one optimizer step per batch, microbatches only bound memory).
LOSSES: dict[str, LossSpec] = {
    "cispo": LossSpec("cispo", "token", "trajectory", epsilon=1.0, epsilon_high=4.0, serverless=True),  # ART's default
    "ppo": LossSpec("clip", "token", "trajectory", epsilon=0.2, aliases=("grpo",), serverless=True),
    "dapo": LossSpec("clip", "token", "token", epsilon=0.2, epsilon_high=0.28, aliases=("bnpo",)),
    "dr_grpo": LossSpec("clip", "token", "constant", epsilon=0.2, scale_rewards=False),
    "gspo": LossSpec("clip", "sequence", "trajectory", epsilon=3e-4, epsilon_high=4e-4),
}
# The menu's names as pydantic's choices: its error and the JSON schema list them.
LossName = Literal[tuple(LOSSES)]  # type: ignore[valid-type]


def canonical_loss(name: str) -> str:
    """The menu's name for `name`, which may be another library's (TRL's "grpo" is "ppo"); unknown names
    come back unchanged, for the caller to refuse."""
    return next((key for key, spec in LOSSES.items() if name in spec.aliases), name)


def loss_choices() -> str:
    """The menu as a sentence for error messages: 'cispo' (ART's default), 'ppo' (TRL's 'grpo'), ..."""
    names = [f"{name!r}" + (" (ART's default)" if name == TrainConfig.model_fields["loss"].default else "")
             + "".join(f" (TRL's {alias!r})" for alias in spec.aliases) for name, spec in LOSSES.items()]
    return ", ".join(names[:-1]) + " or " + names[-1]


def default_microbatch_tokens(device: str) -> int:
    """Padded tokens per forward/backward when `TrainConfig.microbatch_tokens` is None.

    The one owner of this default: the trainer splits batches by it and the GPU memory plan budgets
    activations for it. 1024 on CPU, where activations of 4096 tokens took over 10 GB on
    SmolLM2-135M; 8192 on a GPU.
    """
    return 1024 if device == "cpu" else 8192

_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Upper bounds on every number a client may set (over HTTP too): far above any real run, low enough
# that no value kills or floods the process serving it (20,000 CPU threads did: "libgomp: Thread
# creation failed"). Tokens: 2**20, above the longest contexts served today (128k-1M).
MAX_TOKENS = 2**20
MAX_CPU_THREADS = 1024  # the largest two-socket CPU servers have 768 hardware threads


class LoraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(8, ge=1, le=512)
    alpha: float = Field(16.0, gt=0, le=65536, allow_inf_nan=False)  # 128x the largest rank
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: tuple[str, ...] = Field(_ALL_LINEAR, max_length=64)  # a model has ~7 kinds of linear layer


class ModelConfig(BaseModel):
    """How a `TrainableModel` is served and trained. `"auto"` picks from the hardware, with a reason."""

    model_config = ConfigDict(extra="forbid")

    engine: Literal["auto", "hf", "vllm"] = "auto"
    trainer: Literal["auto", "peft", "unsloth"] = "auto"
    lora: LoraConfig = Field(default_factory=LoraConfig)
    max_seq_len: int = Field(2048, ge=64, le=MAX_TOKENS, description="prompt + completion tokens, for serving and training")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    load_in_4bit: bool = False
    cpu_threads: int | None = Field(None, ge=1, le=MAX_CPU_THREADS, description="torch threads on CPU; None = chosen and reported")
    max_batch_size: int = Field(64, ge=1, le=4096, description="sequences the engine decodes at once (ART's configs "
                                "use up to 1024)")
    prefix_cache_gib: float | None = Field(
        None, ge=0, le=1024, allow_inf_nan=False, description="memory the transformers engine may keep for reusing the KV "
        "cache of shared prompt prefixes (a conversation's earlier turns, a group's shared prompt); 0 turns it off; "
        "None: 10% of RAM on CPU, 5% of the GPU memory this process may use")
    gpu_memory_utilization: float | None = Field(None, gt=0, lt=1, description="vLLM's share; None = auto")
    vllm_startup: Literal["fast", "compiled", "eager"] | None = Field(
        None, description="how vLLM starts on a GPU: 'fast' (no torch.compile, CUDA graphs for decoding only), "
        "'compiled' (vLLM's default, torch.compile: slowest start; 'fast' on vLLM 0.19-0.31, which cannot compile a "
        "LoRA model), 'eager' (no graphs); None: art_nb's "
        "default, now 'fast'. The environment variable ART_NB_VLLM_STARTUP overrides it")
    vllm_4bit: bool | None = Field(
        None, description="vLLM serves the base model in 4-bit NF4 (bitsandbytes, quantised as it loads): a 3B "
        "model's weights take ~2 GiB instead of ~6 GiB and, with load_in_4bit, are exactly the weights the trainer "
        "trains; decoding is slower. None: on when load_in_4bit and the installed vLLM has bitsandbytes (0.25 does, "
        "0.32 does not)")
    sleep_during_training: bool | None = Field(
        None, description="put vLLM to sleep while a step trains; None = only when training would not fit beside it")
    seed: int = Field(0, ge=0, lt=2**32, description="the range numpy and vLLM take (torch takes more)")
    max_loaded_adapters: int = Field(
        4, ge=2, le=256, description="adapters kept loaded for serving: the served step and the older steps asked "
        "for as name@step, least recently used out first (loaded again from disk when asked for); vLLM keeps as "
        "many in host memory (its max_cpu_loras)")
    chat_template: str | None = Field(
        None, max_length=1_000_000, description="a Jinja chat template used instead of the base model's, by the "
        "endpoint and the trainer alike (ART's _internal_config.chat_template maps here); None: the tokenizer's own")
    assistant_turns: Literal["sampled", "rendered"] = Field(
        "sampled", description="how an earlier assistant turn this endpoint sampled is given to the model in a "
        "later request. 'sampled' (the default): as the very ids it sampled, with only what follows it rendered by "
        "the chat template, so a multi-turn rollout's prompts extend each other exactly whatever the template does "
        "to tool calls, whitespace or <think> blocks, and what is trained is what was sampled; a turn the client "
        "edited is rendered. 'rendered': the whole conversation rendered by the template and tokenised again "
        "each time, as most OpenAI-compatible servers do (a re-tokenised reply can split differently from how it "
        "was sampled)")
    turn_cache_tokens: int = Field(
        1 << 24, ge=0, le=1 << 31, description="token ids the endpoint keeps of sampled turns for "
        "assistant_turns='sampled' (4 bytes each; least recently used dropped first); a turn no longer kept is "
        "rendered")


class TrainConfig(BaseModel):
    """One GRPO step, with ART's fields and defaults: `TrainConfig(learning_rate=...)` ports unchanged.

    ART's defaults: learning rate 5e-6 and the CISPO loss; `epsilon`, `epsilon_high`,
    `importance_sampling_level` and `scale_rewards` default by loss, as `LOSSES` says (CISPO and PPO
    as in ART). art_nb's own demo and notebooks pass what they were tuned with (`loss="ppo"` and
    their learning rate) explicitly. The engine/trainer mismatch correction and truncated-completion
    masking follow TRL's `GRPOConfig` (names without "vllm_").
    """

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(5e-6, gt=0, le=1)
    loss: LossName = Field("cispo", description="one of LOSSES: what each computes is in art_nb/grpo/losses.py")
    epsilon: float | None = Field(
        None, gt=0, description="clip below 1 - epsilon (PPO: above 1 + epsilon too); None: the loss's default "
        "(LOSSES)")
    epsilon_high: float | None = Field(
        None, gt=0, description="clip above 1 + epsilon_high (DAPO 'clip higher'); None: the loss's default "
        "(LOSSES), else epsilon")
    importance_sampling_level: RatioLevel | None = Field(
        None, description="the policy ratio per token, or one per trajectory (GSPO); None: the loss's default "
        "(LOSSES: 'sequence' for gspo, 'token' otherwise)")
    max_completion_length: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="dr_grpo's constant: each trajectory's summed token loss is divided by it; None: "
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
    scale_rewards: bool = Field(
        True, description="divide advantages by the group's reward std; unset: the loss's default (LOSSES)")
    max_grad_norm: float = Field(1.0, gt=0)
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    grad_accumulation_sequences: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="ART's field, accepted: art_nb takes one optimizer step per batch, "
        "accumulating over every microbatch (microbatch_tokens bounds memory instead)")
    microbatch_tokens: int | None = Field(
        None, ge=64, le=MAX_TOKENS, description="padded tokens per forward/backward; lower saves memory. None: "
        "default_microbatch_tokens(device), 1024 on CPU and 8192 on a GPU")
    logprob_chunk_tokens: int = Field(512, ge=1, le=MAX_TOKENS, description="tokens (batch x positions) per lm_head chunk when taking logprobs: bounds logits memory")
    max_nonfinite_steps: int = Field(3, ge=1, le=10**6, description="consecutive skipped updates before training stops")

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        for beta in self.adam_betas:
            if not 0 <= beta < 1:  # torch would only complain inside the first optimizer step
                raise ValueError(f"adam_betas={self.adam_betas}: each beta must be in [0, 1), e.g. (0.9, 0.999)")
        # The loss's defaults. Written to __dict__, not assigned: a default is not the user's choice,
        # so it stays out of model_fields_set and a copy made for another loss (art_nb.porting) gets
        # that loss's default.
        spec = LOSSES[self.loss]
        if self.epsilon is None:
            self.__dict__["epsilon"] = spec.epsilon
        if self.epsilon_high is None:
            self.__dict__["epsilon_high"] = spec.epsilon_high
        if self.importance_sampling_level is None:
            self.__dict__["importance_sampling_level"] = spec.ratio_level
        elif spec.ratio_level == "sequence" and self.importance_sampling_level != "sequence":
            raise ValueError(f"loss={self.loss!r} is the sequence-level ratio: leave importance_sampling_level unset, "
                             "or use loss='ppo' for token-level ratios")
        if "scale_rewards" not in self.model_fields_set:
            self.__dict__["scale_rewards"] = spec.scale_rewards
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


class ArtNbWarning(UserWarning):
    """A warning art_nb gives the user itself: it always shows, also while register sends third-party
    warnings to the run's log (art_nb/local/quiet.py)."""


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
    warnings.warn(f"{where}: accepted but not used by art_nb: {details}", ArtNbWarning, stacklevel=3)
