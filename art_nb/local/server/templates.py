"""A served model's prompt settings, set once at register, with the reasons register reports: which
chat template renders its prompts (`ModelConfig.chat_template`, where ART's
`_internal_config.chat_template` lands; else the tokenizer's own), how tools are shown
(`art_nb.tool_prompt`: the template's own rendering or the Hermes-style fallback), and how earlier
sampled turns come back (`ModelConfig.assistant_turns`, `turns.py`).

The template is set on both the engine's tokenizer (the endpoint renders with it) and the trainer's
(ART-style trajectories are rendered with it in `grpo/tokens.py`): tokens trained must be tokens
served. One engine serves every model of a base model, so a second model asking other settings of
the same engine is refused at register rather than served with the first one's.
"""

from __future__ import annotations

import weakref
from typing import Any

from art_nb.config import ModelConfig
from art_nb.tool_prompt import tool_style

from .turns import configure

__all__ = ["apply_prompt_config"]

_APPLIED: weakref.WeakKeyDictionary[Any, tuple[str | None, str, int]] = weakref.WeakKeyDictionary()


def _settings(config: ModelConfig) -> tuple[str | None, str, int]:
    return config.chat_template, config.assistant_turns, config.turn_cache_tokens


def apply_prompt_config(engine_tokenizer: Any, trainer_tokenizer: Any, config: ModelConfig, model_name: str
                        ) -> dict[str, str]:
    """Set `config`'s prompt settings on both tokenizers (`trainer_tokenizer` None: the engine's only);
    the reasons, for register's choices. Raises ValueError, changing nothing, when the engine already
    serves a model with other prompt settings."""
    applied = _APPLIED.get(engine_tokenizer)
    if applied is not None and applied != _settings(config):
        raise ValueError(
            f"model {model_name!r} asks for chat_template/assistant_turns/turn_cache_tokens other than those of the "
            "model already served from this base model (one engine serves both, and it renders prompts one way); "
            "register it with the same three ModelConfig fields, or restart the kernel to change them")
    for tokenizer in (engine_tokenizer, trainer_tokenizer):
        if config.chat_template is not None and tokenizer is not None:
            tokenizer.chat_template = config.chat_template
    if _APPLIED.get(engine_tokenizer) != _settings(config):  # a second model of this engine keeps its turns
        configure(engine_tokenizer, config.assistant_turns, config.turn_cache_tokens)
        _APPLIED[engine_tokenizer] = _settings(config)
    template = ("ModelConfig.chat_template (or ART's _internal_config.chat_template)"
                if config.chat_template is not None else "the base model's tokenizer's")
    if config.assistant_turns == "sampled":
        turns = (f"an earlier assistant turn this endpoint sampled goes back to the model as the ids it sampled "
                 f"(up to {config.turn_cache_tokens:,} ids kept), so multi-turn prompts extend each other exactly; "
                 "ModelConfig(assistant_turns='rendered') renders the whole conversation each time instead")
    else:
        turns = ("ModelConfig.assistant_turns='rendered': every prompt is the chat template's rendering of the whole "
                 "conversation, tokenised again (a re-tokenised reply may split differently from how it was sampled)")
    return {"chat_template": template, "tools": tool_style(engine_tokenizer).reason, "assistant_turns": turns}
