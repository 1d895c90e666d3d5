"""The per-request shortcuts of art_nb.local.server.pipeline and stream keep what a response says."""

from __future__ import annotations

import asyncio
import json
import math

from art_nb.local.engines.base import Sample
from art_nb.local.server.pipeline import _clamped, completion
from art_nb.local.server.schema import ChatCompletionRequest
from art_nb.local.server.stream import sse_events, stream_chunks


def test_logprobs_are_clamped_only_when_one_is_below_the_floor() -> None:
    usual = [-0.1, -2.5, -9999.0]
    assert _clamped(usual) is usual  # nothing to raise: no copy
    assert _clamped([-0.1, -math.inf, -1e6]) == [-0.1, -9999.0, -9999.0]
    assert _clamped([]) == []


def test_response_ids_differ_and_keep_openais_prefix(chatml_tokenizer) -> None:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    ids = chatml_tokenizer.encode("ok", add_special_tokens=False)
    sample = Sample(ids, [-0.5] * len(ids), "stop")
    bodies = [completion("m", [1, 2], [sample], req, chatml_tokenizer) for _ in range(3)]
    assert len({b["id"] for b in bodies}) == 3
    assert all(b["id"].startswith("chatcmpl-") for b in bodies)
    assert bodies[0]["choices"][0]["token_logprobs"] == [-0.5] * len(ids)


def test_sse_events_are_one_write_of_every_chunk_then_done(chatml_tokenizer) -> None:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                "stream": True})
    ids = chatml_tokenizer.encode("ok", add_special_tokens=False)
    body = completion("m", [1, 2], [Sample(ids, [-0.5] * len(ids), "stop")], req, chatml_tokenizer)
    chunks = stream_chunks(body, include_usage=True)

    async def collect() -> list[bytes]:
        return [part async for part in sse_events(chunks)]

    parts = asyncio.run(collect())
    assert len(parts) == 1
    events = parts[0].decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert [json.loads(e.removeprefix("data: ")) for e in events[:-2]] == chunks
