"""Constrained decoding in HFEngine on the real tiny model (SmolLM2-135M-Instruct, CPU): the endpoint's
grammars (server/constrain.py) hold greedy and sampled replies, beside unconstrained rows in the same
batch, and the logprobs are of the masked distribution (never below the full forward's)."""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio
import torch

from art_nb.config import ModelConfig
from art_nb.local.engines.base import GenerationRequest, SamplingParams
from art_nb.local.engines.hf.engine import HFEngine
from art_nb.local.plan.base_models import TINY_MODEL, resolve_base_model
from art_nb.local.server.constrain import grammar_for
from art_nb.local.server.pipeline import render_prompt
from art_nb.local.server.schema import ChatCompletionRequest
from art_nb.local.server.toolcalls import parse_tool_calls

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

QUESTION = "What is the weather in Paris today?"
FORECAST = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                             "sky": {"enum": ["sunny", "cloudy", "rainy"]},
                                             "celsius": {"type": "integer", "minimum": -40, "maximum": 50}},
            "required": ["city", "sky", "celsius"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine():
    engine = await HFEngine.create(resolve_base_model(TINY_MODEL).path, ModelConfig(max_seq_len=512, max_batch_size=8))
    yield engine
    await engine.close()


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": QUESTION}],
                                                 **fields})


def unmasked_logprobs(engine: HFEngine, prompt: list[int], completion: list[int]) -> list[float]:
    with torch.no_grad():
        logits = engine._model(torch.tensor([prompt + completion])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()


async def test_a_json_schema_holds_every_reply_beside_free_rows(engine: HFEngine) -> None:
    req = request(response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": FORECAST}})
    prompt, grammar = render_prompt(engine.tokenizer, req), grammar_for(req)
    held, free = await asyncio.gather(  # one batch: constrained and unconstrained rows side by side
        engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=64, n=4, seed=3, grammar=grammar))),
        engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=24, n=2, seed=3))))
    for sample in held:
        text = engine.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        reply = json.loads(text)
        assert sample.finish_reason == "stop" and sample.token_ids[-1] == engine.tokenizer.eos_token_id
        assert set(reply) == {"city", "sky", "celsius"} and reply["sky"] in FORECAST["properties"]["sky"]["enum"]
        assert -40 <= reply["celsius"] <= 50 and "\n" not in text
        full = unmasked_logprobs(engine, prompt, sample.token_ids)
        assert all(m >= u - 1e-4 for m, u in zip(sample.logprobs, full, strict=True))  # the mask only adds mass
        assert min(u - m for m, u in zip(sample.logprobs, full, strict=True)) < -1  # and here it removed most
    for sample in free:  # the free rows of the same batch are not masked: their logprobs are the full forward's
        full = unmasked_logprobs(engine, prompt, sample.token_ids)
        assert max(abs(m - u) for m, u in zip(sample.logprobs, full, strict=True)) < 1e-3


async def test_forced_tool_calls_parse_as_the_endpoint_reads_them(engine: HFEngine) -> None:
    named = request(tools=[ADD, WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    required = request(tools=[ADD, WEATHER], tool_choice="required", parallel_tool_calls=False)
    for req, names in ((named, {"get_weather"}), (required, {"add", "get_weather"})):
        prompt = render_prompt(engine.tokenizer, req)
        samples = await engine.generate(GenerationRequest(prompt, SamplingParams(
            max_tokens=48, n=3, seed=5, grammar=grammar_for(req))))
        for sample in samples:
            content, calls = parse_tool_calls(engine.tokenizer.decode(sample.token_ids, skip_special_tokens=True))
            assert content == "" and len(calls) == 1 and calls[0]["function"]["name"] in names, content
            arguments = json.loads(calls[0]["function"]["arguments"])
            assert set(arguments) == ({"city"} if calls[0]["function"]["name"] == "get_weather" else {"a", "b"})


async def test_greedy_under_a_grammar_is_deterministic(engine: HFEngine) -> None:
    req = request(response_format={"type": "json_object"})
    prompt, grammar = render_prompt(engine.tokenizer, req), grammar_for(req)
    params = SamplingParams(max_tokens=40, temperature=0.0, grammar=grammar)
    first, second = await asyncio.gather(*(engine.generate(GenerationRequest(prompt, params)) for _ in range(2)))
    assert first[0].token_ids == second[0].token_ids
    assert engine.tokenizer.decode(first[0].token_ids, skip_special_tokens=True).startswith("{")
