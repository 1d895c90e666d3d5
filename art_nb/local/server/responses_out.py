"""A chat completion answered for a Responses request, as OpenAI's `Response` object and, for
`stream=True`, as the Responses API's server-sent events.

The output items: a `message` with one `output_text` part (the reply's text; there is one whenever
the reply has text or calls nothing), then a `function_call` per tool call, in the order the model
wrote them. A reply cut by `max_output_tokens` (or by the context's end) has status "incomplete",
`incomplete_details.reason` "max_output_tokens", as OpenAI answers.

What training needs rides beside OpenAI's fields, as on the chat endpoint: `prompt_token_ids`,
`token_ids` (the sampled ids, EOS included when sampled) and `token_logprobs` on the response object
(in the stream: `prompt_token_ids` already on `response.created`'s, all three on the final one).
`output_text.logprobs` holds every sampled token when `include` asks for
"message.output_text.logprobs" (tool-call markup included, as the chat endpoint's
`logprobs.content` does), else [].

The stream is the finished response sent as OpenAI sends one: response.created,
response.in_progress; per message output_item.added, content_part.added, output_text.delta,
output_text.done, content_part.done, output_item.done; per call output_item.added,
function_call_arguments.delta, function_call_arguments.done, output_item.done; then
response.completed (or response.incomplete). Each event as `event: <type>` and `data: <json>`,
numbered by `sequence_number`; there is no `[DONE]` in this API.
"""

from __future__ import annotations

import itertools
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from .responses import ResponsesRequest

__all__ = ["response_body", "response_events", "sse"]

_PREFIX = secrets.token_hex(8)  # per process; a counter after it (see pipeline's response ids)
_COUNTER = itertools.count()
_TRAINING_FIELDS = ("token_ids", "token_logprobs")


def _new_id(kind: str) -> str:
    return f"{kind}_{_PREFIX}{next(_COUNTER):016x}"


def response_body(chat: dict[str, Any], req: ResponsesRequest) -> dict[str, Any]:
    """The Response for `req` answered by `chat`, a ChatCompletion body with one choice."""
    (choice,) = chat["choices"]
    message, incomplete = choice["message"], choice["finish_reason"] == "length"
    status = "incomplete" if incomplete else "completed"
    output: list[dict[str, Any]] = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        output.append({"id": _new_id("msg"), "type": "message", "role": "assistant", "status": status, "content": [
            {"type": "output_text", "text": message.get("content") or "", "annotations": [], "logprobs": logprobs}]})
    output += [{"id": _new_id("fc"), "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
                "arguments": call["function"]["arguments"], "status": "completed"} for call in calls]
    usage = chat["usage"]
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": _new_id("resp"), "object": "response", "created_at": float(chat["created"]),
        "completed_at": time.time(), "status": status, "background": False, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": chat["model"],
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "reasoning": None, "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p, "top_logprobs": req.top_logprobs or 0,
        "text": {"format": fmt}, "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
        "truncation": "disabled", "metadata": req.metadata or {}, "user": req.user,
        "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]},
        "prompt_token_ids": chat["prompt_token_ids"],
        **{field: choice[field] for field in _TRAINING_FIELDS},
    }


def response_events(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events that stream `body`, a finished Response (module docstring)."""
    started = {k: v for k, v in body.items() if k not in _TRAINING_FIELDS}
    started.update(status="in_progress", output=[], usage=None, incomplete_details=None, completed_at=None)
    events: list[dict[str, Any]] = [{"type": "response.created", "response": started},
                                    {"type": "response.in_progress", "response": started}]
    for index, item in enumerate(body["output"]):
        at = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            (part,) = item["content"]
            deltas = [{k: v for k, v in e.items() if k != "bytes"} for e in part["logprobs"]]
            events += [
                {"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "status": "in_progress", "content": []}},
                {"type": "response.content_part.added", **at, "content_index": 0,
                 "part": {**part, "text": "", "logprobs": []}},
                {"type": "response.output_text.delta", **at, "content_index": 0, "delta": part["text"],
                 "logprobs": deltas},
                {"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"],
                 "logprobs": deltas},
                {"type": "response.content_part.done", **at, "content_index": 0, "part": part},
            ]
        else:
            events += [
                {"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "arguments": "", "status": "in_progress"}},
                {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", **at, "name": item["name"],
                 "arguments": item["arguments"]},
            ]
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": f"response.{body['status']}", "response": body})
    for number, event in enumerate(events):
        event["sequence_number"] = number
    return events


async def sse(events: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    """The events as server-sent events, `event:` line first as OpenAI sends them, in one write (the
    answer is complete; see stream.sse_events)."""
    yield b"".join(f"event: {e['type']}\n".encode() + b"data: " + json.dumps(e, ensure_ascii=False, separators=(
        ",", ":")).encode() + b"\n\n" for e in events)
