"""What a chat request constrains its reply to, as one Lark grammar (llguidance's dialect) the engine
samples under: `grammar_for(req)`, None when the reply is free.

Served:
- `response_format` `{"type": "json_object"}`: one JSON object;
- `response_format` `{"type": "json_schema", "json_schema": {"schema": ...}}`: JSON that matches the
  schema, `strict` or not (enforced either way, as vLLM does); a schema llguidance cannot compile is
  refused with a 400 naming it, never served unenforced;
- `tool_choice` `"required"`: tool calls only, one or more (exactly one with `parallel_tool_calls=false`);
- `tool_choice` `{"type": "function", "function": {"name": X}}`: exactly one call, to X;
- a `response_format` beside tools and `tool_choice` "auto": the JSON or tool calls, as OpenAI's API allows.

Tool calls are constrained to the format the prompt teaches and `toolcalls.py` parses back, the
Hermes block `<tool_call>\\n{"name": X, "arguments": {...}}\\n</tool_call>` (blocks joined by a newline),
with X one of the offered tools and the arguments that tool's `parameters` schema; the tags are the
tokenizer's own single tokens where it has them (Qwen2.5, Hermes), as the model writes them. A non-strict tool
whose schema llguidance cannot compile gets any JSON object as arguments (the call is still well
formed); a `strict` one is refused, since its arguments could not be held to the schema.

JSON is written on one line, with `json.dumps`'s separators (", " and ": "), unless a schema's own
`x-guidance` says otherwise: with free whitespace a small model under a mask can write newlines until
`max_tokens` (SmolLM2-135M does), and one line is how the chat templates show tool calls. An object
schema that lists its properties and leaves `additionalProperties` unset is held to those properties,
as xgrammar (vLLM's default backend) and OpenAI's strict mode hold it: a tool's function would
reject the extra keys a small model otherwise adds.

Pure text building; llguidance is imported only to check the pieces, so a bad schema is a 400 that
names its field. Both engines run the same grammar with llguidance (the transformers engine through
`engines/hf/grammar.py`, vLLM through its "guidance" structured-output backend).
"""

from __future__ import annotations

import functools
import json
import logging
import weakref
from typing import Any

from art_nb.web import ApiError

from .schema import ChatCompletionRequest

__all__ = ["JSON_STYLE", "forced_tool", "grammar_for"]

_log = logging.getLogger("art_nb")
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def forced_tool(tool_choice: Any) -> str | None:
    """The tool a `tool_choice` names ({"type": "function", "function": {"name": X}} -> X), else None."""
    if isinstance(tool_choice, dict):
        return (tool_choice.get("function") or {}).get("name")
    return None


def grammar_for(req: ChatCompletionRequest, tokenizer: Any = None) -> str | None:
    """The Lark grammar the reply to `req` must match, or None; ApiError 400 for what cannot be enforced.
    `tokenizer`: the served model's, for the call tags it holds as single tokens (`_tag`)."""
    answer = _answer(req.response_format)
    named = forced_tool(req.tool_choice)
    forced = req.tool_choice == "required" or named is not None
    if forced and not req.tools:
        raise ApiError(400, f"tool_choice: {json.dumps(req.tool_choice)} needs the tools it chooses from in 'tools'",
                       param="tool_choice")
    if not forced and answer is None:
        return None
    start = "calls" if forced else "answer | calls" if req.parses_tool_calls else "answer"
    rules = [f"start: {start}"]
    if answer is not None and not forced:
        rules.append(f"answer: {answer}")
    if "calls" in start:
        rules.extend(_call_rules(req, named, tokenizer))
    return "\n".join(rules)


def _answer(response_format: dict[str, Any] | None) -> str | None:
    """The `%json` piece a response format asks for, or None for text."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    schema = (response_format or {}).get("json_schema", {}).get("schema") if kind == "json_schema" else None
    piece = _json(schema if schema is not None else _ANY_OBJECT)
    error = _compile_error(piece)
    if error:
        param = "response_format.json_schema.schema"
        raise ApiError(400, f"{param}: llguidance cannot enforce it: {error}; simplify the part it names, or send "
                       "response_format json_object", param=param)
    return piece


def _call_rules(req: ChatCompletionRequest, named: str | None, tokenizer: Any) -> list[str]:
    """The rules of "calls": Hermes blocks, one per call, to the tool `named` or any offered one."""
    names = [tool.function.name for tool in req.tools or ()]
    if named is not None and named not in names:
        raise ApiError(400, f"tool_choice: {named!r} is not among the tools offered", param="tool_choice")
    chosen = [i for i, name in enumerate(names) if named is None or name == named]
    several = named is None and req.parallel_tool_calls is not False
    return [
        'calls: call ("\\n" call)*' if several else "calls: call",
        f'call: {_tag("<tool_call>", tokenizer)} "\\n" (' + " | ".join(f"tool_{i}" for i in chosen)
        + f') "\\n" {_tag("</tool_call>", tokenizer)}',
        *(f"tool_{i}: {_literal(_call_head(names[i]))} {_parameters(req, i)} {_literal('}')}" for i in chosen),
    ]


def _tag(tag: str, tokenizer: Any) -> str:
    """`tag` as the grammar must take it: the token itself (llguidance's `<name>`) where the tokenizer has it
    as one added token, as Qwen2.5's and Hermes' have `<tool_call>`; else its text. llguidance marks every
    added token special, so its text form would refuse the one token a model writes the tag as (the mask
    allowed it, consuming it failed: measured on Qwen2.5's tokenizer)."""
    if tokenizer is not None and tag in _added_tokens(tokenizer):
        return tag
    return _literal(tag)


def _added_tokens(tokenizer: Any) -> frozenset[str]:
    """The tokenizer's added tokens, remembered per tokenizer (get_added_vocab builds a dict per call)."""
    known = _ADDED.get(tokenizer)
    if known is None:
        known = _ADDED[tokenizer] = frozenset(tokenizer.get_added_vocab())
    return known


_ADDED: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()


def _call_head(name: str) -> str:
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '


def _parameters(req: ChatCompletionRequest, index: int) -> str:
    """The `%json` piece of tool `index`'s arguments: its schema, or any object where llguidance cannot
    compile it and the tool is not strict."""
    function = (req.tools or [])[index].function
    piece = _json(function.parameters or _ANY_OBJECT)
    error = _compile_error(piece)
    if not error:
        return piece
    if (function.model_extra or {}).get("strict"):
        param = f"tools.{index}.function.parameters"
        raise ApiError(400, f"{param}: tool {function.name!r} is strict, but llguidance cannot enforce its schema: "
                       f"{error}", param=param)
    _log.warning("tool %r: its arguments are held to any JSON object, not its schema, which llguidance cannot "
                 "compile: %s", function.name, error.splitlines()[0])
    return _json(_ANY_OBJECT)


def _json(schema: Any) -> str:
    """`%json` of `schema`, closed (`_closed`) and written on one line unless its own x-guidance says otherwise."""
    if isinstance(schema, dict):
        schema = {**_closed(schema), "x-guidance": {**JSON_STYLE, **(schema.get("x-guidance") or {})}}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _closed(schema: Any) -> Any:
    """A copy of `schema` where every object that lists its properties and says nothing of others has
    `additionalProperties: false`: xgrammar's default (vLLM's usual backend) and OpenAI's strict mode.
    JSON Schema's own default lets a model add keys a tool's function would reject (SmolLM2 does)."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: ({k: _closed(v) for k, v in value.items()} if key in _SCHEMA_MAPS and isinstance(value, dict)
                 else _closed(value) if key in _SUBSCHEMAS else value) for key, value in schema.items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf", "not", "if", "then", "else",
               "contains")


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _compile_error(piece: str) -> str:
    """"" when `piece` (one rule's right-hand side) compiles, else llguidance's message. Pieces up to
    16k characters are remembered (512 of them, at most 8 MiB): a group's rollouts send the same tools
    on every call, and checking one schema took 1-4 ms of the event loop (SmolLM2's CPU box, loaded)."""
    return _checked(piece) if len(piece) <= 16_384 else _check(piece)


def _check(piece: str) -> str:
    try:
        import llguidance
    except ImportError:
        raise ApiError(400, "constrained decoding (a JSON response_format, tool_choice required or named) needs "
                       "llguidance: pip install 'llguidance>=1.3'", "llguidance_missing") from None
    return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(f"start: {piece}"))


_checked = functools.lru_cache(maxsize=512)(_check)
