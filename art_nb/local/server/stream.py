"""`stream=True` for POST /v1/chat/completions: a finished completion body as server-sent events.

The engine protocol returns whole samples, so a streamed answer is sent once it is generated, as
the chunks an OpenAI client expects (`chat.completion.chunk`): per choice one chunk with the role,
one with the content (or tool calls) and its logprobs, one with the finish reason; a usage chunk
when `stream_options.include_usage` asks for it; then `data: [DONE]`. What a streaming client
gets is therefore exactly what the non-streaming body holds, and so is what training sees.

Token ids travel as vLLM sends them when asked to return token ids: `prompt_token_ids` on the
first chunk, and each choice's sampled `token_ids` (and art_nb's `token_logprobs`) on the chunk
that carries its content. Capture (`art_nb.capture`) reads them from there.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["sse_events", "stream_chunks"]


def stream_chunks(body: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` objects that stream `body`, a finished ChatCompletion body."""
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}
    chunks: list[dict[str, Any]] = [{
        **base, "prompt_token_ids": body["prompt_token_ids"],
        "choices": [{"index": c["index"], "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None} for c in body["choices"]],
    }]
    for choice in body["choices"]:
        message = choice["message"]
        delta: dict[str, Any] = {"content": message.get("content")}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        chunks.append({**base, "choices": [{
            "index": choice["index"], "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None,
            "token_ids": choice["token_ids"], "token_logprobs": choice["token_logprobs"],
        }]})
        chunks.append({**base, "choices": [{"index": choice["index"], "delta": {}, "logprobs": None,
                                            "finish_reason": choice["finish_reason"]}]})
    if include_usage:
        chunks.append({**base, "choices": [], "usage": body["usage"]})
    return chunks


async def sse_events(chunks: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Server-sent events for `chunks`, ended by the `[DONE]` sentinel OpenAI clients wait for.

    All in one write, since the answer is complete: Starlette runs a synchronous iterator's every
    step in a worker thread, and each hop (and each write) cost the endpoint's thread the GIL."""
    events = [b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n" for chunk in chunks]
    yield b"".join(events) + b"data: [DONE]\n\n"
