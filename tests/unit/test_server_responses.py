"""POST /v1/responses, driven by the openai SDK's own client (its stream parser and its stream helper
included) against a real art_nb server over a scripted engine (the in-process ChatML tokenizer, no
weights): every field parses in the SDK's types, the stream is the Responses API's event sequence,
what cannot be honoured is a 400 naming it, a multi-turn tool agent's prompts are append-only
(its sampled turns come back as the sampled ids, through `previous_response_id` too), and
`art.trajectory` captures the calls and trains on exactly the sampled ids.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

import art_nb as art
from art_nb.capture.pending import Pending
from art_nb.grpo.tokens import tokenize_trajectory
from art_nb.local.engines.base import GenerationRequest, Sample
from art_nb.local.server import InferenceGate, ServedModel, create_app, start_server
from tests.conftest import build_chatml_tokenizer, char_ids

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOOLS = [{"type": "function", "name": "weather", "description": "The weather in a city", "strict": True,
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                         "additionalProperties": False}}]
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
EVENTS = TypeAdapter(ResponseStreamEvent)


def tool_agent(prompt: str) -> str:
    """Calls the tool until a tool result is in the prompt, then answers."""
    return "It is 21 C in Paris." if "<|im_start|>tool" in prompt else f"Let me look. {CALL}"


class Engine:
    """Answers `script(prompt text)` + EOS, as canonical ids or (`by_chars`) one id per character;
    the k-th token's logprob is -(k + 1) / 100; cut at max_tokens with "length"."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.max_context = tokenizer, 4096
        self.reset()

    def reset(self) -> None:
        self.script: Callable[[str], str] = tool_agent
        self.by_chars = False
        self.requests: list[GenerationRequest] = []
        self.sampled: list[list[int]] = []

    async def generate(self, request: GenerationRequest) -> list[Sample]:
        self.requests.append(request)
        text = self.script(self.tokenizer.decode(request.prompt_ids))
        body = char_ids(self.tokenizer, text) if self.by_chars else self.tokenizer.encode(text, add_special_tokens=False)
        ids, finish = body + [self.tokenizer.eos_token_id], "stop"
        if len(ids) > request.params.max_tokens:
            ids, finish = ids[: request.params.max_tokens], "length"
        self.sampled.append(ids)
        top = None
        if request.params.top_logprobs:
            top = [[(t, -(k + 1) / 100), (t + 1, -5.0)][: request.params.top_logprobs] for k, t in enumerate(ids)]
        return [Sample(ids, [-(k + 1) / 100 for k in range(len(ids))], finish, top_logprobs=top)]


class Registry:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def resolve(self, name: str) -> ServedModel:
        if name.partition("@")[0] != "agent":
            raise KeyError(name)
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
    server.engine.reset()
    return server.engine


@pytest_asyncio.fixture(loop_scope="module", params=["http", "inprocess"])
async def client(server: Any, request: pytest.FixtureRequest) -> AsyncIterator[openai.AsyncOpenAI]:
    """The SDK's client over a socket, and as `model.openai_client()` makes it for a LocalBackend."""
    extra = {"http_client": server.in_process_http_client()} if request.param == "inprocess" else {}
    c = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, **extra)
    yield c
    await c.close()


async def _raw(server: Any, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.base_url) as http:
        return await http.post("/responses", json=body)


async def test_a_response_parses_in_the_sdk_types_with_its_ids_and_logprobs(server: Any, engine: Engine,
                                                                            client: openai.AsyncOpenAI) -> None:
    body = {"model": "agent", "instructions": "Be brief.", "input": "Weather in Paris?", "tools": TOOLS,
            "include": ["message.output_text.logprobs"], "top_logprobs": 2, "temperature": 0.5, "metadata": {"k": "v"}}
    raw = await _raw(server, body)
    parsed = Response.model_validate(raw.json())  # validated, not constructed: every field has the SDK's type
    (request,) = engine.requests[-1:]
    assert parsed.status == "completed" and parsed.model == "agent" and parsed.metadata == {"k": "v"}
    message, call = parsed.output
    assert message.type == "message" and message.content[0].text == "Let me look."
    assert call.type == "function_call" and call.name == "weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and parsed.id.startswith("resp_")
    extra = parsed.model_extra
    assert extra["prompt_token_ids"] == request.prompt_ids
    assert extra["token_ids"] == engine.sampled[-1]
    assert extra["token_logprobs"] == [-(k + 1) / 100 for k in range(len(engine.sampled[-1]))]
    logprobs = message.content[0].logprobs
    assert [lp.logprob for lp in logprobs] == extra["token_logprobs"]  # every sampled token, call markup included
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert parsed.usage.input_tokens == len(request.prompt_ids) and parsed.usage.output_tokens == len(extra["token_ids"])
    shown = engine.tokenizer.decode(request.prompt_ids)
    assert shown.startswith("<|im_start|>system\nBe brief.") and '"name": "weather"' in shown
    assert request.params.temperature == 0.5 and request.params.top_logprobs == 2

    sdk = await client.responses.create(model="agent", input="Weather in Paris?", tools=TOOLS)
    assert sdk.output_text == "Let me look." and sdk.output[1].arguments == call.arguments
    assert sdk.output[0].content[0].logprobs == []  # not asked for


async def test_the_stream_is_the_responses_event_sequence(server: Any, engine: Engine, client: openai.AsyncOpenAI) -> None:
    body = {"model": "agent", "input": "Weather in Paris?", "tools": TOOLS, "stream": True,
            "include": ["message.output_text.logprobs"]}
    raw = await _raw(server, body)
    assert raw.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in raw.text.split("\n\n") if b]
    events = []
    for block in blocks:
        name, data = block.split("\n")
        event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))  # each event in the SDK's types
        assert name == f"event: {event.type}"
        events.append(event)
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert events[0].response.model_extra["prompt_token_ids"] == final.model_extra["prompt_token_ids"]
    assert final.model_extra["token_ids"] == engine.sampled[-1]
    assert events[4].delta == final.output[0].content[0].text == "Let me look."
    assert [lp.logprob for lp in events[4].logprobs] == final.model_extra["token_logprobs"]
    assert events[9].delta == events[10].arguments == final.output[1].arguments
    assert events[2].item.id == events[7].item.id == final.output[0].id

    # The SDK's client parses it, and its stream helper rebuilds the response from the deltas alone
    seen = [e.type async for e in await client.responses.create(model="agent", input="Weather?", tools=TOOLS,
                                                                 stream=True)]
    assert seen == [e.type for e in events]
    async with client.responses.stream(model="agent", input="Weather?", tools=TOOLS) as stream:
        rebuilt = await stream.get_final_response()
    assert rebuilt.output_text == "Let me look." and rebuilt.output[1].name == "weather"


async def test_a_reply_cut_at_max_output_tokens_is_incomplete(server: Any, engine: Engine,
                                                             client: openai.AsyncOpenAI) -> None:
    cut = await client.responses.create(model="agent", input="hi", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert len(cut.model_extra["token_ids"]) == 3 and engine.requests[-1].params.max_tokens == 3
    kinds = [e.type async for e in await client.responses.create(model="agent", input="hi", max_output_tokens=3,
                                                                  stream=True)]
    assert kinds[-1] == "response.incomplete"


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
    ({"tools": [TOOLS[0], {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[1].type", "file_search"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type", "code_interpreter"),
    ({"tools": [{"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"}]},
     "tools[0].type", "computer_use_preview"),
    ({"background": True}, "background", "background"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id", "resp_unknown"),
    ({"conversation": "conv_1"}, "conversation", "servers"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "servers"),
    ({"truncation": "auto"}, "truncation", "disabled"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
    ({"text": {"verbosity": "low"}}, "text", "verbosity"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice", "allowed_tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0]", "input_image"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type", "reasoning"),
    ({"input": []}, "input", "at least 1"),
])
async def test_what_cannot_be_honoured_is_a_400_naming_it(client: openai.AsyncOpenAI, extra: dict[str, Any],
                                                          param: str, words: str) -> None:
    body = {"model": "agent", "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(**body)
    assert err.value.param == param and words in err.value.message


async def test_reasoning_off_and_plain_text_format_are_accepted(client: openai.AsyncOpenAI) -> None:
    out = await client.responses.create(model="agent", input="hi", reasoning={"effort": None}, truncation="disabled",
                                        text={"format": {"type": "text"}}, store=False, parallel_tool_calls=True)
    assert out.status == "completed" and out.store is False


async def _two_turns(client: openai.AsyncOpenAI, stream: bool, chain: bool = False) -> list[Response]:
    """A tool agent's two calls, the first turn's output items sent back as the SDK dumps them (or, with
    `chain`, only the tool's result after `previous_response_id`)."""
    items: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    responses = []
    for _ in range(2):
        if stream:
            events = [e async for e in await client.responses.create(
                model="agent", instructions="Use tools.", input=items, tools=TOOLS, stream=True)]
            response = events[-1].response
        else:
            response = await client.responses.create(model="agent", instructions="Use tools.", input=items,
                                                     tools=TOOLS, **({"previous_response_id": responses[-1].id}
                                                                     if chain and responses else {}))
        responses.append(response)
        calls = [item for item in response.output if item.type == "function_call"]
        sent_back = [] if chain else items + [item.model_dump(exclude_unset=True) for item in response.output]
        items = sent_back + [{"type": "function_call_output", "call_id": c.call_id, "output": "21 C"} for c in calls]
    return responses


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_agents_turns_are_append_only_and_captured_exactly(engine: Engine, client: openai.AsyncOpenAI,
                                                                        stream: bool) -> None:
    engine.by_chars = True  # sampled ids the template's rendering would tokenise differently
    trajectory = await art.trajectory(_two_turns(client, stream))
    first, second = engine.requests[-2:]
    assert second.prompt_ids[: len(first.prompt_ids) + len(engine.sampled[-2])] == first.prompt_ids + engine.sampled[-2]
    assert "<|im_start|>tool\n21 C" in engine.tokenizer.decode(second.prompt_ids)
    assert [c.streamed for c in trajectory.exchanges] == [stream, stream]
    assert [c.choices[0].token_ids for c in trajectory.exchanges] == engine.sampled[-2:]
    assert trajectory.exchanges[0].choices[0].finish_reason == "tool_calls"
    assert trajectory.exchanges[0].choices[0].message["tool_calls"][0]["function"]["name"] == "weather"
    seq = tokenize_trajectory(engine.tokenizer, trajectory, 10_000)
    assert seq.retokenized_choices == 0 and seq.template_fallbacks == 0
    assert [i for i, m in zip(seq.input_ids, seq.assistant_mask, strict=True) if m] == [
        i for ids in engine.sampled[-2:] for i in ids]
    trained = [lp for lp, m in zip(seq.engine_logprobs, seq.assistant_mask, strict=True) if m]
    assert trained == [-(k + 1) / 100 for ids in engine.sampled[-2:] for k in range(len(ids))]
    # The conversation a person (or RULER) reads: the Responses input as chat messages, the replies as Choices
    assert [m["role"] for m in trajectory.messages()] == ["system", "user", "assistant", "tool", "assistant"]
    assert trajectory.sampled() == [False, False, True, False, True]
    assert trajectory.messages()[2]["tool_calls"][0]["function"]["name"] == "weather"
    assert trajectory.conversation_tools()[0]["function"]["name"] == "weather"


async def test_previous_response_id_continues_the_stored_conversation(engine: Engine,
                                                                      client: openai.AsyncOpenAI) -> None:
    engine.by_chars = True
    trajectory = await art.trajectory(_two_turns(client, stream=False, chain=True))
    first, second = engine.requests[-2:]
    assert second.prompt_ids[: len(first.prompt_ids) + len(engine.sampled[-2])] == first.prompt_ids + engine.sampled[-2]
    seq = tokenize_trajectory(engine.tokenizer, trajectory, 10_000)
    assert [i for i, m in zip(seq.input_ids, seq.assistant_mask, strict=True) if m] == [
        i for ids in engine.sampled[-2:] for i in ids]

    unstored = await client.responses.create(model="agent", input="hi", store=False)
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(model="agent", input="more", previous_response_id=unstored.id)
    assert err.value.param == "previous_response_id" and "store=false" in err.value.message


async def test_a_stream_that_names_its_events_is_read_ahead_and_recorded_whole() -> None:
    """Capture holds a stream back once its first event carries prompt_token_ids, `event:` line first or not."""
    first = b'event: response.created\ndata: {"type":"response.created","response":{"prompt_token_ids":[1]}}\n\n'
    calls: list[Any] = []
    pending = Pending(calls, {"model": "agent", "input": "hi"}, status=200)
    assert pending.take(first[:3]) == [] and pending.mode == "undecided"  # "eve": too early to tell
    assert pending.take(first[3:]) == [] and pending.mode == "hold"
    done = {"type": "response.completed", "response": {"object": "response", "model": "agent", "status": "completed",
            "output": [], "prompt_token_ids": [1], "token_ids": [5, 2], "token_logprobs": [-0.1, -0.2]}}
    last = b"event: response.completed\ndata: " + json.dumps(done).encode() + b"\n\n"
    assert pending.take(last) == [] and pending.end() == [first[:3], first[3:], last]
    (call,) = calls
    assert call.streamed and call.prompt_token_ids == [1] and call.choices[0].token_ids == [5, 2]
    assert call.choices[0].message == {"role": "assistant", "content": None}
    other = Pending([], {"model": "gpt"})
    assert other.take(b'event: response.created\ndata: {"type":"response.created"}\n\n') != []  # not ours: passes
