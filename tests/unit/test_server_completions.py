"""POST /v1/completions (legacy text completions), driven by the openai SDK's client against a real
art_nb server over a scripted engine (the in-process ChatML tokenizer, no weights): a prompt as text or
token ids, `echo`, the legacy logprobs object, stop strings, the stream, the refusals, and capture:
a rollout that sends back the ids it was given trains on exactly the sampled ids.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio
from openai.types import Completion

import art_nb as art
from art_nb.grpo.tokens import tokenize_trajectory
from art_nb.local.engines.base import GenerationRequest, Sample
from art_nb.local.server import InferenceGate, ServedModel, create_app, start_server
from tests.conftest import build_chatml_tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")


class Engine:
    """Answers `reply` + EOS as canonical ids, cut at max_tokens; the k-th logprob is -(k + 1) / 100 and
    the alternatives are the next ids, each 1 nat less likely."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.max_context = tokenizer, 512
        self.reply = " is four. Then five."
        self.requests: list[GenerationRequest] = []
        self.sampled: list[list[int]] = []

    async def generate(self, request: GenerationRequest) -> list[Sample]:
        self.requests.append(request)
        samples = []
        for _ in range(request.params.n):
            ids, finish = self.tokenizer.encode(self.reply, add_special_tokens=False) + [self.tokenizer.eos_token_id], "stop"
            if len(ids) > request.params.max_tokens:
                ids, finish = ids[: request.params.max_tokens], "length"
            self.sampled.append(ids)
            logprobs = [-(k + 1) / 100 for k in range(len(ids))]
            top = [[(t + j, lp - j) for j in range(request.params.top_logprobs)] for t, lp in zip(ids, logprobs)] \
                if request.params.top_logprobs else None
            samples.append(Sample(ids, logprobs, finish, top_logprobs=top))
        return samples


class Registry:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def resolve(self, name: str) -> ServedModel:
        return ServedModel(self.engine, None, name)

    def list_models(self) -> list[str]:
        return ["agent"]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server() -> AsyncIterator[Any]:
    engine = Engine(build_chatml_tokenizer())
    running = await start_server(create_app(Registry(engine), InferenceGate()))
    running.engine = engine
    yield running
    await running.stop()


@pytest.fixture
def engine(server: Any) -> Engine:
    server.engine.reply, server.engine.requests, server.engine.sampled = " is four. Then five.", [], []
    return server.engine


@pytest_asyncio.fixture(loop_scope="module")
async def client(server: Any) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    yield c
    await c.close()


async def test_a_text_prompt_is_continued_with_its_ids(engine: Engine, client: openai.AsyncOpenAI) -> None:
    raw = await client.completions.with_raw_response.create(model="agent", prompt="Two plus two", n=2, seed=3)
    out = Completion.model_validate(raw.http_response.json())  # validated in the SDK's types
    (request,) = engine.requests
    assert request.prompt_ids == engine.tokenizer("Two plus two")["input_ids"]  # no chat template
    assert request.params.max_tokens == 16 and request.params.n == 2 and request.params.seed == 3  # OpenAI's default
    assert out.object == "text_completion" and [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == " is four. Then five." and out.choices[0].finish_reason == "stop"
    assert out.choices[0].logprobs is None
    assert out.model_extra["prompt_token_ids"] == request.prompt_ids
    assert [c.model_extra["token_ids"] for c in out.choices] == engine.sampled
    assert out.usage.prompt_tokens == len(request.prompt_ids)
    assert out.usage.completion_tokens == sum(len(ids) for ids in engine.sampled)


async def test_token_ids_go_in_as_given_and_echo_prepends_the_prompt(engine: Engine, client: openai.AsyncOpenAI) -> None:
    ids = engine.tokenizer.encode("Two plus two", add_special_tokens=False)
    for prompt in ("Two plus two", ids, [ids]):
        out = await client.completions.create(model="agent", prompt=prompt, echo=True, max_tokens=40)
        assert engine.requests[-1].prompt_ids == ids
        assert out.choices[0].text == "Two plus two is four. Then five."


async def test_legacy_logprobs_and_a_stop_string(engine: Engine, client: openai.AsyncOpenAI) -> None:
    out = await client.completions.create(model="agent", prompt="Two plus two", logprobs=2, stop=["."], max_tokens=40)
    choice = out.choices[0]
    assert choice.text == " is four" and choice.finish_reason == "stop"
    ids = choice.model_extra["token_ids"]
    assert engine.tokenizer.decode(ids).startswith(" is four.") and ids == engine.sampled[0][: len(ids)]
    lp = choice.logprobs
    assert lp.tokens == [engine.tokenizer.decode([i]) for i in ids]
    assert lp.token_logprobs == [-(k + 1) / 100 for k in range(len(ids))] == choice.model_extra["token_logprobs"]
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(ids))]
    assert [list(top.values()) for top in lp.top_logprobs] == [[-(k + 1) / 100, -(k + 1) / 100 - 1] for k in
                                                                range(len(ids))]
    assert list(lp.top_logprobs[0]) == [engine.tokenizer.decode([ids[0]]), engine.tokenizer.decode([ids[0] + 1])]


async def test_the_stream_carries_the_same_completion(engine: Engine, client: openai.AsyncOpenAI) -> None:
    whole = await client.completions.create(model="agent", prompt="Two plus two", max_tokens=40)
    chunks = [c async for c in await client.completions.create(model="agent", prompt="Two plus two", max_tokens=40,
                                                                stream=True, stream_options={"include_usage": True})]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    assert chunks[0].choices[0].model_extra["token_ids"] == whole.choices[0].model_extra["token_ids"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None, "stop"]
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"echo": True, "logprobs": 1}, None, "echo with logprobs"),
    ({"prompt": ["one", "two"]}, "prompt", "one prompt per request"),
    ({"prompt": [[1], [2]]}, "prompt", "one prompt per request"),
    ({"prompt": [10**6]}, "prompt", "vocabulary"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"suffix": "end"}, "suffix", "not served"),
    ({"best_of": 3}, "best_of", "best_of == n"),
    ({"presence_penalty": 0.5}, "presence_penalty", "penalties"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias", "bias"),
    ({"max_tokens": 10_000}, "prompt", "context holds 512"),
])
async def test_what_cannot_be_honoured_is_a_400_naming_it(client: openai.AsyncOpenAI, extra: dict[str, Any],
                                                          param: str | None, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(**{"model": "agent", "prompt": "hi", **extra})
    assert err.value.param == param and words in err.value.message


@pytest.mark.parametrize("stream", [False, True])
async def test_a_rollout_that_sends_the_ids_back_is_captured_exactly(engine: Engine, client: openai.AsyncOpenAI,
                                                                     stream: bool) -> None:
    async def rollout() -> None:
        prompt = engine.tokenizer.encode("Two plus two", add_special_tokens=False)
        for _ in range(2):
            if stream:
                chunks = [c async for c in await client.completions.create(model="agent", prompt=prompt,
                                                                            max_tokens=40, stream=True)]
                sampled = chunks[0].choices[0].model_extra["token_ids"]
            else:
                out = await client.completions.create(model="agent", prompt=prompt, max_tokens=40)
                sampled = out.choices[0].model_extra["token_ids"]
            prompt = prompt + sampled + engine.tokenizer.encode(" And?", add_special_tokens=False)

    trajectory = await art.trajectory(rollout())
    assert [c.streamed for c in trajectory.exchanges] == [stream, stream]
    assert trajectory.exchanges[0].choices[0].message == {"role": "assistant", "content": " is four. Then five."}
    seq = tokenize_trajectory(engine.tokenizer, trajectory, 10_000)
    assert seq.retokenized_choices == 0 and seq.template_fallbacks == 0
    assert [i for i, m in zip(seq.input_ids, seq.assistant_mask, strict=True) if m] == [i for ids in engine.sampled
                                                                                        for i in ids]
