"""`model.openai_client()`'s chat completions send the same request body as the SDK's own `AsyncOpenAI`
(art_nb/chat_client.py), byte for byte, for the requests agents make: pydantic messages from an earlier
reply, tool calls and results, tools with JSON schemas, content parts, tuples and generators, a caller's
own `extra_body`, streaming, the raw-response wrapper."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

openai = pytest.importorskip("openai")

from openai.types.chat import ChatCompletionMessage  # noqa: E402

from art_nb.chat_client import chat_client_class  # noqa: E402

REPLY = {"id": "c1", "object": "chat.completion", "created": 0, "model": "m", "choices": [
    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}]}


def _http_module() -> Any:
    """The httpx the installed SDK builds its requests with (openai 3 uses httpx2)."""
    import openai._base_client as base

    return base.httpx2 if hasattr(base, "httpx2") else base.httpx


def _client(cls: type, bodies: list[bytes]) -> Any:
    http = _http_module()

    def answer(request: Any) -> Any:
        bodies.append(request.read())
        if json.loads(request.content).get("stream"):
            return http.Response(200, content=b"data: [DONE]\n\n", headers={"content-type": "text/event-stream"})
        return http.Response(200, json=REPLY)

    return cls(base_url="http://art-nb.test/v1", api_key="none", max_retries=0,
               http_client=http.AsyncClient(transport=http.MockTransport(answer)))


def _earlier_reply() -> ChatCompletionMessage:
    return ChatCompletionMessage.model_validate({
        "role": "assistant", "content": None, "refusal": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "Paris"}'}}]})


TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a city up.", "strict": True,
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                                                          "required": ["q"], "additionalProperties": False}}}]


def _requests() -> list[dict[str, Any]]:
    system = {"role": "system", "content": "You answer with a lookup."}
    user = {"role": "user", "content": "Where is the Louvre?"}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "Paris, France"}
    return [
        {"model": "m", "messages": [system, user], "max_tokens": 64, "logprobs": True, "temperature": 1.0},
        {"model": "m@3", "messages": [system, user, _earlier_reply(), result], "tools": TOOLS, "tool_choice": "auto",
         "parallel_tool_calls": False},
        {"model": "m", "messages": (system, {"role": "user", "content": [{"type": "text", "text": "Where?"},
                                                                         {"type": "text", "text": "The Louvre."}]})},
        {"model": "m", "messages": [user], "response_format": {
            "type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True}},
         "extra_body": {"top_k": 5, "chat_template_kwargs": {"enable_thinking": False}}},
        {"model": "m", "messages": [user], "extra_body": {"messages": [system]}},  # the caller's extra_body wins
        {"model": "m", "messages": [user], "stream": True, "stream_options": {"include_usage": True}},
        {"model": "m", "messages": lambda: (m for m in [system, user]), "tools": lambda: iter(TOOLS)},
    ]


async def _send(client: Any, request: dict[str, Any], raw: bool = False) -> None:
    request = {key: value() if callable(value) else value for key, value in request.items()}
    completions = client.chat.with_raw_response.completions if raw else client.chat.completions
    reply = await completions.create(**request)
    if request.get("stream") and not raw:  # the raw wrapper's reply is the HTTP response, already sent
        async for _ in reply:
            pass


def _bodies(cls: type, send: Callable[[Any, dict[str, Any]], Any]) -> list[bytes]:
    bodies: list[bytes] = []

    async def run() -> None:
        client = _client(cls, bodies)
        for request in _requests():
            await send(client, request)
        await client.close()

    asyncio.run(run())
    return bodies


def test_the_same_bytes_reach_the_server_as_from_the_sdks_own_client() -> None:
    ours = _bodies(chat_client_class(), _send)
    theirs = _bodies(openai.AsyncOpenAI, _send)
    assert len(ours) == len(theirs) == len(_requests())
    for mine, sdk in zip(ours, theirs, strict=True):
        assert mine == sdk
    assert json.loads(ours[1])["messages"][2] == {
        "role": "assistant", "content": None, "refusal": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "Paris"}'}}]}
    assert json.loads(ours[4])["messages"] == [{"role": "system", "content": "You answer with a lookup."}]


def test_the_sdks_walk_sees_no_messages_also_through_the_raw_wrapper_and_copies(monkeypatch) -> None:
    import sys

    from openai.resources.chat import AsyncCompletions

    sdk = sys.modules[AsyncCompletions.__module__]  # where `create` looks the transform up (its path moved in openai 2)

    walked: list[Any] = []
    real = sdk.async_maybe_transform

    async def recording(data: Any, expected_type: Any) -> Any:
        walked.append(data.get("messages"))
        return await real(data, expected_type)

    monkeypatch.setattr(sdk, "async_maybe_transform", recording)
    raw = _bodies(chat_client_class(), lambda client, request: _send(client, request, raw=True))
    assert walked == [[]] * len(_requests())  # the SDK's transform walked empty lists in their place
    walked.clear()
    assert raw == _bodies(openai.AsyncOpenAI, lambda client, request: _send(client, request, raw=True))
    assert all(messages for messages in walked)
    client = _client(chat_client_class(), [])
    copy = client.with_options(timeout=5.0)
    assert type(copy) is chat_client_class() and type(copy.chat.completions).__name__ == "ChatCompletions"


def test_model_openai_client_is_the_light_client() -> None:
    import art_nb as art

    model = art.Model(name="gpt-x", project="p", inference_base_url="http://art-nb.test/v1", inference_api_key="k")
    client = model.openai_client()
    assert isinstance(client, openai.AsyncOpenAI) and type(client) is chat_client_class()
