"""Constrained decoding on vLLM: the endpoint's grammar (server/constrain.py) as a vLLM structured output.

vLLM enforces it with its "guidance" structured-output backend, which is llguidance, the library the
transformers engine masks with (engines/hf/grammar.py): both engines hold a reply to the same grammar
text, so a rollout is constrained alike on a CPU and on a GPU. The backend is an engine setting
(`args.engine_args` sets it), not a request's: vLLM refuses a per-request backend, and its "auto"
tries xgrammar first, whose Lark reader has no `%json` rule.

Names, the same in vLLM 0.11.2 and 0.32: `SamplingParams.structured_outputs` takes
`StructuredOutputsParams(grammar=...)` (0.11's `GuidedDecodingParams` is a deprecated alias of it),
and `EngineArgs.structured_outputs_config` a `StructuredOutputsConfig`. vLLM applies the grammar's
bitmask to the logits before its sampler takes raw logprobs, so the logprobs it returns are of the
masked distribution, as the transformers engine's are (docs/losses.md: what training does with them).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BACKEND", "structured_outputs", "with_config_objects"]

BACKEND = {"backend": "guidance"}  # EngineArgs.structured_outputs_config, kept a dict so args.py imports no vLLM


def structured_outputs(grammar: str | None) -> Any:
    """vLLM's structured output for a Lark `grammar` (llguidance's dialect), or None."""
    if grammar is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(grammar=grammar)


def with_config_objects(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` for `EngineArgs`, with `structured_outputs_config` as the config object vLLM expects."""
    config = kwargs.get("structured_outputs_config")
    if not isinstance(config, dict):
        return kwargs
    from vllm.config import StructuredOutputsConfig

    return {**kwargs, "structured_outputs_config": StructuredOutputsConfig(**config)}
