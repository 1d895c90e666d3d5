"""The OpenAI endpoint, driven by the real `openai.AsyncOpenAI` client over loopback.

The tokenizer is a real `PreTrainedTokenizerFast` (byte-level, one token per byte, ChatML template
with tools) built here without downloads. The engine is a scripted fake: it answers with text the
test chooses, so each test knows exactly which ids and logprobs must come back. The real engines
have their own integration tests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from art_nb.local.engines.base import ContextTooLongError, EngineDeadError, EngineError, GenerationRequest, Sample
from art_nb.local.server import InferenceGate, RunningServer, ServedModel, create_app, start_server

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHATML = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'tool' %}[{{ m.tool_call_id }}] {% endif %}{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML,
    )


class ScriptedEngine:
    """Answers sample i with `script(i)` + EOS; logprob of the k-th token is -(k + 1) / 100.

    Like a real engine it ignores stop strings' text (the server applies them) and cuts at
    `max_tokens` with finish_reason "length". `hold` makes generate wait, to test the gate.
    """

    def __init__(self, tokenizer: Any, max_context: int = 512) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.reset()

    def reset(self) -> None:
        self.script: Callable[[int], str] = lambda i: f"answer {i}"
        self.requests: list[GenerationRequest] = []
        self.fail_with: Exception | None = None
        self.hold: asyncio.Event | None = None
        self.entered = asyncio.Event()

    async def generate(self, request: GenerationRequest) -> list[Sample]:
        self.requests.append(request)
        self.entered.set()
        if self.hold is not None:
            await self.hold.wait()
        if self.fail_with is not None:
            raise self.fail_with
        samples = []
        for i in range(request.params.n):
            ids = self.tokenizer.encode(self.script(i), add_special_tokens=False) + [self.tokenizer.eos_token_id]
            finish = "stop"
            if len(ids) > request.params.max_tokens:
                ids, finish = ids[: request.params.max_tokens], "length"
            logprobs = [-(k + 1) / 100 for k in range(len(ids))]
            top = None
            if request.params.top_logprobs:  # the sampled token first, then the next ids, each 1 nat less likely
                top = [[(t + j, lp - j) for j in range(request.params.top_logprobs)] for t, lp in zip(ids, logprobs)]
            samples.append(Sample(ids, logprobs, finish, top_logprobs=top))
        return samples

    async def load_adapter(self, name: str, path: Path) -> None: ...
    async def unload_adapter(self, name: str) -> None: ...
    async def sleep(self) -> None: ...
    async def wake(self) -> None: ...
    async def close(self) -> None: ...


class Registry:
    """"agent" serves the latest adapter; "agent@3" a pinned one."""

    def __init__(self, engine: ScriptedEngine) -> None:
        self.engine = engine
        self.latest = "agent@3"

    def resolve(self, model_name: str) -> ServedModel:
        if model_name == "agent":
            return ServedModel(self.engine, self.latest, "agent")
        if model_name in ("agent@3", "agent@4"):
            return ServedModel(self.engine, model_name, model_name)
        raise KeyError(model_name)

    def list_models(self) -> list[str]:
        return ["agent", "agent@3"]


class Harness:
    def __init__(self, engine: ScriptedEngine, registry: Registry, gate: InferenceGate, server: RunningServer,
                 transport: str = "http"):
        self.engine, self.registry, self.gate, self.server = engine, registry, gate, server
        # "inprocess": what model.openai_client() uses for a LocalBackend in this process (server/inprocess.py)
        extra = {"http_client": server.in_process_http_client()} if transport == "inprocess" else {}
        self.client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, **extra)


async def _serve(tokenizer: Any, api_key: str | None = None, transport: str = "http") -> Harness:
    engine = ScriptedEngine(tokenizer)
    registry, gate = Registry(engine), InferenceGate()
    server = await start_server(create_app(registry, gate, api_key=api_key))
    return Harness(engine, registry, gate, server, transport)


@pytest_asyncio.fixture(loop_scope="session", scope="module", params=["http", "inprocess"])
async def _shared(tokenizer: Any, request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    harness = await _serve(tokenizer, transport=request.param)
    yield harness
    await harness.client.close()
    await harness.server.stop()


@pytest.fixture
def h(_shared: Harness) -> Harness:
    """The module's server with a fresh engine script, request log and an open gate."""
    _shared.engine.reset()
    _shared.registry.latest = "agent@3"
    _shared.gate.resume()
    return _shared


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


async def test_lists_models(h: Harness) -> None:
    page = await h.client.models.list()
    assert [m.id for m in page.data] == ["agent", "agent@3"]
    assert h.server.base_url.startswith("http://127.0.0.1:") and h.server.base_url.endswith("/v1")


async def test_n_choices_carry_token_ids_and_logprobs(h: Harness, tokenizer: Any) -> None:
    out = await h.client.chat.completions.create(
        model="agent", messages=_user("hi"), n=3, logprobs=True, top_logprobs=0, temperature=0.7, top_p=0.9, seed=5
    )
    assert out.model == "agent"
    assert len(out.choices) == 3
    for i, choice in enumerate(out.choices):
        assert choice.index == i
        assert choice.message.role == "assistant"
        assert choice.message.content == f"answer {i}"
        assert choice.finish_reason == "stop"
        ids = choice.model_extra["token_ids"]
        assert ids == tokenizer.encode(f"answer {i}", add_special_tokens=False) + [tokenizer.eos_token_id]
        assert [t.logprob for t in choice.logprobs.content] == [-(k + 1) / 100 for k in range(len(ids))]
        assert "".join(t.token for t in choice.logprobs.content[:-1]) == f"answer {i}"
        assert all(t.top_logprobs == [] for t in choice.logprobs.content)
    assert out.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in out.choices)
    prompt_ids = out.model_extra["prompt_token_ids"]
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert tokenizer.decode(prompt_ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    (request,) = h.engine.requests
    assert request.prompt_ids == prompt_ids
    assert request.adapter == "agent@3"
    p = request.params
    assert (p.n, p.temperature, p.top_p, p.seed) == (3, 0.7, 0.9, 5)
    assert p.max_tokens == h.engine.max_context - len(prompt_ids)  # default: the rest of the context


async def test_top_logprobs_name_each_alternative_and_follow_the_stop_cut(h: Harness, tokenizer: Any) -> None:
    h.engine.script = lambda i: "yes. and more"
    out = await h.client.chat.completions.create(model="agent", messages=_user("hi"), logprobs=True, top_logprobs=3,
                                                 stop=["."])
    (request,) = h.engine.requests
    assert request.params.top_logprobs == 3
    choice = out.choices[0]
    assert choice.message.content == "yes"
    kept = choice.model_extra["token_ids"]
    assert len(choice.logprobs.content) == len(kept)  # cut where the stop string completes, alternatives too
    for k, (entry, token_id) in enumerate(zip(choice.logprobs.content, kept)):
        alternatives = entry.top_logprobs
        assert [a.logprob for a in alternatives] == [-(k + 1) / 100 - j for j in range(3)]
        assert [a.token for a in alternatives] == [tokenizer.decode([token_id + j]) for j in range(3)]
        assert alternatives[0].token == entry.token and alternatives[0].bytes == list(entry.token.encode())

    stream = await h.client.chat.completions.create(model="agent", messages=_user("hi"), logprobs=True, top_logprobs=2,
                                                    stream=True)
    streamed = [entry async for chunk in stream for c in chunk.choices if c.logprobs for entry in c.logprobs.content]
    assert streamed and all(len(entry.top_logprobs) == 2 for entry in streamed)


async def test_plain_text_format_and_an_empty_logit_bias_are_accepted(h: Harness) -> None:
    out = await h.client.chat.completions.create(model="agent", messages=_user("hi"), response_format={"type": "text"},
                                                 logit_bias={"42": 0})
    assert out.choices[0].message.content == "answer 0"


async def test_logprobs_absent_unless_requested_and_temperature_zero_passed(h: Harness) -> None:
    out = await h.client.chat.completions.create(model="agent@3", messages=_user("hi"), temperature=0)
    assert out.choices[0].logprobs is None
    assert out.choices[0].model_extra["token_ids"]
    assert h.engine.requests[0].params.temperature == 0.0


async def test_stop_string_cuts_content_but_keeps_sampled_ids(h: Harness, tokenizer: Any) -> None:
    h.engine.script = lambda i: "héllo wörld. Goodbye"
    out = await h.client.chat.completions.create(
        model="agent", messages=_user("hi"), stop=["wörld", "Good"], logprobs=True, max_tokens=100
    )
    choice = out.choices[0]
    assert choice.message.content == "héllo "
    assert choice.finish_reason == "stop"
    ids = choice.model_extra["token_ids"]
    # Up to and including the token that completed "wörld" (ö is two byte tokens), nothing after.
    assert tokenizer.decode(ids) == "héllo wörld"
    assert len(choice.logprobs.content) == len(ids)
    assert out.usage.completion_tokens == len(ids)
    assert h.engine.requests[0].params.stop == ("wörld", "Good")


async def test_stop_as_a_single_string(h: Harness) -> None:
    h.engine.script = lambda i: "one, two, three"
    out = await h.client.chat.completions.create(model="agent", messages=_user("count"), stop=", th")
    assert out.choices[0].message.content == "one, two"
    assert out.choices[0].finish_reason == "stop"


async def test_max_tokens_finishes_with_length(h: Harness, tokenizer: Any) -> None:
    h.engine.script = lambda i: "a long answer"
    out = await h.client.chat.completions.create(model="agent", messages=_user("hi"), max_tokens=3)
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content == "a l"
    assert len(out.choices[0].model_extra["token_ids"]) == 3
    assert out.usage.completion_tokens == 3
    out = await h.client.chat.completions.create(model="agent", messages=_user("hi"), max_completion_tokens=2)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 2


async def test_unknown_model_is_404(h: Harness) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await h.client.chat.completions.create(model="nope", messages=_user("hi"))
    assert caught.value.code == "model_not_found"
    assert caught.value.type == "invalid_request_error"
    assert "nope" in caught.value.message


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"n": 0}, "n"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs=true, as OpenAI
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logit_bias": {"42": 5}}, "logit_bias"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "response_format.json_schema.schema"),  # a schema llguidance cannot compile is refused, not ignored
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}},
          "tools": [{"type": "function", "function": {"name": "add"}}]}, "tool_choice"),
        ({"stop": [""]}, "stop"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user"}]}, "messages.0"),  # no content (a tool result may lack its call id)
    ],
)
async def test_bad_field_values_are_400_naming_the_field(h: Harness, kwargs: dict, param: str) -> None:
    args = {"model": "agent", "messages": _user("hi"), **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        await h.client.chat.completions.create(**args)
    assert caught.value.param == param
    assert param in caught.value.message
    assert h.engine.requests == []


async def test_missing_messages_and_bad_json_are_400(h: Harness) -> None:
    async with httpx.AsyncClient(base_url=h.server.base_url) as http:
        r = await http.post("/chat/completions", json={"model": "agent"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "messages"
        assert "Field required" in r.json()["error"]["message"]
        r = await http.post("/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = await http.get("/nowhere")
        assert r.status_code == 404 and r.json()["error"]["message"]


async def test_context_too_long_is_400(h: Harness) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await h.client.chat.completions.create(model="agent", messages=_user("x" * 600))
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:  # prompt fits, prompt + max_tokens does not
        await h.client.chat.completions.create(model="agent", messages=_user("hi"), max_tokens=500)
    assert caught.value.code == "context_length_exceeded"
    assert h.engine.requests == []
    h.engine.fail_with = ContextTooLongError("engine says too long")  # the engine's own check
    with pytest.raises(openai.BadRequestError) as caught:
        await h.client.chat.completions.create(model="agent", messages=_user("hi"))
    assert caught.value.code == "context_length_exceeded"


async def test_engine_errors_map_to_503_and_500(h: Harness) -> None:
    h.engine.fail_with = EngineDeadError("engine died")
    with pytest.raises(openai.InternalServerError) as caught:
        await h.client.chat.completions.create(model="agent", messages=_user("hi"))
    assert caught.value.status_code == 503 and "engine died" in caught.value.message
    h.engine.fail_with = EngineError("bad adapter")
    with pytest.raises(openai.InternalServerError) as caught:
        await h.client.chat.completions.create(model="agent", messages=_user("hi"))
    assert caught.value.status_code == 500
    assert h.gate.in_flight == 0  # failures leave the gate balanced


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]


async def test_tool_calls_are_parsed(h: Harness, tokenizer: Any) -> None:
    h.engine.script = lambda i: 'Adding.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    out = await h.client.chat.completions.create(model="agent", messages=_user("2+3?"), tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Adding."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    # The tools reached the template, and the ids still hold the call as sampled.
    assert '"name": "add"' in tokenizer.decode(out.model_extra["prompt_token_ids"])
    assert "<tool_call>" in tokenizer.decode(choice.model_extra["token_ids"])


async def test_tool_choice_none_hides_tools_and_parses_nothing(h: Harness, tokenizer: Any) -> None:
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    h.engine.script = lambda i: text
    out = await h.client.chat.completions.create(
        model="agent", messages=_user("hi"), tools=TOOLS, tool_choice="none"
    )
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content == text
    assert "Tools:" not in tokenizer.decode(out.model_extra["prompt_token_ids"])


async def test_conversation_with_tool_results_is_rendered(h: Harness, tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "2+3?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    h.engine.script = lambda i: "It is 5."
    out = await h.client.chat.completions.create(model="agent", messages=messages, tools=TOOLS)
    assert out.choices[0].message.content == "It is 5."
    assert out.choices[0].finish_reason == "stop"
    prompt = tokenizer.decode(out.model_extra["prompt_token_ids"])
    # Arguments reach the template as an object (rendered once as JSON, not as a quoted string).
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in prompt
    assert "<|im_start|>tool\n[call_1] 5<|im_end|>" in prompt
    assert "<|im_start|>user\n2+3?<|im_end|>" in prompt


async def test_a_tool_message_without_tool_call_id_is_served(h: Harness, tokenizer: Any) -> None:
    """As vLLM (ART's server) takes it: the id is optional, the template shows the result's content."""
    messages = [{"role": "user", "content": "2+3?"}, {"role": "tool", "content": "5"}]
    h.engine.script = lambda i: "It is 5."
    out = await h.client.chat.completions.create(model="agent", messages=messages)
    assert out.choices[0].message.content == "It is 5."
    assert "5<|im_end|>" in tokenizer.decode(out.model_extra["prompt_token_ids"])


class AsyncRegistry(Registry):
    """A registry whose resolve is a coroutine (the local backend loads old adapters lazily)."""

    async def resolve(self, model_name: str) -> ServedModel:  # type: ignore[override]
        await asyncio.sleep(0)
        return super().resolve(model_name)


async def test_async_registry_is_awaited(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer)
    server = await start_server(create_app(AsyncRegistry(engine), InferenceGate()))
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    try:
        out = await client.chat.completions.create(model="agent@4", messages=_user("hi"))
        assert out.model == "agent@4" and engine.requests[0].adapter == "agent@4"
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="agent@9", messages=_user("hi"))
    finally:
        await client.close()
        await server.stop()


async def test_api_key_required_when_set(tokenizer: Any) -> None:
    harness = await _serve(tokenizer, api_key="s3cret")
    try:
        wrong = openai.AsyncOpenAI(base_url=harness.server.base_url, api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(model="agent", messages=_user("hi"))
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()
        async with httpx.AsyncClient() as http:  # no header at all
            assert (await http.get(f"{harness.server.base_url}/models")).status_code == 401
        right = openai.AsyncOpenAI(base_url=harness.server.base_url, api_key="s3cret", max_retries=0)
        out = await right.chat.completions.create(model="agent", messages=_user("hi"))
        assert out.choices[0].message.content == "answer 0"
        await wrong.close()
        await right.close()
    finally:
        await harness.client.close()
        await harness.server.stop()


async def test_request_made_while_paused_waits_then_gets_new_weights(h: Harness) -> None:
    await h.gate.pause()
    assert h.gate.paused
    pending = asyncio.create_task(h.client.chat.completions.create(model="agent", messages=_user("hi")))
    await asyncio.sleep(0.3)
    assert not pending.done()
    assert h.engine.requests == []
    h.registry.latest = "agent@4"  # what a train step does before resuming
    h.gate.resume()
    out = await asyncio.wait_for(pending, 5)
    assert out.choices[0].message.content == "answer 0"
    assert h.engine.requests[0].adapter == "agent@4"


async def test_pause_waits_for_in_flight_requests(h: Harness) -> None:
    h.engine.hold = asyncio.Event()
    request = asyncio.create_task(h.client.chat.completions.create(model="agent", messages=_user("hi")))
    await asyncio.wait_for(h.engine.entered.wait(), 5)
    assert h.gate.in_flight == 1
    pause = asyncio.create_task(h.gate.pause())
    await asyncio.sleep(0.2)
    assert not pause.done()  # still draining
    h.engine.hold.set()
    await asyncio.wait_for(pause, 5)
    assert h.gate.in_flight == 0
    out = await asyncio.wait_for(request, 5)  # the in-flight request completed normally
    assert out.choices[0].finish_reason == "stop"
    h.gate.resume()


async def test_gate_never_admits_a_request_after_pause_even_if_woken_early() -> None:
    gate = InferenceGate()
    await gate.pause()
    entered = asyncio.Event()

    async def request() -> None:
        async with gate.serving():
            entered.set()

    task = asyncio.create_task(request())
    await asyncio.sleep(0)
    gate.resume()
    await gate.pause()  # paused again before the waiter got to run
    await asyncio.sleep(0.05)
    assert not entered.is_set() and gate.in_flight == 0
    gate.resume()
    await asyncio.wait_for(task, 1)
    assert entered.is_set()


async def test_stop_is_idempotent_and_frees_the_port(tokenizer: Any) -> None:
    harness = await _serve(tokenizer)
    port = harness.server.port
    await harness.client.close()
    await harness.server.stop()
    await harness.server.stop()
    async with httpx.AsyncClient() as http:
        with pytest.raises(httpx.ConnectError):
            await http.get(f"http://127.0.0.1:{port}/v1/models")
