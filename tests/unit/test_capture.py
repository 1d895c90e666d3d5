"""Capture: rollouts written with any HTTP client, recorded inside `art.trajectory(...)`
scopes with the server's own token ids, and trained on exactly those ids.

A real art_nb server on loopback (`create_app` + `start_server`) over a scripted engine with the
in-process ChatML tokenizer, so every test knows which ids the server sampled; no model weights.
The real tiny model is covered by tests/integration/test_capture_real.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import pytest
import pytest_asyncio
import requests

import art_nb as art
from art_nb.grpo.captured import CaptureRefused
from art_nb.grpo.tokens import tokenize_trajectory, training_sequences
from art_nb.local.engines.base import GenerationRequest, Sample
from art_nb.local.server import InferenceGate, ServedModel, create_app, start_server
from art_nb.local.server.turns import configure
from tests.conftest import CHATML_TEMPLATE, build_chatml_tokenizer, char_ids

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "sk-capture-secret-123"
# ChatML that drops <think>...</think> from every assistant turn but the last (as Qwen3's does).
THINK_STRIPPING = CHATML_TEMPLATE.replace(
    "{%- if message['content'] -%}{{- message['content'] -}}{%- endif -%}",
    "{%- if message['content'] -%}{%- if message['role'] == 'assistant' and not loop.last -%}"
    "{{- message['content'].split('</think>')[-1] -}}{%- else -%}{{- message['content'] -}}{%- endif -%}{%- endif -%}",
)


class Engine:
    """Answers `script(prompt text)`, sampled as canonical ids (or one id per character when
    `by_chars`), + EOS; the k-th token's logprob is -(k + 1) / 100."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.max_context = tokenizer, 4096
        self.script: Callable[[str], str] = lambda prompt: f"reply {prompt.count('<|im_start|>user')}"
        self.by_chars = False
        self.sampled: list[list[int]] = []

    async def generate(self, request: GenerationRequest) -> list[Sample]:
        text = self.script(self.tokenizer.decode(request.prompt_ids))
        samples = []
        for _ in range(request.params.n):
            body = char_ids(self.tokenizer, text) if self.by_chars else self.tokenizer.encode(text, add_special_tokens=False)
            ids = body + [self.tokenizer.eos_token_id]
            self.sampled.append(ids)
            samples.append(Sample(ids, [-(k + 1) / 100 for k in range(len(ids))], "stop"))
        return samples


class Registry:
    def __init__(self, engines: dict[str, Engine]) -> None:
        self.engines = engines

    def resolve(self, name: str) -> ServedModel:
        return ServedModel(self.engines[name.partition("@")[0]], None, name)

    def list_models(self) -> list[str]:
        return list(self.engines)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server() -> AsyncIterator[Any]:
    plain, thinking = build_chatml_tokenizer(), build_chatml_tokenizer(THINK_STRIPPING)
    # "-rendered": ModelConfig(assistant_turns="rendered"), every prompt the template's whole rendering
    rendered, thinking_rendered = build_chatml_tokenizer(), build_chatml_tokenizer(THINK_STRIPPING)
    for tokenizer in (rendered, thinking_rendered):
        configure(tokenizer, "rendered", 0)
    engines = {"agent": Engine(plain), "judge": Engine(plain), "thinker": Engine(thinking),
               "agent-rendered": Engine(rendered), "thinker-rendered": Engine(thinking_rendered)}
    running = await start_server(create_app(Registry(engines), InferenceGate(), api_key=KEY))
    running.engines = engines
    yield running
    await running.stop()


@pytest.fixture
def srv(server: Any) -> Any:
    for engine in server.engines.values():
        engine.script = lambda prompt: f"reply {prompt.count('<|im_start|>user')}"
        engine.by_chars, engine.sampled = False, []
    return server


def _client(srv: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0)


async def two_turns_openai(srv: Any, model: str = "agent", stream: bool = False) -> None:
    client = _client(srv)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    for turn in range(2):
        if stream:
            parts = [chunk async for chunk in await client.chat.completions.create(
                model=model, messages=messages, stream=True)]
            content = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        else:
            done = await client.chat.completions.create(model=model, messages=messages)
            content = done.choices[0].message.content
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"again {turn}"}]
    art.current_trajectory(required=True).reward = 1.0
    await client.close()


def check_exact(t: art.Trajectory, srv: Any, engine: str = "agent") -> None:
    """Trained ids are exactly the sampled ones, in order; everything else is the servers' prompts."""
    tok = srv.engines[engine].tokenizer
    seq = tokenize_trajectory(tok, t, 10_000)
    assert seq.retokenized_choices == 0
    sampled = srv.engines[engine].sampled
    assert [c.choices[0].token_ids for c in t.exchanges] == sampled
    assert [i for i, m in zip(seq.input_ids, seq.assistant_mask) if m] == [i for ids in sampled for i in ids]
    last = t.exchanges[-1]
    assert seq.input_ids == last.prompt_token_ids + last.choices[0].token_ids
    trained_logprobs = [lp for lp, m in zip(seq.engine_logprobs, seq.assistant_mask) if m]
    assert trained_logprobs == [-(k + 1) / 100 for ids in sampled for k in range(len(ids))]


async def test_openai_sdk_rollout_is_captured_exactly(srv: Any) -> None:
    t = await art.trajectory(two_turns_openai(srv))
    assert len(t.exchanges) == 2 and t.reward == 1.0 and "duration" in t.metrics
    check_exact(t, srv)
    assert KEY not in t.model_dump_json()  # headers are never recorded


async def test_openai_streaming_is_captured_and_parsed_by_the_sdk(srv: Any) -> None:
    t = await art.trajectory(two_turns_openai(srv, stream=True))
    assert [c.streamed for c in t.exchanges] == [True, True]
    assert [c.choices[0].message["content"] for c in t.exchanges] == ["reply 1", "reply 2"]
    check_exact(t, srv)


async def test_raw_httpx_rollout_is_captured(srv: Any) -> None:
    async def rollout() -> None:
        async with httpx.AsyncClient(base_url=srv.base_url, headers={"Authorization": f"Bearer {KEY}"}) as http:
            messages = [{"role": "user", "content": "hi"}]
            for _ in range(2):
                r = await http.post("/chat/completions", json={"model": "agent", "messages": messages})
                messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "more"}]

    t = await art.trajectory(rollout())
    assert len(t.exchanges) == 2
    check_exact(t, srv)


async def test_requests_in_a_thread_and_aiohttp_are_captured(srv: Any) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}

    def post(messages: list[dict[str, Any]]) -> dict[str, Any]:
        return requests.post(f"{srv.base_url}/chat/completions", json={"model": "agent", "messages": messages},
                             headers=headers, timeout=10).json()

    async def rollout() -> None:
        messages = [{"role": "user", "content": "hi"}]
        body = await asyncio.to_thread(post, messages)
        messages += [body["choices"][0]["message"], {"role": "user", "content": "more"}]
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.post(f"{srv.base_url}/chat/completions",
                                    json={"model": "agent", "messages": messages}) as r:
                await r.json()

    t = await art.trajectory(rollout())
    assert len(t.exchanges) == 2
    check_exact(t, srv)


async def test_no_capture_excludes_a_call_and_calls_outside_scopes_are_not_recorded(srv: Any) -> None:
    client = _client(srv)

    async def rollout() -> None:
        await client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "hi"}])
        with art.no_capture():
            await client.chat.completions.create(model="judge", messages=[{"role": "user", "content": "grade"}])

    t = await art.trajectory(rollout())
    assert [c.model for c in t.exchanges] == ["agent"]
    await client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "outside"}])
    assert len(t.exchanges) == 1
    await client.close()


async def test_concurrent_scopes_do_not_mix(srv: Any) -> None:
    client = _client(srv)

    async def rollout(word: str, turns: int) -> None:
        messages = [{"role": "user", "content": word}]
        for _ in range(turns):
            done = await client.chat.completions.create(model="agent", messages=messages)
            messages += [done.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": word}]
            await asyncio.sleep(0)

    group = await art.trajectory_group([art.trajectory(rollout("alpha", 3)), art.trajectory(rollout("beta", 2))])
    assert [len(t.exchanges) for t in group.trajectories] == [3, 2]
    for t, word in zip(group.trajectories, ["alpha", "beta"]):
        assert all(call.request["messages"][0]["content"] == word for call in t.exchanges)
        assert tokenize_trajectory(srv.engines["agent"].tokenizer, t, 10_000).retokenized_choices == 0
    await client.close()


async def test_with_blocks_nest_and_groups_collect(srv: Any) -> None:
    client = _client(srv)
    with art.TrajectoryGroup() as group:
        with art.Trajectory() as outer:
            await client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "a"}])
            with art.Trajectory() as inner:
                assert art.current_trajectory() is inner
                await client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "b"}])
            assert art.current_trajectory_group() is group
    assert (len(outer.exchanges), len(inner.exchanges)) == (1, 1)  # the innermost scope records
    assert group.trajectories == [inner, outer] and art.current_trajectory() is None
    await client.close()


async def test_mixed_models_are_refused(srv: Any) -> None:
    client = _client(srv)

    async def rollout() -> None:
        await client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "hi"}])
        await client.chat.completions.create(model="judge", messages=[{"role": "user", "content": "grade"}])

    t = await art.trajectory(rollout())
    with pytest.raises(CaptureRefused, match=r"call 1 went to model 'judge'.*no_capture"):
        tokenize_trajectory(srv.engines["agent"].tokenizer, t, 10_000)
    await client.close()


async def test_a_template_that_drops_think_trains_exactly_and_rendered_turns_part_the_history_naming_the_call(
        srv: Any) -> None:
    for name in ("thinker", "thinker-rendered"):
        srv.engines[name].script = lambda prompt: "<think>plan it</think>four"
    t = await art.trajectory(two_turns_openai(srv, model="thinker"))
    seq = tokenize_trajectory(srv.engines["thinker"].tokenizer, t, 10_000)  # the sampled turn came back as sampled
    assert seq.template_fallbacks == 0
    assert [i for i, m in zip(seq.input_ids, seq.assistant_mask) if m] == [i for ids in srv.engines["thinker"].sampled
                                                                          for i in ids]
    t = await art.trajectory(two_turns_openai(srv, model="thinker-rendered"))
    with pytest.raises(CaptureRefused) as refused:
        tokenize_trajectory(srv.engines["thinker-rendered"].tokenizer, t, 10_000)
    message = str(refused.value)
    assert "captured call 1's prompt does not extend" in message and "<think>plan it</think>" in message
    first, second = training_sequences(srv.engines["thinker-rendered"].tokenizer, t, 10_000)  # what a step trains
    assert second.parted == message and first.parted is None
    sampled = srv.engines["thinker-rendered"].sampled
    assert [[i for i, m in zip(s.input_ids, s.assistant_mask) if m] for s in (first, second)] == sampled[-2:]


async def test_non_canonical_sampled_ids_come_back_as_sampled(srv: Any) -> None:
    srv.engines["agent"].by_chars = True  # the text re-encodes differently; the next prompt holds the ids
    t = await art.trajectory(two_turns_openai(srv))
    first = t.exchanges[0].prompt_token_ids + t.exchanges[0].choices[0].token_ids
    assert t.exchanges[1].prompt_token_ids[: len(first)] == first
    seq = tokenize_trajectory(srv.engines["agent"].tokenizer, t, 10_000)
    assert seq.retokenized_choices == 0 and seq.template_fallbacks == 0


async def test_non_canonical_sampled_ids_stay_as_sampled_when_turns_are_rendered(srv: Any) -> None:
    srv.engines["agent-rendered"].by_chars = True  # the server re-encodes the text it gets back differently
    t = await art.trajectory(two_turns_openai(srv, model="agent-rendered"))
    tok = srv.engines["agent-rendered"].tokenizer
    assert t.exchanges[1].prompt_token_ids[: len(t.exchanges[0].prompt_token_ids) + 2] != (
        t.exchanges[0].prompt_token_ids + t.exchanges[0].choices[0].token_ids)[: len(t.exchanges[0].prompt_token_ids) + 2]
    seq = tokenize_trajectory(tok, t, 10_000)
    assert seq.retokenized_choices == 0 and seq.template_fallbacks == 1
    assert [i for i, m in zip(seq.input_ids, seq.assistant_mask) if m] == [
        i for ids in srv.engines["agent-rendered"].sampled for i in ids]
    assert tok.decode(seq.input_ids) == tok.decode(t.exchanges[1].prompt_token_ids + t.exchanges[1].choices[0].token_ids)


async def test_a_captured_trajectory_crosses_the_wire_and_refuses_mixing_with_messages(srv: Any) -> None:
    from art_nb.wire import trajectory_from_wire, trajectory_to_wire

    t = await art.trajectory(two_turns_openai(srv))
    back = trajectory_from_wire(json.loads(json.dumps(trajectory_to_wire(t))))
    assert back.exchanges == t.exchanges
    with pytest.raises(ValueError, match="not both"):
        art.Trajectory(exchanges=t.exchanges, messages_and_choices=[{"role": "user", "content": "x"}])


async def test_other_endpoints_and_bad_bodies_pass_through_unrecorded() -> None:
    from art_nb.capture.body import parse_call

    request = {"model": "gpt", "messages": []}
    openai_style = {"id": "x", "model": "gpt", "choices": [{"index": 0, "message": {"content": "hi"}}]}
    assert parse_call(request, 200, json.dumps(openai_style).encode()) is None
    assert parse_call(request, 500, b'{"prompt_token_ids": [1]}') is None
    assert parse_call(request, 200, b"data: {\"choices\": []}\n\n") is None  # a stream cut short: no [DONE]
    assert parse_call(request, 200, b"<html>") is None


async def test_a_branch_at_the_last_call_is_refused() -> None:
    from art_nb.capture import CapturedCall, CapturedChoice

    tok = build_chatml_tokenizer()
    call = CapturedCall(model="agent", prompt_token_ids=[1, 2], choices=[
        CapturedChoice(index=0, token_ids=[5]), CapturedChoice(index=1, token_ids=[6])])
    with pytest.raises(CaptureRefused, match="n=2"):
        tokenize_trajectory(tok, art.Trajectory(exchanges=[call]), 100)
    follow = CapturedCall(model="agent@3", prompt_token_ids=[1, 2, 6, 7], choices=[CapturedChoice(token_ids=[8])])
    seq = tokenize_trajectory(tok, art.Trajectory(exchanges=[call, follow]), 100)  # call 1 continues choice 1
    assert seq.input_ids == [1, 2, 6, 7, 8] and seq.assistant_mask == [False, False, True, False, True]
    assert all(lp != lp for lp in seq.engine_logprobs)  # no logprobs recorded: NaN, the trainer uses its own
