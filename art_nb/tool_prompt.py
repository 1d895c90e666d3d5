"""How tools and tool calls reach the model: through its own chat template where that template shows
them, else art_nb's Hermes-style rendering. One function for serving (the endpoint's prompt) and
training (`grpo/tokens.py`'s rendering of ART-style trajectories), so both see the same text.

Which one (`tool_style`, decided once per template): a probe conversation (a tool, an assistant call
to it, the tool's result) is rendered with the template. The template's own rendering is used when
it shows all three, the call as a `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block
(the Hermes/Qwen format). That format is the only one the endpoint parses the model's calls back
from (`local/server/toolcalls.py`), so a template that writes calls another way (Llama 3.x's bare
JSON, Mistral's `[TOOL_CALLS]`) gets the fallback too: the model is shown its past calls in the
format its new calls are read in. Templates that ignore `tools` (SmolLM2's prints each message's
`content` and nothing else) get the fallback.

The fallback (`hermes_messages`), as Hermes 2 Pro and Qwen2.5 teach:
- the tools, one JSON object per line inside `<tools></tools>`, with the instruction to answer a
  call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, are appended to the first
  system (or developer) message, or make a system message of their own in front;
- an assistant's tool calls are written into its content as those blocks (after any text);
- tool results become one user message of `<tool_response>\\n...\\n</tool_response>` blocks (a run
  of consecutive results in one message, as Qwen2.5 renders them).
The template then renders plain system/user/assistant messages, which every chat template can.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["ToolStyle", "hermes_messages", "template_inputs", "tool_style", "tools_missing"]

TOOLS_BEGIN = "<tools>"
_INSTRUCTIONS = (
    "# Tools\n\nYou may call functions to help with the request. Their signatures, one JSON object per "
    "line, are inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, answer with a "
    "JSON object holding its name and arguments inside <tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_PROBE_TOOL = "art_nb_probe_tool"
_PROBE_DESCRIPTION = "art_nb_probe_description"
_PROBE_ARG, _PROBE_VALUE, _PROBE_RESULT = "art_nb_probe_arg", "art_nb_probe_value", "art_nb_probe_result"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_STYLES: dict[str, ToolStyle] = {}  # by template text: a handful per process


@dataclass(frozen=True)
class ToolStyle:
    """How a template's prompts show tools: "template" (its own rendering) or "hermes" (the
    fallback), and why, in words register reports."""

    kind: Literal["template", "hermes"]
    reason: str


def tool_style(tokenizer: Any) -> ToolStyle:
    """The style for `tokenizer`'s chat template (see the module docstring), decided once per template."""
    template = str(tokenizer.chat_template or "")
    style = _STYLES.get(template)
    if style is None:
        style = _STYLES[template] = _probe(tokenizer)
    return style


def _probe(tokenizer: Any) -> ToolStyle:
    tools = [{"type": "function", "function": {
        "name": _PROBE_TOOL, "description": _PROBE_DESCRIPTION,
        "parameters": {"type": "object", "properties": {_PROBE_ARG: {"type": "string"}}}}}]
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_probe", "type": "function", "function": {
            "name": _PROBE_TOOL, "arguments": {_PROBE_ARG: _PROBE_VALUE}}}]},
        {"role": "tool", "tool_call_id": "call_probe", "content": _PROBE_RESULT},
    ]
    fallback = ("tools and tool calls are shown Hermes-style (tools listed in the system message inside "
                "<tools></tools>, calls written as <tool_call> JSON blocks, results as <tool_response> in a "
                "user turn) because the chat template {why}")
    try:
        text = str(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False))
    except Exception as exc:  # noqa: BLE001 - third-party: jinja and the template's own raise_exception
        return ToolStyle("hermes", fallback.format(why=f"rejects a conversation with a tool call ({exc})"))
    if _PROBE_DESCRIPTION not in text:
        return ToolStyle("hermes", fallback.format(why="does not show the tools list"))
    if _PROBE_RESULT not in text:
        return ToolStyle("hermes", fallback.format(why="does not show tool results"))
    if not any(_is_probe_call(body) for body in _BLOCK.findall(text)):
        return ToolStyle("hermes", fallback.format(
            why="does not write tool calls as <tool_call> JSON blocks, the format art_nb parses replies in"))
    return ToolStyle("template", "the chat template's own rendering shows tools, tool calls (as <tool_call> JSON "
                                 "blocks, the format art_nb parses replies in) and tool results")


def _is_probe_call(body: str) -> bool:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return False
    arguments = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
    return call.get("name") == _PROBE_TOOL and isinstance(arguments, dict) and arguments.get(_PROBE_ARG) == _PROBE_VALUE


def template_inputs(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to hand `tokenizer.apply_chat_template`: unchanged where the template shows
    tools itself, else the Hermes-style messages and no `tools`. `messages` are as templates take them
    (`messages.template_message`: tool-call arguments as objects)."""
    if not tools and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return messages, tools
    if tool_style(tokenizer).kind == "template":
        return messages, tools
    return hermes_messages(messages, tools), None


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` with tools, tool calls and tool results written as text (the module docstring)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        calls = [_call_text(call) for call in message.get("tool_calls") or []]
        message = {k: v for k, v in message.items() if k != "tool_calls"}
        if calls:
            text = message.get("content") or ""
            message["content"] = "\n".join([text, *calls] if text else calls)
        out.append(message)
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        listing = _INSTRUCTIONS.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
        if out and out[0].get("role") in ("system", "developer"):
            system = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{system}\n\n{listing}" if system else listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def _call_text(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    arguments = function.get("arguments", {})
    body = json.dumps({"name": function.get("name", ""), "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def tools_missing(text: str, tools: list[dict[str, Any]] | None, style: ToolStyle) -> str | None:
    """Why `text` (a rendered prompt) does not show `tools`, or None when it does: the endpoint
    refuses such a request rather than sample from a model that never saw its tools."""
    if not tools:
        return None
    if style.kind == "hermes":
        return None if TOOLS_BEGIN in text else (
            "the chat template dropped the system message that lists the tools; pass "
            "ModelConfig(chat_template=...) with a template that shows system messages or tools")
    names = [tool.get("function", {}).get("name", "") for tool in tools]
    missing = [name for name in names if name not in text]
    return None if not missing else (
        f"the chat template did not show the tools {missing}; pass ModelConfig(chat_template=...) with a "
        "template that shows them")
