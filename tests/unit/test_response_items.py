"""Responses API items <-> chat messages (art_nb.response_items): what the endpoint renders for a
Responses request and what capture reads back from one, checked item by item, with the items the
openai SDK's own types produce (`model_dump`, as the Agents SDK sends a previous turn back)."""

from __future__ import annotations

import pytest
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

from art_nb.response_items import ItemError, assistant_message, chat_tools, input_messages


def _output() -> list[dict]:
    """A reply as the SDK's types hold it: some text, then two calls; dumped as the Agents SDK sends it back."""
    text = ResponseOutputText(type="output_text", text="Checking both.", annotations=[], logprobs=[])
    items = [ResponseOutputMessage(id="msg_1", type="message", role="assistant", status="completed", content=[text]),
             ResponseFunctionToolCall(id="fc_1", type="function_call", call_id="call_a", name="weather",
                                      arguments='{"city": "Paris"}', status="completed"),
             ResponseFunctionToolCall(id="fc_2", type="function_call", call_id="call_b", name="weather",
                                      arguments='{"city": "Lima"}', status="completed")]
    return [item.model_dump(exclude_unset=True) for item in items]


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    assert input_messages("hi", "be brief") == [{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": "hi"}]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


def test_a_reply_sent_back_maps_onto_one_assistant_message_with_its_calls() -> None:
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                                         "text": "Paris and Lima?"}]},
             *_output(),
             {"type": "function_call_output", "call_id": "call_a", "output": "21 C"},
             {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "18 C"}]},
             {"type": "message", "role": "developer", "content": "answer in one line"}]
    assert input_messages(items) == [
        {"role": "user", "content": "Weather in Paris and Lima?"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Lima"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call_b", "content": "18 C"},
        {"role": "developer", "content": "answer in one line"},
    ]
    # The same assistant message capture reads out of the Response's output
    assert assistant_message(_output()) == input_messages(_output())[0]


def test_calls_without_text_start_an_assistant_message_of_their_own() -> None:
    calls = _output()[1:]
    messages = input_messages([{"role": "user", "content": "q"}, *calls])
    assert messages[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Lima"}'}}]}
    assert assistant_message(calls) == messages[1]
    assert assistant_message([]) == {"role": "assistant", "content": None}


@pytest.mark.parametrize(("items", "param", "words"), [
    ([{"type": "web_search_call", "id": "ws_1", "status": "completed"}], "input[0].type", "web_search_call"),
    ([{"type": "reasoning", "id": "rs_1", "summary": []}], "input[0].type", "reasoning"),
    ([{"type": "item_reference", "id": "msg_1"}], "input[0].type", "item_reference"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}],
     "input[0].content[0]", "input_image"),
    ([{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file", "file_id": "f"}]}],
     "input[0].output[0]", "input_file"),
    ([{"role": "tool", "content": "x"}], "input[0].role", "tool"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id", "call_id"),
    (["hi"], "input[0]", "object"),
])
def test_what_cannot_be_shown_to_the_model_is_named(items: list, param: str, words: str) -> None:
    with pytest.raises(ItemError) as err:
        input_messages(items)
    assert err.value.param == param and words in str(err.value)


def test_function_tools_become_chat_tools_and_hosted_tools_are_named() -> None:
    tool = {"type": "function", "name": "weather", "description": "d", "parameters": {"type": "object"}, "strict": True}
    assert chat_tools([tool]) == [{"type": "function", "function": {
        "name": "weather", "description": "d", "parameters": {"type": "object"}, "strict": True}}]
    for hosted in ({"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["v"]},
                   {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "computer_use_preview"}):
        with pytest.raises(ItemError) as err:
            chat_tools([tool, hosted])
        assert err.value.param == "tools[1].type" and hosted["type"] in str(err.value)
    with pytest.raises(ItemError, match="needs a name"):
        chat_tools([{"type": "function", "parameters": {}}])
