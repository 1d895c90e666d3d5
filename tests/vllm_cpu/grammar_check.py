"""Constrained decoding on vLLM's CPU build, beside the transformers engine: `grammar_cases`, which
engine_check.py runs on its engine (recorded under "grammar"; test_vllm_engine_cpu.py asserts on it).

For each constraint the endpoint serves (a strict json_schema, json_object, a named tool_choice,
"required"), the request's grammar (art_nb.local.server.constrain) is sampled by art_nb's VLLMEngine
and by its HFEngine on the same prompt: greedy (both engines in float32 on a CPU, so the same ids
are expected) and four seeded samples from vLLM. Recorded per case: the texts, whether the two greedy
runs agree, the largest logprob gap between them, the reply vLLM gives without the grammar, and the
mass the grammar left at each greedy token (exp of transformers' unmasked logprob minus vLLM's: 1 where
the mask removed nothing; far below 1 shows vLLM's logprobs are of the masked distribution).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 24}}, "required": ["city"],
                                                "additionalProperties": False}}}
FORECAST = {"type": "json_schema", "json_schema": {"name": "forecast", "strict": True, "schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                     "sky": {"type": "string", "enum": ["sunny", "cloudy", "rainy"]},
                                     "celsius": {"type": "integer", "minimum": -40, "maximum": 50}},
    "required": ["city", "sky", "celsius"], "additionalProperties": False}}}
QUESTION = "What is the weather in Paris today? And what is 2 plus 3?"
CASES: dict[str, dict[str, Any]] = {
    "json_schema": {"response_format": FORECAST},
    "json_object": {"response_format": {"type": "json_object"}},
    "named_tool": {"tools": [ADD, WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "required": {"tools": [ADD, WEATHER], "tool_choice": "required", "parallel_tool_calls": False},
}


async def grammar_cases(engine: Any, model_dir: Path, unmasked_logprobs: Callable[..., list[float]],
                        save: Callable[[str, Any], None]) -> None:
    """Run CASES on `engine` (a VLLMEngine) and on an HFEngine of `model_dir`; save the record under "grammar"."""
    from art_nb.config import ModelConfig
    from art_nb.local.engines.base import GenerationRequest, SamplingParams
    from art_nb.local.engines.hf.engine import HFEngine
    from art_nb.local.server.constrain import grammar_for
    from art_nb.local.server.pipeline import render_prompt
    from art_nb.local.server.schema import ChatCompletionRequest

    record: dict[str, Any] = {"backend": engine._engine.vllm_config.structured_outputs_config.backend}
    hf = await HFEngine.create(model_dir, ModelConfig(max_seq_len=512, max_batch_size=8), device="cpu")
    tokenizer = engine.tokenizer
    try:
        for name, fields in CASES.items():
            req = ChatCompletionRequest.model_validate(
                {"model": "m", "messages": [{"role": "user", "content": QUESTION}], **fields})
            prompt, grammar = render_prompt(tokenizer, req), grammar_for(req)
            greedy = SamplingParams(max_tokens=96, temperature=0.0, grammar=grammar)
            [held] = await engine.generate(GenerationRequest(prompt, greedy))
            [hf_held] = await hf.generate(GenerationRequest(prompt, greedy))
            [free] = await engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=96, temperature=0.0)))
            sampled = await engine.generate(GenerationRequest(prompt, SamplingParams(
                max_tokens=96, temperature=1.0, n=4, seed=7, grammar=grammar)))
            left = [math.exp(b - a) for a, b in zip(held.logprobs, unmasked_logprobs(model_dir, prompt, held.token_ids),
                                                    strict=True)]
            same = held.token_ids == hf_held.token_ids
            record[name] = {
                "vllm_greedy": tokenizer.decode(held.token_ids, skip_special_tokens=True),
                "vllm_greedy_ends_with_eos": held.token_ids[-1:] == [tokenizer.eos_token_id],
                "hf_greedy": tokenizer.decode(hf_held.token_ids, skip_special_tokens=True),
                "greedy_ids_equal": same,
                "greedy_logprob_gap": max(abs(a - b) for a, b in zip(held.logprobs, hf_held.logprobs))
                if same else None,
                "unconstrained_greedy": tokenizer.decode(free.token_ids, skip_special_tokens=True),
                "samples": [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in sampled],
                "finish_reasons": [s.finish_reason for s in [held, *sampled]],
                "mass_left_min": min(left),
                "mass_left_max": max(left),
            }
            save("grammar", record)
    finally:
        await hf.close()
