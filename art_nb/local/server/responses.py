"""The body of POST /v1/responses, validated, and the chat request it is served as.

A Responses request is served by the chat pipeline: its `instructions` and `input` items become the
chat messages the model's template renders (`art_nb.response_items`), its function tools the chat
tools, `max_output_tokens` the token limit, `text.format` the response format, and `tool_choice`
the chat form of the same choice. So the prompt, the turn cache (a multi-turn agent that sends back
the items it was answered with gets its sampled ids back, as a chat client does), sampling, tool-call
parsing and what training sees are the chat path's own, and whatever the chat path serves or
refuses (a response format, a tool choice) it serves or refuses here too.

Refused with a 400 naming the field, because they cannot be honoured: hosted tools (web search, file
search, code interpreter, computer use, MCP...), `background`, `conversation` (the Conversations
API), stored `prompt` templates, `truncation: "auto"` (it would drop items the rollout sent),
a reasoning effort or summary, `text.verbosity`, `context_management`, and non-text parts.

`previous_response_id` is honoured: each answered response's conversation (its input as chat
messages, without `instructions`, which OpenAI does not carry over either, plus its reply) is kept in
a bounded in-memory store per app, least recently used out, unless the request says `store: false`.
Why keep them rather than refuse: the Agents SDK (`auto_previous_response_id`, a `previous_response_id`
given to `Runner.run`) and OpenAI's own examples chain responses this way, and they should run
unchanged. A response no longer kept (or never stored) is a 400 that says to send the whole
conversation instead.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from art_nb.response_items import ItemError, chat_tools, input_messages
from art_nb.web import ApiError

from .schema import MAX_TOOLS, ChatCompletionRequest

__all__ = ["LOGPROBS_INCLUDE", "ResponseStore", "ResponsesRequest", "chat_request"]

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_REASONING_OFF = (None, "none")


class ResponsesRequest(BaseModel):
    """The body of POST /v1/responses. Unknown fields are ignored, as for chat completions; fields
    that change what OpenAI would do and cannot be honoured here are refused (module docstring)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(max_length=512)
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = Field(None, max_length=256)
    store: bool | None = None
    stream: bool | None = None
    include: list[str] | None = Field(None, max_length=64)
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # art_nb's, as in chat completions
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    context_management: Any = None

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background mode is not served here: the call answers when the response is done; "
                             "run the call in a task (asyncio.create_task) to do other work meanwhile")
        return value

    @field_validator("conversation", "prompt", "context_management")
    @classmethod
    def _not_served(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("OpenAI keeps this on its servers, and this endpoint does not: send the conversation "
                             "(instructions and input items) itself")
        return value

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, value: str | None) -> str | None:
        if value not in (None, "disabled"):
            raise ValueError('only "disabled" is served: "auto" would drop input items the rollout sent (the '
                             "trajectory would train on a conversation the model never saw); shorten the input")
        return value

    @field_validator("reasoning")
    @classmethod
    def _no_reasoning(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and (value.get("effort") not in _REASONING_OFF or value.get("summary") is not None
                      or value.get("generate_summary") is not None):
            raise ValueError("reasoning effort and summaries are not served here (the model reasons, or not, as "
                             "its chat template has it); leave reasoning out")
        return value

    @field_validator("text")
    @classmethod
    def _no_verbosity(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and value.get("verbosity") is not None:
            raise ValueError("verbosity is not served here: it is a hint OpenAI's models were trained on; ask "
                             "for the length you want in the instructions")
        return value

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)


class ResponseStore:
    """Answered responses' conversations (chat messages, reply last) by response id, for
    `previous_response_id`: least recently used out, bounded by entries and by characters of JSON."""

    def __init__(self, max_entries: int = 4096, max_chars: int = 64 << 20) -> None:
        self.max_entries, self.max_chars = max_entries, max_chars
        self._entries: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                return None
            self._entries.move_to_end(response_id)
        return list(json.loads(entry[0]))  # kept as JSON: a copy no caller can alter, and its size known

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        text = json.dumps(messages, ensure_ascii=False, separators=(",", ":"))
        if len(text) > self.max_chars:
            return
        with self._lock:
            self._entries[response_id] = (text, len(text))
            self._chars += len(text)
            while self._chars > self.max_chars or len(self._entries) > self.max_entries:
                _, (_, size) = self._entries.popitem(last=False)
                self._chars -= size

    def __len__(self) -> int:
        return len(self._entries)


def chat_request(req: ResponsesRequest, store: ResponseStore) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request `req` is served as, and the conversation to store once it is answered (the
    messages without `instructions`; the reply is appended by the caller)."""
    earlier: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        kept = store.get(req.previous_response_id)
        if kept is None:
            raise ApiError(400, f"no stored response {req.previous_response_id!r} here: responses are kept in memory "
                           f"(the last {store.max_entries:,} at most, none with store=false, none across restarts); "
                           "send the whole conversation as input instead", "previous_response_not_found",
                           param="previous_response_id")
        earlier = kept
    try:
        conversation = earlier + input_messages(req.input, None)
        tools = chat_tools(req.tools) if req.tools else None
    except ItemError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {
        "model": req.model, "messages": system + conversation, "tools": tools,
        "tool_choice": _chat_tool_choice(req.tool_choice), "response_format": _chat_format(req.text),
        "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "logprobs": req.wants_logprobs or None, "top_logprobs": req.top_logprobs if req.wants_logprobs else None,
        "parallel_tool_calls": req.parallel_tool_calls, "seed": req.seed,
    }
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        raise _as_responses_error(exc) from None
    return chat, conversation


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses' tool_choice in chat's form: a named function moves under "function"; the choices
    only hosted tools have (allowed_tools, a hosted tool's type) are refused."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, f"tool_choice {choice.get('type')!r} is not served here: use \"auto\", \"none\", "
                   "\"required\" or {\"type\": \"function\", \"name\": ...}", param="tool_choice")


def _chat_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (json_schema's fields move under "json_schema")."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return dict(fmt)


# The chat fields a Responses request's fields became, named back in errors.
_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
           "logprobs": "include", "tools": "tools"}


def _as_responses_error(exc: ValidationError) -> ApiError:
    """One 400 naming the Responses fields behind the chat fields that failed."""
    parts, first = [], None
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        if loc and loc[0] in _FIELDS:
            head = _FIELDS[loc[0]]
            rest = [p for p in loc[1:] if p != "function"] if head == "tools" else []
            loc = [head, *rest] if head != "input" else [head]
        param = ".".join(loc) or None
        first = first or param
        message = err["msg"].removeprefix("Value error, ")
        parts.append(f"{param}: {message}" if param else message)
    return ApiError(400, "; ".join(parts), param=first)
