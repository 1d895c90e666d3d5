"""OpenAI Responses API items <-> the chat messages a chat template renders.

The endpoint serves `/v1/responses` by mapping a request onto the chat conversation the model's
template renders (so the prompt, the turn cache and training are the chat path's own), and capture
reads a recorded Responses call back as that same conversation. One mapping for both, here, pure:

- `input_messages`: `instructions` + `input` (a string, or items) -> chat messages. A `message` item
  is a message (its text parts joined); `function_call` items join the assistant message before them
  as its `tool_calls` (or start one with no content); a `function_call_output` is a `tool` message.
  So the items the endpoint answered with, sent back as they came, map onto exactly the assistant
  message the endpoint remembered, and the turn is given back to the model as its sampled ids.
- `chat_tools`: Responses function tools (flat: name, parameters at the top) -> chat tools.
- `assistant_message`: a Response's output items -> the chat assistant message they hold.

Anything else (hosted tools' calls, reasoning items, item references, image/file/audio parts)
raises `ItemError` naming the item and why: the model cannot be shown it, and a rollout that
silently lost it would train on a conversation nobody had.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ItemError", "assistant_message", "chat_tools", "input_messages"]

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


class ItemError(ValueError):
    """An item or tool that cannot be shown to the model; `param` is where it is ("input[2].content[0]")."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def input_messages(input: str | list[Any], instructions: str | None = None) -> list[dict[str, Any]]:
    """The chat messages for a request's `instructions` (a system message first) and `input`."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(input, str):
        return [*messages, {"role": "user", "content": input}]
    for i, item in enumerate(input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ItemError(where, "an input item is an object (a message, function_call or function_call_output)")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
        else:
            raise ItemError(f"{where}.type", f"items of type {kind!r} are not served here: only message, "
                            "function_call and function_call_output (hosted tools' calls, reasoning items and "
                            "item references have nothing a chat template can show; send their text as a message)")
    return messages


def chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Responses function tools as chat tools; any other tool type raises `ItemError`."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ItemError(f"tools[{i}].type", f"{kind!r} is a tool OpenAI runs on its own servers (web search, "
                            "file search, code interpreter, computer use, MCP, ...), which this endpoint cannot run: "
                            "offer it as a function tool ({'type': 'function', 'name': ...}) that your agent runs")
        function = {k: v for k, v in tool.items() if k != "type"}
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ItemError(f"tools[{i}].name", "a function tool needs a name")
        out.append({"type": "function", "function": function})
    return out


def assistant_message(output: list[Any]) -> dict[str, Any]:
    """The chat assistant message a Response's output items hold: the message items' text as
    content (None without one), the function calls as `tool_calls`; other items are skipped."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    has_message = False
    for item in output:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "message":
            has_message = True
            texts += [p.get("text") or "" for p in item.get("content") or [] if isinstance(p, dict)]
        elif item.get("type") == "function_call":
            calls.append({"id": item.get("call_id"), "type": "function",
                          "function": {"name": item.get("name"), "arguments": item.get("arguments")}})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if has_message else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise ItemError(f"{where}.role", f"a message's role is one of {', '.join(_ROLES)} (got {role!r})")
    content = item.get("content")
    text = content if isinstance(content, str) else _text(content, f"{where}.content")
    return {"role": role, "content": text}


def _text(parts: Any, where: str) -> str:
    """The text of a list of content parts, joined; a part that is not text raises."""
    if not isinstance(parts, list):
        raise ItemError(where, "content is a string or a list of text parts")
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ItemError(f"{where}[{k}]", f"only text parts ({', '.join(_TEXT_PARTS)}) are served here, got "
                            f"{kind!r}: this endpoint serves text-only models (describe an image or file in text)")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ItemError(f"{where}.{key}", f"a {item.get('type')} item needs {key!r} (a string)")
    return value
