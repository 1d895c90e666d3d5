"""A request body and its response bytes -> a `CapturedCall`, or None when it is not one to record.

Recorded: a JSON request to a path ending in `/chat/completions`, `/responses` or `/completions`
whose successful response carries `prompt_token_ids` and the sampled `token_ids`: a JSON
ChatCompletion, Response or text completion, or their server-sent events (`chat.completion.chunk`s;
the Responses API's events, whose final `response.completed` or `response.incomplete` holds the whole
response; `text_completion` chunks). A Response's output items are kept as the chat assistant message
they hold, so every call reads alike. Any other response (OpenAI's own API, an error, a truncated
stream) is not art_nb's to train on and is skipped silently: capture never breaks the user's call.
"""

from __future__ import annotations

import json
from typing import Any

from ..response_items import assistant_message
from .calls import CapturedCall, CapturedChoice

__all__ = ["is_model_url", "parse_call", "request_json"]

_PATHS = ("/chat/completions", "/responses", "/completions")
_TERMINAL = ("response.completed", "response.incomplete")  # the events that carry a finished Response


def is_model_url(method: str, url: str) -> bool:
    """Whether the request is a model call capture looks at (chat, Responses or text completions)."""
    path = url.split("?", 1)[0].rstrip("/")
    return method.upper() == "POST" and path.endswith(_PATHS)


def request_json(body: Any) -> dict[str, Any] | None:
    """The request's JSON object, or None (no body, a stream body, not JSON)."""
    if isinstance(body, dict):
        return body
    if isinstance(body, str):
        body = body.encode()
    if not isinstance(body, (bytes, bytearray)):
        return None
    try:
        parsed = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        return None
    return parsed if isinstance(parsed, dict) else None


def parse_call(request: dict[str, Any], status: int, body: bytes) -> CapturedCall | None:
    """The call to record, or None when the response is not a complete art_nb completion."""
    if not 200 <= status < 300:
        return None
    try:
        if body.lstrip().startswith((b"data:", b"event:")):  # server-sent events (the Responses API names them)
            return _from_events(request, body)
        return _from_json(request, json.loads(body))
    except (ValueError, KeyError, TypeError):  # not JSON, not our shape, or a stream cut short
        return None


def _choice(data: dict[str, Any], message: dict[str, Any]) -> CapturedChoice:
    ids = [int(i) for i in data["token_ids"]]
    logprobs = data.get("token_logprobs")
    if logprobs is None and data.get("logprobs") and data["logprobs"].get("content") is not None:
        logprobs = [entry["logprob"] for entry in data["logprobs"]["content"]]
    if logprobs is not None and len(logprobs) != len(ids):
        logprobs = None
    return CapturedChoice(index=data.get("index", 0), token_ids=ids, logprobs=logprobs,
                          finish_reason=data.get("finish_reason"), message=message)


def _from_json(request: dict[str, Any], data: dict[str, Any]) -> CapturedCall | None:
    if data.get("object") == "response":
        return _from_response(request, data, streamed=False)
    if "prompt_token_ids" not in data:
        return None
    choices = [_choice(c, c.get("message") or _text_message(c)) for c in data["choices"]]
    return CapturedCall(model=data.get("model") or request.get("model", ""), prompt_token_ids=data["prompt_token_ids"],
                        choices=choices, request=request)


def _from_events(request: dict[str, Any], body: bytes) -> CapturedCall | None:
    """Reassemble a stream: prompt ids from the chunk that has them, per choice the ids, logprobs,
    content and finish reason from the chunks that carry them, in order."""
    prompt_ids: list[int] | None = None
    model = request.get("model", "")
    per_choice: dict[int, dict[str, Any]] = {}
    done = False
    for line in body.decode().splitlines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            done = True
            break
        chunk = json.loads(payload)
        if chunk.get("type") in _TERMINAL:  # the Responses API's stream: its last event holds it all
            return _from_response(request, chunk["response"], streamed=True)
        model = chunk.get("model") or model
        if chunk.get("prompt_token_ids") is not None:
            prompt_ids = chunk["prompt_token_ids"]
        for c in chunk.get("choices") or []:
            acc = per_choice.setdefault(c["index"], {"index": c["index"], "token_ids": [], "token_logprobs": [],
                                                     "content": "", "tool_calls": [], "finish_reason": None})
            acc["token_ids"] += c.get("token_ids") or []
            acc["token_logprobs"] += c.get("token_logprobs") or []
            delta = c.get("delta") or {}
            acc["content"] += (delta.get("content") or "") + (c.get("text") or "")  # chat, or text completions
            acc["tool_calls"] += delta.get("tool_calls") or []
            acc["finish_reason"] = c.get("finish_reason") or acc["finish_reason"]
    if not done or prompt_ids is None or not per_choice:
        return None
    choices = []
    for index in sorted(per_choice):
        acc = per_choice[index]
        message: dict[str, Any] = {"role": "assistant", "content": acc["content"] or None}
        if acc["tool_calls"]:
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in acc["tool_calls"]]
        if not acc["token_logprobs"]:
            acc["token_logprobs"] = None
        choices.append(_choice(acc, message))
    return CapturedCall(model=model, prompt_token_ids=prompt_ids, choices=choices, request=request, streamed=True)


def _text_message(choice: dict[str, Any]) -> dict[str, Any]:
    """A text completion's choice read as the assistant message a chat choice carries."""
    return {"role": "assistant", "content": choice["text"]} if isinstance(choice.get("text"), str) else {}


def _from_response(request: dict[str, Any], data: dict[str, Any], streamed: bool) -> CapturedCall | None:
    """A Response: one sample, its output items read as the chat assistant message they hold."""
    if "prompt_token_ids" not in data or "token_ids" not in data:
        return None
    message = assistant_message(data.get("output") or [])
    finish = "length" if data.get("status") == "incomplete" else "tool_calls" if message.get("tool_calls") else "stop"
    choice = _choice({"token_ids": data["token_ids"], "token_logprobs": data.get("token_logprobs"),
                      "finish_reason": finish}, message)
    return CapturedCall(model=data.get("model") or request.get("model", ""), prompt_token_ids=data["prompt_token_ids"],
                        choices=[choice], request=request, streamed=streamed)
