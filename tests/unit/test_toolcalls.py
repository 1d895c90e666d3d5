"""parse_tool_calls: Hermes/Qwen <tool_call> blocks → OpenAI tool_calls, everything else kept as content."""

from __future__ import annotations

import json
import re

from art_nb.local.server.toolcalls import parse_tool_calls


def test_plain_text_is_untouched() -> None:
    text = "  no calls here, just an answer\n"
    assert parse_tool_calls(text) == (text, [])


def test_single_call_becomes_openai_tool_call() -> None:
    content, calls = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert content == ""
    assert len(calls) == 1
    call = calls[0]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    assert call["type"] == "function"
    assert call["function"]["name"] == "add"
    assert isinstance(call["function"]["arguments"], str)
    assert json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}


def test_multiple_calls_with_text_around_them() -> None:
    text = (
        "Let me look both up.\n"
        '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "weather", "arguments": {"city": "Zürich"}}</tool_call>\n'
        "Done."
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me look both up.\n\n\nDone."
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Zürich"]
    assert calls[0]["id"] != calls[1]["id"]
    assert "Zürich" in calls[1]["function"]["arguments"]  # not escaped to \\u00fc


def test_malformed_json_stays_in_content_and_good_calls_still_parse() -> None:
    bad = '<tool_call>{"name": "add", "arguments": {"a": 1,}</tool_call>'
    good = '<tool_call>{"name": "sub", "arguments": {"a": 3}}</tool_call>'
    content, calls = parse_tool_calls(f"before {bad} middle {good} after")
    assert [c["function"]["name"] for c in calls] == ["sub"]
    assert content == f"before {bad} middle  after"


def test_only_malformed_returns_text_verbatim() -> None:
    for text in [
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
        '<tool_call>["add", 1]</tool_call>',  # not an object
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "add", "arguments": {"a": 1}}',  # unclosed: generation was cut off
    ]:
        assert parse_tool_calls(text) == (text, []), text


def test_arguments_given_as_json_string_or_parameters_or_missing() -> None:
    _, calls = parse_tool_calls(
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
        '<tool_call>{"name": "b", "parameters": {"y": 2}}</tool_call>'
        '<tool_call>{"name": "c"}</tool_call>'
    )
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"x": 1}, {"y": 2}, {}]
