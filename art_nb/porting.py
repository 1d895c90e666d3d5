"""ART's knobs on art_nb's configs: the one place that says what each ART argument means here.

- `train_config(config, kwargs, where)`: ART's `backend.train(model, groups, learning_rate=...,
  ...)` keyword arguments (and the older `model.train(..., _config={...})` dict) onto `TrainConfig`.
- `model_config(base, internal, lora)`: `TrainableModel(_internal_config=..., lora_config=...)`
  (`art.dev`) onto `ModelConfig`.

A knob with an equivalent is mapped; one without is accepted and reported once (a UserWarning
naming it and why, `config.report_ignored`), never dropped silently and never a crash. A knob at
the value that means "off" in ART (`advantage_balance=0.0`, `plot_tensors=False`, None...) asks for
nothing and is not reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import LOSSES, LoraConfig, ModelConfig, TrainConfig, canonical_loss, loss_choices, report_ignored

__all__ = ["model_config", "train_config"]

# ART's train argument -> TrainConfig field.
_TRAIN_FIELDS = {
    "learning_rate": "learning_rate",
    "loss_fn": "loss",
    "epsilon": "epsilon",
    "epsilon_high": "epsilon_high",
    "kl_penalty_coef": "kl_penalty_coef",
    "scale_rewards": "scale_rewards",
    "logprob_calculation_chunk_size": "logprob_chunk_tokens",
    "packed_sequence_length": "microbatch_tokens",
    "grad_accumulation_sequences": "grad_accumulation_sequences",
    "max_grad_norm": "max_grad_norm",
    "weight_decay": "weight_decay",
    "importance_sampling_level": "importance_sampling_level",
    # TRL's GRPOConfig names, for code that passes them through
    "loss_type": "loss",
    "mask_truncated_completions": "mask_truncated_completions",
    "max_completion_length": "max_completion_length",
    "vllm_importance_sampling_correction": "importance_sampling_correction",
    "vllm_importance_sampling_mode": "importance_sampling_mode",
    "vllm_importance_sampling_clip_max": "importance_sampling_cap",
    "vllm_importance_sampling_cap": "importance_sampling_cap",
    "vllm_importance_sampling_clip_min": "importance_sampling_floor",
}
# Arguments that change nothing here whatever their value: art_nb always trains without logprobs
# where the endpoint sent none (re-tokenising), `verbose` only printed.
_NO_EFFECT = {"allow_training_without_logprobs", "verbose"}
# ART's value that asks for nothing: any other value is reported.
_OFF = {
    "advantage_balance": 0.0, "mask_prob_ratio": False, "normalize_by_length": True,
    "precalculate_logprobs": False, "plot_tensors": False, "scale_learning_rate_by_reward_std_dev": False,
    "num_trajectories_learning_rate_multiplier_power": 0.0, "save_checkpoint": True,
}
_WHY = {
    "save_checkpoint": "every step is checkpointed",
    "kl_penalty_reference_step": "the KL reference is the base model",
    "kl_ref_adapter_path": "the KL reference is the base model",
    "adam_params": "AdamW's betas and weight decay are TrainConfig fields",
}


def train_config(config: TrainConfig | None, kwargs: Mapping[str, Any], where: str) -> TrainConfig:
    """`config` (default: `TrainConfig()`, ART's defaults) with ART's train arguments applied.

    Fields the user set in `config` stay unless an argument sets them again; a default that
    depends on the loss (epsilon) follows the loss finally chosen. TRL's `GRPOConfig` names
    (`loss_type`, `vllm_importance_sampling_*`, `mask_truncated_completions`) map too. Raises
    ValueError for a loss or importance-sampling level art_nb does not have, naming those it has.
    """
    base = config if config is not None else TrainConfig()
    fields = base.model_dump(include=base.model_fields_set)
    ignored: dict[str, str] = {}
    for name, value in kwargs.items():
        if name in _TRAIN_FIELDS:
            if value is not None:
                fields[_TRAIN_FIELDS[name]] = value
        elif name == "normalize_advantages":
            if not value:
                fields["scale_rewards"] = False
        elif name == "ppo":
            fields["loss"] = "ppo" if value else "cispo"
        elif name == "normalize_by_length" and value is False:
            fields["loss"] = "dr_grpo"  # ART: "set to False for Dr. GRPO"
        elif name == "truncated_importance_sampling" and value is not None:
            # ART's cap on the sampling-time importance weight: the token_truncate correction at that cap
            fields.update(importance_sampling_correction=True, importance_sampling_mode="token_truncate",
                          importance_sampling_cap=value)
        elif name in _NO_EFFECT or value is None or (name in _OFF and value == _OFF[name]):
            continue
        else:
            ignored[name] = _WHY.get(name, "no equivalent in art_nb")
    loss = fields.get("loss")
    if loss is not None:
        fields["loss"] = loss = canonical_loss(loss)  # TRL's names for ours (LOSSES' aliases)
        if loss not in LOSSES:
            raise ValueError(f"{where}: loss_fn={loss!r} is not available; use {loss_choices()}")
    level = fields.get("importance_sampling_level")
    if level not in (None, "token", "sequence"):
        raise ValueError(f"{where}: importance_sampling_level={level!r} is not available; use 'token' or 'sequence'")
    report_ignored(ignored, where)
    return TrainConfig.model_validate(fields)


def model_config(base: ModelConfig, internal: Mapping[str, Any] | None, lora: Mapping[str, Any] | None) -> ModelConfig:
    """`base` with ART's `_internal_config` (InitArgs, EngineArgs, PeftArgs, ...) and `lora_config` applied."""
    internal = dict(internal or {})
    fields = base.model_dump(include=base.model_fields_set)
    lora_fields = base.lora.model_dump(include=base.lora.model_fields_set)
    ignored: dict[str, str] = {}

    def take(section: str, values: Mapping[str, Any] | None, table: dict[str, tuple[str, str]]) -> None:
        for key, value in dict(values or {}).items():
            if key in table:
                target, name = table[key]
                (lora_fields if target == "lora" else fields)[name] = value
            elif value is not None:
                ignored[f"{section}.{key}"] = "no equivalent in art_nb"

    take("init_args", internal.pop("init_args", None), {
        "max_seq_length": ("model", "max_seq_len"), "dtype": ("model", "dtype"),
        "load_in_4bit": ("model", "load_in_4bit"), "gpu_memory_utilization": ("model", "gpu_memory_utilization"),
        "random_state": ("model", "seed"), "model_name": ("model", "_model_name")})
    take("engine_args", internal.pop("engine_args", None), {
        "gpu_memory_utilization": ("model", "gpu_memory_utilization"), "max_num_seqs": ("model", "max_batch_size"),
        "seed": ("model", "seed"), "max_model_len": ("model", "_max_model_len"),
        "enable_sleep_mode": ("model", "_sleep"), "enforce_eager": ("model", "_enforce_eager")})
    take("peft_args", internal.pop("peft_args", None), {
        "r": ("lora", "rank"), "lora_alpha": ("lora", "alpha"), "lora_dropout": ("lora", "dropout"),
        "target_modules": ("lora", "target_modules"), "random_state": ("model", "seed")})
    take("lora_config", lora, {
        "rank": ("lora", "rank"), "alpha": ("lora", "alpha"), "dropout": ("lora", "dropout"),
        "target_modules": ("lora", "target_modules")})
    template = internal.pop("chat_template", None)
    template_path = internal.pop("chat_template_path", None)
    if template is None and template_path is not None:  # ART: a file holding the template
        try:
            template = Path(template_path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"_internal_config.chat_template_path={template_path!r} cannot be read ({exc}); pass "
                             "the template's text as _internal_config.chat_template instead") from exc
    if template is not None:
        fields["chat_template"] = template
    for key, value in internal.items():
        if value is not None:
            ignored[f"_internal_config.{key}"] = ("per-step knobs are TrainConfig's" if key == "trainer_args"
                                                  else "no equivalent in art_nb")
    fields.pop("_model_name", None)  # the base model is TrainableModel.base_model
    max_model_len = fields.pop("_max_model_len", None)
    if max_model_len is not None:
        fields.setdefault("max_seq_len", max_model_len)
    if fields.pop("_enforce_eager", None):  # ART's way to skip CUDA graphs and compile: our "eager" start-up
        fields.setdefault("vllm_startup", "eager")
    sleep = fields.pop("_sleep", None)
    if sleep is False:  # vLLM without sleep mode cannot sleep while a step trains
        fields["sleep_during_training"] = False
    if "dtype" in fields and fields["dtype"] is None:
        fields["dtype"] = "auto"
    report_ignored(ignored, "TrainableModel")
    return ModelConfig.model_validate({**fields, "lora": LoraConfig.model_validate(lora_fields)})
