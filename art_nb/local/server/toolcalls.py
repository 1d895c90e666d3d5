"""Tool calls out of generated text, in the Hermes/Qwen format the chat templates teach.

A model that was shown tools answers a call as

    <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>

possibly several times, possibly with prose around the calls. `parse_tool_calls` turns each
well-formed block into an OpenAI `tool_calls` entry (arguments re-serialised as a JSON string, as the
OpenAI API carries them) and returns the remaining text as the message content.

A block that does not parse (bad JSON, no name, an unclosed tag because generation hit
`max_tokens`) stays in the content verbatim: a rollout sees what the model actually wrote and can
give it a low reward, rather than the endpoint failing the whole request.

The tags must survive decoding: with `skip_special_tokens=True` a tokenizer that marks
`<tool_call>` as a *special* token would drop it. Qwen and Hermes tokenizers add these tags as
ordinary (non-special) added tokens, so they do survive.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

__all__ = ["parse_tool_calls", "new_tool_call_id"]

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def new_tool_call_id() -> str:
    """An id in OpenAI's style ("call_" + 24 hex digits), unique enough to pair calls with results."""
    return f"call_{secrets.token_hex(12)}"


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split `text` into (content without the parsed calls, OpenAI tool_call dicts).

    Each dict is `{"id": "call_…", "type": "function", "function": {"name": str, "arguments": str}}`
    where `arguments` is a JSON object serialised to a string. The content is stripped of the
    whitespace the calls leave behind; it is "" when the model said nothing besides its calls.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        call = _parse_block(match.group(1))
        if call is None:
            continue  # malformed: leave the whole block in the content
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[position:])
    return "".join(kept).strip(), calls


def _parse_block(body: str) -> dict[str, Any] | None:
    """One OpenAI tool call from the JSON between the tags, or None when it is not a valid call."""
    try:
        payload = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
        return None
    # Some templates (Llama 3.x) teach "parameters" for what Hermes calls "arguments".
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # a model that already wrote the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {
        "id": new_tool_call_id(),
        "type": "function",
        "function": {"name": payload["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }
