"""Captured calls -> the conversation a person reads: messages, and a `Choice` for each reply.

A rollout written with plain HTTP keeps its conversation in its own variables; what capture holds
is each call's request body and the server's replies. The conversation shown for it (records,
viewer, datasets, RULER's judge prompt) is the last call's request messages, with every earlier
reply the model sampled standing as the `Choice` it was, plus the last call's reply. A Choice (not
an assistant dict) so "the model wrote this" (`sampled`, `trainable`) reads the same as for a
trajectory built by hand; it carries the sampled `token_ids` as the server's own Choice does.

This is a view for reading: training takes the calls' token ids (`art_nb.grpo.captured`), never
this. Where call k's reply sits in the last request is where call k's own request ended
(`len(request messages)`); a conversation that was edited or truncated so no assistant message is
there shows that turn as the client sent it (training refuses such a history anyway).

A Responses API call's request is read as the chat messages its `instructions` and `input` items
map onto (`art_nb.response_items`, the endpoint's own mapping) and its function tools as chat tools.
One chained with `previous_response_id` sent only its new items, so it shows only those; a text
completion's request has no messages, so it shows its reply alone.
"""

from __future__ import annotations

from typing import Any

from ..messages import Choice, MessageOrChoice
from ..response_items import ItemError, chat_tools, input_messages
from .calls import CapturedCall, CapturedChoice

__all__ = ["captured_conversation", "captured_tools", "reply_choice"]


def captured_conversation(calls: list[CapturedCall]) -> list[MessageOrChoice]:
    """The conversation the calls record (see the module docstring); [] without calls."""
    if not calls:
        return []
    items: list[MessageOrChoice] = list(_request_messages(calls[-1]))
    for call in calls[:-1]:
        at = len(_request_messages(call))
        sent = items[at] if at < len(items) else None
        if isinstance(sent, dict) and sent.get("role") == "assistant" and call.choices:
            items[at] = reply_choice(_continued(call, sent))
    if calls[-1].choices:
        items.append(reply_choice(calls[-1].choices[0]))
    return items


def captured_tools(calls: list[CapturedCall]) -> list[dict[str, Any]] | None:
    """The tools the last call offered the model, as chat tools (None when it offered none)."""
    tools = calls[-1].request.get("tools") if calls else None
    if not isinstance(tools, list) or not tools:
        return None
    if not _is_responses(calls[-1].request):
        return tools
    try:
        return chat_tools(tools)
    except ItemError:
        return None


def reply_choice(choice: CapturedChoice) -> Choice:
    """A captured reply as the openai SDK's `Choice`, with the sampled `token_ids` (and `token_logprobs`)
    the server sent beside it. Built as the SDK builds responses (`construct`, no validation): a
    finish reason outside OpenAI's list, or none, is kept as the server sent it."""
    message = {"role": "assistant", "content": None, **choice.message}
    data: dict[str, Any] = {"index": choice.index, "finish_reason": choice.finish_reason, "logprobs": None,
                            "message": message, "token_ids": list(choice.token_ids)}
    if choice.logprobs is not None:
        data["token_logprobs"] = list(choice.logprobs)
    return Choice.construct(**data)  # openai's BaseModel.construct builds the nested message and tool calls


def _is_responses(request: dict[str, Any]) -> bool:
    return "input" in request and "messages" not in request


def _request_messages(call: CapturedCall) -> list[dict[str, Any]]:
    if _is_responses(call.request):  # a Responses call: its instructions and input items as chat messages
        try:
            return input_messages(call.request["input"], call.request.get("instructions"))
        except (ItemError, TypeError, AttributeError):
            return []
    messages = call.request.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return []  # not a chat request body as JSON carries it: positions would not line up
    return [dict(m) for m in messages]


def _continued(call: CapturedCall, sent: dict[str, Any]) -> CapturedChoice:
    """Of call's choices, the one the client sent back (same content and tool calls); else the first."""
    for choice in call.choices:
        if (choice.message.get("content") or None) == (sent.get("content") or None) and \
                _call_ids(choice.message) == _call_ids(sent):
            return choice
    return call.choices[0]


def _call_ids(message: dict[str, Any]) -> list[Any]:
    return [c.get("id") for c in message.get("tool_calls") or [] if isinstance(c, dict)]
