"""Tool-using two-turn rollouts through the real endpoint on SmolLM2 (CPU), inside `art.trajectory`:
the second prompt extends the first prompt + the sampled ids exactly, and capture trains on exactly
those ids (`template_fallbacks == 0`). Twice: with SmolLM2's own template, which shows no tools
(art_nb's Hermes-style fallback shows them), and with a Qwen2.5 template set through
`ModelConfig(chat_template=...)`, which shows tools itself and re-serialises every call it renders.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from chat_templates import QWEN25_TEMPLATE

import art_nb as art
from art_nb.grpo.tokens import tokenize_trajectory

pytestmark = pytest.mark.slow

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SYSTEM = "You answer with a tool call when a tool can help."


def _example_calls() -> list[dict[str, Any]]:
    """Four earlier questions answered with a call (written by the client, not sampled): with them in
    the conversation the tiny model calls the tool in most samples."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for i, city in enumerate(["Rome", "Oslo", "Lima", "Cairo"]):
        messages += [{"role": "user", "content": f"Weather in {city}?"},
                     {"role": "assistant", "content": None, "tool_calls": [{"id": f"ex{i}", "type": "function", "function": {
                         "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                     {"role": "tool", "tool_call_id": f"ex{i}", "content": "18 C"}]
    return messages


def _ids(obj: Any, key: str) -> list[int]:
    return list(obj.model_extra[key])


async def _rollout(model: art.TrainableModel, seed: int, seen: list[dict[str, Any]]) -> None:
    """Turn 1 offers the tool (n=2: the rollout goes on with a choice that called it, if any); the client
    sends the call back with its arguments re-serialised (sorted, indented), then the tool's result."""
    client = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key, max_retries=0)
    name = model.get_inference_name()
    messages = [*_example_calls(), {"role": "user", "content": "Weather in Paris?"}]
    first = await client.chat.completions.create(model=name, messages=messages, tools=TOOLS, max_tokens=32,
                                                 seed=seed, n=2, temperature=1.0)
    choice = next((c for c in first.choices if c.message.tool_calls), first.choices[0])
    message = choice.message.model_dump(exclude_none=True)
    for call in message.get("tool_calls") or []:
        call["function"]["arguments"] = json.dumps(json.loads(call["function"]["arguments"]), indent=1, sort_keys=True)
    messages.append(message)
    if choice.message.tool_calls:
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "21 C"} for c in choice.message.tool_calls]
    else:
        messages.append({"role": "user", "content": "Please call the tool."})
    second = await client.chat.completions.create(model=name, messages=messages, tools=TOOLS, max_tokens=8, seed=seed)
    seen.append({"p1": _ids(first, "prompt_token_ids"), "c1": _ids(choice, "token_ids"),
                 "p2": _ids(second, "prompt_token_ids"), "called": bool(choice.message.tool_calls)})
    art.current_trajectory(required=True).reward = float(bool(choice.message.tool_calls)) + 0.01 * seed
    await client.close()


async def _check(tmp_path: Any, config: art.ModelConfig, expect_tools: str) -> str:
    """Four rollouts checked as the module docstring says; the first prompt's text."""
    backend = art.LocalBackend(path=tmp_path)
    model = art.TrainableModel(name="turns", project="it", base_model=TINY, config=config)
    try:
        await model.register(backend)
        assert expect_tools in backend.choices(model)["tools"]
        seen: list[dict[str, Any]] = []
        group = await art.trajectory_group([art.trajectory(_rollout(model, seed, seen)) for seed in range(3)])
        tokenizer = backend._runtime.state(model).trainer.tokenizer  # the trainer's: what training tokenises with
        for s in seen:
            assert s["p2"][: len(s["p1"]) + len(s["c1"])] == s["p1"] + s["c1"]  # token in, token out
        shown = tokenizer.decode(seen[0]["p1"])
        assert "get_weather" in shown  # the tools reached the model
        for t in group.trajectories:
            seq = tokenize_trajectory(tokenizer, t, 4096)
            assert seq.template_fallbacks == 0 and seq.retokenized_choices == 0
            sampled = [i for call in t.exchanges for i in call.choices[0].token_ids] if all(
                len(c.choices) == 1 for c in t.exchanges) else None
            if sampled is not None:
                assert [i for i, m in zip(seq.input_ids, seq.assistant_mask, strict=True) if m] == sampled
        assert any(s["called"] for s in seen), "no rollout's first turn called the tool: the call path went untested"
        return shown
    finally:
        await backend.close()


async def test_smollm2_gets_the_hermes_fallback_and_turns_extend_exactly(tmp_path) -> None:
    shown = await _check(tmp_path, art.ModelConfig(max_seq_len=1024), "Hermes-style")
    assert "<tools>\n" in shown and "<tool_call></tool_call> tags" in shown


async def test_a_qwen_template_that_rewrites_calls_extends_exactly(tmp_path) -> None:
    shown = await _check(tmp_path, art.ModelConfig(max_seq_len=1024, chat_template=QWEN25_TEMPLATE), "own rendering")
    assert "You are provided with function signatures" in shown  # Qwen's own words, not art_nb's fallback
