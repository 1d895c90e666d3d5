"""`art_nb.dev`: ART's experimental knobs (`art.dev`), so code that sets them runs unchanged.

These are ART's names and shapes: plain dicts at runtime (TypedDicts, every key optional, unknown
keys kept). What they mean for art_nb is decided in one place, `art_nb.porting`: each knob either
maps onto `ModelConfig`/`TrainConfig` (e.g. `InitArgs(max_seq_length=)` is
`ModelConfig.max_seq_len`) or is accepted and reported once as having no equivalent. Only the keys
ART's examples set are listed; others are accepted all the same.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

__all__ = [
    "EngineArgs",
    "InitArgs",
    "InternalModelConfig",
    "LoRAConfig",
    "OpenAIServerConfig",
    "PeftArgs",
    "SFTMetricLoggingConfig",
    "ServerArgs",
    "TinkerArgs",
    "TinkerTrainingClientArgs",
    "TrainConfig",
    "TrainSFTConfig",
    "TrainerArgs",
]


class InitArgs(TypedDict, total=False):
    """How the base model is loaded (ART: Unsloth's `FastLanguageModel.from_pretrained`)."""

    model_name: str
    max_seq_length: int
    dtype: str | None
    load_in_4bit: bool
    load_in_8bit: bool
    gpu_memory_utilization: float
    random_state: int
    max_lora_rank: int
    fast_inference: bool
    use_gradient_checkpointing: str


class EngineArgs(TypedDict, total=False):
    """vLLM engine arguments."""

    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    enforce_eager: bool
    enable_sleep_mode: bool
    num_scheduler_steps: int
    seed: int
    tensor_parallel_size: int


class PeftArgs(TypedDict, total=False):
    """The LoRA (ART: Unsloth's `get_peft_model`)."""

    r: int
    lora_alpha: int
    lora_dropout: float
    target_modules: list[str]
    use_gradient_checkpointing: str
    random_state: int
    use_rslora: bool


class LoRAConfig(TypedDict, total=False):
    """The LoRA in ART's newer spelling (`TrainableModel(lora_config=...)`)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]
    init_weights: bool


class TrainerArgs(TypedDict, total=False):
    """Arguments of ART's TRL-based trainer; art_nb's per-step knobs are `TrainConfig`'s."""

    learning_rate: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    max_grad_norm: float
    gradient_accumulation_steps: int
    per_device_train_batch_size: int
    seed: int


class TinkerTrainingClientArgs(TypedDict, total=False):
    """ART's Tinker training client (a hosted trainer art_nb does not use)."""

    rank: int
    seed: int | None
    train_mlp: bool
    train_attn: bool
    train_unembed: bool


class TinkerArgs(TypedDict, total=False):
    """ART's Tinker backend settings: accepted, reported as having no equivalent in art_nb."""

    renderer_name: str
    training_client_args: TinkerTrainingClientArgs


class InternalModelConfig(TypedDict, total=False):
    """ART's `TrainableModel(_internal_config=...)`: engine, loader, LoRA and trainer knobs."""

    init_args: InitArgs
    engine_args: EngineArgs
    peft_args: PeftArgs
    trainer_args: TrainerArgs
    tinker_args: TinkerArgs | None
    trainer_gpu_ids: list[int]
    inference_gpu_ids: list[int]
    chat_template: str  # ModelConfig.chat_template
    chat_template_path: str  # a file holding it
    chat_template_kwargs: dict[str, Any]


class TrainConfig(TypedDict, total=False):
    """ART's experimental per-step knobs (`model.train(..., _config=...)`)."""

    advantage_balance: float
    allow_training_without_logprobs: bool
    epsilon: float
    epsilon_high: float | None
    importance_sampling_level: Literal["token", "sequence", "average", "geometric_average"]
    kl_penalty_coef: float
    logprob_calculation_chunk_size: int
    mask_prob_ratio: bool
    max_negative_advantage_importance_sampling_weight: float
    packed_sequence_length: int | None
    plot_tensors: bool
    ppo: bool
    precalculate_logprobs: bool
    scale_learning_rate_by_reward_std_dev: bool
    scale_rewards: bool
    truncated_importance_sampling: float | None


class SFTMetricLoggingConfig(TypedDict, total=False):
    """ART's switch for per-batch SFT metrics; art_nb records them on every call (history split "sft")."""

    enabled: bool
    target_training_step: int


class TrainSFTConfig(TypedDict, total=False):
    """ART's experimental SFT knobs (`model.train_sft(..., _config=...)`); the public ones are
    `art_nb.TrainSFTConfig`'s (learning_rate, batch_size, assistant_turns)."""

    metric_logging: SFTMetricLoggingConfig


class ServerArgs(TypedDict, total=False):
    """Arguments of ART's vLLM OpenAI server; art_nb's endpoint is its own (`LocalBackend(port=, api_key=)`)."""

    api_key: str
    port: int
    host: str


class OpenAIServerConfig(TypedDict, total=False):
    """ART's `model.register(backend, _openai_client_config=...)`."""

    server_args: ServerArgs
    engine_args: EngineArgs
