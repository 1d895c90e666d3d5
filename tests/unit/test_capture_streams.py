"""Streams a client abandons are recorded whole, every time: a stream worth recording (its first
event carries `prompt_token_ids`) is read to its end before the client gets its first chunk, so
reading one chunk and closing, or dropping the stream unclosed, leaves the whole sample recorded
whatever way the transport split the body. Other streams pass through as they come. Same scripted
server as tests/unit/test_capture.py; a long answer makes the body span many transport reads.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import requests

import art_nb as art
from tests.unit import test_capture
from tests.unit.test_capture import KEY

pytestmark = pytest.mark.asyncio(loop_scope="module")
server, srv = test_capture.server, test_capture.srv  # its scripted server, as fixtures here
LONG = "word " * 3000  # ~100 kB of events with the token ids and logprobs: many reads on any transport


def recorded_whole(t: art.Trajectory, srv: Any) -> None:
    assert len(t.exchanges) == 1
    choice = t.exchanges[0].choices[0]
    assert choice.token_ids == srv.engines["agent"].sampled[-1] and choice.message["content"] == LONG
    assert choice.logprobs == [-(k + 1) / 100 for k in range(len(choice.token_ids))]


@pytest.mark.parametrize("attempt", range(3))
@pytest.mark.parametrize("ending", ["close", "drop", "keep"])
async def test_an_sdk_stream_read_for_one_chunk_is_recorded_whole(srv: Any, ending: str, attempt: int) -> None:
    srv.engines["agent"].script = lambda prompt: LONG
    client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0)
    kept = []

    async def rollout() -> None:
        stream = await client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "hi"}],
                                                      stream=True)
        async for _ in stream:
            break
        if ending == "close":
            await stream.close()
        elif ending == "keep":
            kept.append(stream)  # neither read on nor closed while the trajectory closes

    t = await art.trajectory(rollout())
    recorded_whole(t, srv)
    await client.close()


async def test_sync_sdk_and_requests_streams_read_for_one_chunk_are_recorded_whole(srv: Any) -> None:
    srv.engines["agent"].script = lambda prompt: LONG
    body = {"model": "agent", "messages": [{"role": "user", "content": "hi"}], "stream": True}

    def sdk() -> None:
        with openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0) as client:
            stream = client.chat.completions.create(**body)
            next(iter(stream))
            stream.close()

    def plain_requests() -> None:
        response = requests.post(f"{srv.base_url}/chat/completions", json=body, stream=True, timeout=30,
                                 headers={"Authorization": f"Bearer {KEY}"})
        assert next(response.iter_lines()).startswith(b"data: ")
        response.close()

    for blocking in (sdk, plain_requests):
        t = await art.trajectory(asyncio.to_thread(blocking))
        recorded_whole(t, srv)


async def test_a_raw_httpx_stream_left_after_its_first_bytes_is_recorded_whole(srv: Any) -> None:
    srv.engines["agent"].script = lambda prompt: LONG

    async def rollout() -> None:
        async with httpx.AsyncClient(base_url=srv.base_url, headers={"Authorization": f"Bearer {KEY}"}) as http:
            body = {"model": "agent", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            async with http.stream("POST", "/chat/completions", json=body) as response:
                async for chunk in response.aiter_raw():  # not decoded: below the hook, passes untouched
                    break
            async with http.stream("POST", "/chat/completions", json=body) as response:
                async for chunk in response.aiter_bytes(16):
                    assert chunk.startswith(b"data: ") and len(chunk) == 16  # the client's own chunking stays
                    break

    t = await art.trajectory(rollout())
    assert len(t.exchanges) == 1  # the aiter_bytes one; aiter_raw is not read through the hooks
    recorded_whole(t, srv)


def scripted_stream(events: list[bytes], gate: asyncio.Event | None = None, fail_after: int | None = None
                    ) -> httpx.MockTransport:
    """A transport answering every request with `events`, one per read; it waits for `gate` after the
    first, and raises `httpx.ReadError` after `fail_after` of them."""
    class Body(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            for k, event in enumerate(events):
                if fail_after is not None and k == fail_after:
                    raise httpx.ReadError("connection lost")
                yield event
                if gate is not None and k == 0:
                    await asyncio.wait_for(gate.wait(), 10)

    return httpx.MockTransport(lambda request: httpx.Response(200, stream=Body(),
                                                              headers={"content-type": "text/event-stream"}))


def event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def test_a_stream_without_token_ids_passes_through_as_it_comes() -> None:
    first_seen = asyncio.Event()
    transport = scripted_stream([event({"choices": [{"index": 0, "delta": {"content": "a"}}]}),
                                 event({"choices": [{"index": 0, "delta": {"content": "b"}}]}), b"data: [DONE]\n\n"],
                                gate=first_seen)

    async def rollout() -> list[bytes]:
        async with httpx.AsyncClient(transport=transport) as http:
            async with http.stream("POST", "http://other/v1/chat/completions", json={"messages": []}) as response:
                chunks = []
                async for chunk in response.aiter_bytes():
                    chunks.append(chunk)
                    first_seen.set()  # the transport sends the rest only now: a held stream would never get here
                return chunks

    with art.Trajectory() as t:
        chunks = await rollout()
    assert len(chunks) == 3 and t.exchanges == []


async def test_a_transport_error_while_reading_ahead_reaches_the_client_after_what_was_read() -> None:
    first = event({"id": "x", "model": "agent", "prompt_token_ids": [1, 2],
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    second = event({"id": "x", "model": "agent", "choices": [{"index": 0, "delta": {"content": "hi"},
                                                               "token_ids": [3], "token_logprobs": [-0.5]}]})
    transport = scripted_stream([first, second, b"data: [DONE]\n\n"], fail_after=2)
    received: list[bytes] = []
    with art.Trajectory() as t:
        async with httpx.AsyncClient(transport=transport) as http:
            async with http.stream("POST", "http://x/v1/chat/completions", json={"messages": []}) as response:
                with pytest.raises(httpx.ReadError, match="connection lost"):
                    async for chunk in response.aiter_bytes():
                        received.append(chunk)
    assert received == [first, second] and t.exchanges == []  # cut short: nothing to train on
