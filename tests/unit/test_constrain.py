"""Constrained decoding without a model: the grammar each request gets (server/constrain.py), held
against texts by llguidance over a real byte-level tokenizer, and the HF engine's mask
(engines/hf/grammar.py) on hand-made logits."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from conftest import build_chatml_tokenizer

from art_nb.local.engines.hf.batch import Row
from art_nb.local.engines.hf.grammar import Grammars
from art_nb.local.server.constrain import grammar_for
from art_nb.local.server.schema import ChatCompletionRequest
from art_nb.web import ApiError

llguidance = pytest.importorskip("llguidance")

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITY = {"type": "json_schema", "json_schema": {"name": "c", "strict": True, "schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["city", "n"], "additionalProperties": False}}}
CALL_ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
CALL_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def request(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def matches(tokenizer, grammar: str, text: str) -> bool:
    """Whether `text` then EOS is a complete match of `grammar`."""
    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and matcher.consume_token(tokenizer.eos_token_id) and matcher.is_accepting()


_LL: dict[int, object] = {}


def ll_tokenizer(tokenizer):
    if id(tokenizer) not in _LL:
        import llguidance.hf

        _LL[id(tokenizer)] = llguidance.hf.from_tokenizer(tokenizer)
    return _LL[id(tokenizer)]


def test_free_requests_get_no_grammar() -> None:
    assert grammar_for(request()) is None
    assert grammar_for(request(tools=[ADD])) is None  # "auto": the model may call or answer
    assert grammar_for(request(tools=[ADD], tool_choice="none")) is None
    assert grammar_for(request(response_format={"type": "text"})) is None


def test_a_named_tool_choice_allows_exactly_one_call_to_that_tool(chatml_tokenizer) -> None:
    grammar = grammar_for(request(tools=[ADD, WEATHER], tool_choice={"type": "function", "function": {"name": "add"}}))
    assert matches(chatml_tokenizer, grammar, CALL_ADD)
    assert not matches(chatml_tokenizer, grammar, CALL_WEATHER)  # another tool
    assert not matches(chatml_tokenizer, grammar, CALL_ADD + "\n" + CALL_ADD)  # a second call
    assert not matches(chatml_tokenizer, grammar, CALL_ADD.replace('"b": 2', '"b": "2"'))  # against the schema
    assert not matches(chatml_tokenizer, grammar, CALL_ADD.replace("}}", ', "c": 3}}'))  # additionalProperties false
    assert not matches(chatml_tokenizer, grammar, "Sure! " + CALL_ADD)  # prose first


def test_call_tags_the_tokenizer_holds_as_one_token_are_that_token(chatml_tokenizer) -> None:
    """Qwen2.5 and Hermes tokenizers add `<tool_call>` and `</tool_call>` as tokens, and models write the
    tags as those tokens; llguidance marks every added token special, so the tags written as text let the
    mask offer the token and then refused it once sampled. As tokens, the call is one whole path."""
    from tokenizers import AddedToken

    tok = build_chatml_tokenizer()
    tok.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<tool_call>", "</tool_call>")])
    named = {"type": "function", "function": {"name": "add"}}
    grammar = grammar_for(request(tools=[ADD], tool_choice=named), tok)
    assert "call: <tool_call> " in grammar and ' "\\n" </tool_call>' in grammar
    matcher = llguidance.LLMatcher(ll_tokenizer(tok), grammar, log_level=0)
    ids = tok.encode(CALL_ADD, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<tool_call>")
    assert matcher.consume_tokens(ids) and matcher.consume_token(tok.eos_token_id) and matcher.is_accepting()
    assert '"<tool_call>"' in grammar_for(request(tools=[ADD], tool_choice=named), chatml_tokenizer)  # no such token


def test_required_allows_calls_to_any_tool_and_parallel_tool_calls_false_one(chatml_tokenizer) -> None:
    grammar = grammar_for(request(tools=[ADD, WEATHER], tool_choice="required"))
    assert matches(chatml_tokenizer, grammar, CALL_WEATHER)
    assert matches(chatml_tokenizer, grammar, CALL_ADD + "\n" + CALL_WEATHER)
    assert not matches(chatml_tokenizer, grammar, "I cannot call tools.")
    single = grammar_for(request(tools=[ADD, WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert matches(chatml_tokenizer, single, CALL_ADD)
    assert not matches(chatml_tokenizer, single, CALL_ADD + "\n" + CALL_WEATHER)


def test_json_formats_hold_the_reply_to_json_on_one_line(chatml_tokenizer) -> None:
    schema = grammar_for(request(response_format=CITY))
    assert matches(chatml_tokenizer, schema, '{"city": "Paris", "n": 3}')
    assert not matches(chatml_tokenizer, schema, '{"city": "Paris"}')  # a required key missing
    assert not matches(chatml_tokenizer, schema, '{\n  "city": "Paris",\n  "n": 3\n}')  # one line
    anything = grammar_for(request(response_format={"type": "json_object"}))
    assert matches(chatml_tokenizer, anything, '{"x": [1, {"y": null}]}')
    assert not matches(chatml_tokenizer, anything, '[1, 2]')  # an object, as OpenAI's json_object


def test_objects_that_list_their_properties_are_closed_unless_they_say_otherwise(chatml_tokenizer) -> None:
    """As xgrammar and OpenAI's strict mode: WEATHER leaves additionalProperties unset."""
    grammar = grammar_for(request(tools=[WEATHER], tool_choice="required"))
    assert not matches(chatml_tokenizer, grammar, CALL_WEATHER.replace('"}}', '", "unit": "C"}}'))
    open_tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        **WEATHER["function"]["parameters"], "additionalProperties": True}}}
    grammar = grammar_for(request(tools=[open_tool], tool_choice="required"))
    assert matches(chatml_tokenizer, grammar, CALL_WEATHER.replace('"}}', '", "unit": "C"}}'))
    nested = {"type": "object", "properties": {"list": {"type": "array", "items": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}}
    grammar = grammar_for(request(response_format={"type": "json_schema", "json_schema": {"schema": nested}}))
    assert matches(chatml_tokenizer, grammar, '{"list": [{"x": 1}]}')
    assert not matches(chatml_tokenizer, grammar, '{"list": [{"x": 1, "y": 2}]}')


def test_a_response_format_beside_auto_tools_allows_either(chatml_tokenizer) -> None:
    grammar = grammar_for(request(tools=[WEATHER], response_format=CITY))
    assert matches(chatml_tokenizer, grammar, CALL_WEATHER)
    assert matches(chatml_tokenizer, grammar, '{"city": "Rome", "n": 1}')
    assert not matches(chatml_tokenizer, grammar, "Rome")
    forced = grammar_for(request(tools=[WEATHER], response_format=CITY, tool_choice="required"))
    assert not matches(chatml_tokenizer, forced, '{"city": "Rome", "n": 1}')  # the forced call wins


def test_schemas_with_refs_and_odd_names_compile(chatml_tokenizer) -> None:
    nested = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
              "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    tool = {"type": "function", "function": {"name": 'say "hi"', "parameters": nested}}
    grammar = grammar_for(request(tools=[tool], tool_choice="required"))
    call = {"name": 'say "hi"', "arguments": {"where": {"city": "Oslo"}}}
    assert matches(chatml_tokenizer, grammar, f"<tool_call>\n{json.dumps(call)}\n</tool_call>")


def test_what_cannot_be_enforced_is_a_400_naming_the_field() -> None:
    bad = {"type": "object", "properties": {"a": {"type": "strin"}}}
    with pytest.raises(ApiError) as caught:
        grammar_for(request(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}))
    assert caught.value.param == "response_format.json_schema.schema" and "strin" in caught.value.message
    strict = {"type": "function", "function": {"name": "f", "strict": True, "parameters": bad}}
    with pytest.raises(ApiError) as caught:
        grammar_for(request(tools=[ADD, strict], tool_choice="required"))
    assert caught.value.param == "tools.1.function.parameters"
    with pytest.raises(ApiError) as caught:
        grammar_for(request(tools=[ADD], tool_choice={"type": "function", "function": {"name": "nope"}}))
    assert caught.value.param == "tool_choice" and "nope" in caught.value.message
    with pytest.raises(ApiError):
        grammar_for(request(tool_choice="required"))  # nothing to choose from


def test_a_non_strict_tool_whose_schema_llguidance_cannot_compile_takes_any_object(chatml_tokenizer) -> None:
    loose = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "strin"}}}}}
    grammar = grammar_for(request(tools=[loose], tool_choice="required"))
    call = '<tool_call>\n{"name": "f", "arguments": {"anything": [1]}}\n</tool_call>'
    assert matches(chatml_tokenizer, grammar, call)


def test_the_engine_mask_leaves_only_what_the_grammar_allows(chatml_tokenizer) -> None:
    tok = chatml_tokenizer
    grammars = Grammars(tok, frozenset({tok.eos_token_id}))
    grammar = grammar_for(request(response_format={"type": "json_object"}))
    [matcher] = asyncio.run(grammars.matchers(grammar, 1))
    free = Row(None, 0, (1,), None, None)  # type: ignore[arg-type]
    held = Row(None, 1, (1,), None, None, matcher=matcher)  # type: ignore[arg-type]
    width = len(tok) + 7  # a head wider than the vocabulary: the extra ids are never allowed
    logits = torch.zeros(2, width)
    grammars.mask(logits, [free, held])
    assert torch.isfinite(logits[0]).all()  # the unconstrained row is untouched
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(tok.decode([i]).startswith("{") for i in allowed)  # an object opens with "{"
    grammars.advance([free, held], [5, allowed[0]])
    assert held.finish is None


def test_matchers_for_a_grammar_seen_before_are_fresh_and_independent(chatml_tokenizer) -> None:
    tok = chatml_tokenizer
    grammars = Grammars(tok, frozenset({tok.eos_token_id}))
    grammar = grammar_for(request(response_format=CITY))
    whole = tok.encode('{"city": "Rome", "n": 1}', add_special_tokens=False)
    first, second = asyncio.run(grammars.matchers(grammar, 2))
    assert first.consume_tokens(tok.encode('{"city": ', add_special_tokens=False))
    [third] = asyncio.run(grammars.matchers(grammar, 1))  # a copy of the kept one: nothing consumed yet
    for matcher in (second, third):  # each starts from the beginning, whatever `first` consumed
        assert matcher.consume_tokens(whole) and matcher.consume_token(tok.eos_token_id)
    assert not first.consume_tokens(whole)  # `first` is past the opening brace
