"""Chat messages as a trajectory holds them: checked at the boundary, and rendered one way for
serving and training alike.

A message is an OpenAI-style dict; what the model said is the `Choice` the endpoint returned. The
checks name the offending index and field, so a mistake in a rollout is reported where it is made.
A tool result is taken as ART takes it: its `tool_call_id` need not answer an earlier call, nor be
there at all (ART's tool-use notebook answers "n/a" when the model made no call; a template shows
the result's content either way).
"""

from __future__ import annotations

import contextlib
import copy
import json
from typing import Any

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel

__all__ = ["Choice", "MessageOrChoice", "check_messages", "choice_to_message", "template_message"]

MessageOrChoice = dict[str, Any] | Choice
_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _check_message(index: int, item: Any) -> MessageOrChoice:
    if isinstance(item, Choice):
        return item
    if isinstance(item, BaseModel):  # e.g. a ChatCompletionMessage the user appended
        item = item.model_dump(exclude_none=True)
    if not isinstance(item, dict):
        raise ValueError(
            f"messages_and_choices[{index}] is a {type(item).__name__}; expected a message dict "
            "like {'role': 'user', 'content': '...'} or the Choice returned by chat.completions.create"
        )
    role = item.get("role")
    if role not in _ROLES:
        raise ValueError(
            f"messages_and_choices[{index}] has role {role!r}; expected one of {sorted(_ROLES)}"
        )
    content = item.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise ValueError(
            f"messages_and_choices[{index}]['content'] is a {type(content).__name__}; expected str"
        )
    return item


def check_messages(value: Any) -> list[MessageOrChoice]:
    if not isinstance(value, (list, tuple)):
        raise ValueError("messages_and_choices must be a list of message dicts and Choices")
    return [_check_message(i, item) for i, item in enumerate(value)]


def choice_to_message(choice: Choice) -> dict[str, Any]:
    """The assistant message a Choice stands for, as the next request would send it."""
    return choice.message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"})


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates expect it, for serving and training alike (one rendering, no drift).

    OpenAI sends tool-call arguments as a JSON string; HF templates (Qwen's `| tojson`, Hermes)
    expect an object, and would render a string quoted. Content None becomes "" (templates
    concatenate it).
    """
    message = copy.deepcopy(message)
    if message.get("content") is None:
        message["content"] = ""
    for call in message.get("tool_calls") or []:
        arguments = call.get("function", {}).get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):
                call["function"]["arguments"] = json.loads(arguments)
    return message
