"""A captured history that does not extend is refused with the cause the requests show: a swapped system
prompt (smolagents' final-answer call), a reply sent back changed (smolagents' CodeAgent closing tag, its
ToolCallingAgent's "Calling tools:" text), or, where the client sent the reply back as it got it, the
general causes (a template that rewrites turns)."""

from __future__ import annotations

from typing import Any

import pytest

from art_nb.capture import CapturedCall, CapturedChoice
from art_nb.grpo.captured import CaptureRefused, captured_sequence
from tests.conftest import build_chatml_tokenizer

SYSTEM, QUESTION = "You solve tasks with code.", "Weather in Paris?"


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_chatml_tokenizer()


def call(tok: Any, messages: list[dict[str, Any]], reply: dict[str, Any], reply_text: str) -> CapturedCall:
    """A call as capture records it: the request as sent, the prompt as the template renders it (parts
    of text as one string), the reply's ids with EOS."""
    flat = [{**m, "content": "".join(p["text"] for p in m["content"]) if isinstance(m["content"], list) else m["content"]}
            for m in messages]
    prompt = tok.encode(tok.apply_chat_template(flat, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    sampled = tok.encode(reply_text, add_special_tokens=False) + [tok.eos_token_id]
    return CapturedCall(model="agent", prompt_token_ids=prompt, request={"messages": messages},
                        choices=[CapturedChoice(token_ids=sampled, logprobs=[-0.5] * len(sampled),
                                                message={"role": "assistant", **reply})])


def first(tok: Any, reply: dict[str, Any] | None = None, text: str = "print(1)") -> tuple[CapturedCall, list[dict[str, Any]]]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    return call(tok, messages, reply or {"content": text}, text), messages


def refusal(tok: Any, calls: list[CapturedCall]) -> str:
    with pytest.raises(CaptureRefused) as refused:
        captured_sequence(tok, calls)
    return str(refused.value)


def test_a_swapped_system_prompt_is_named(tok: Any) -> None:
    call0, messages = first(tok)
    swapped = [{"role": "system", "content": [{"type": "text", "text": "An agent tried to answer and got stuck."}]},
               *messages[1:], {"role": "assistant", "content": "print(1)"}, {"role": "user", "content": "Answer now."}]
    message = refusal(tok, [call0, call(tok, swapped, {"content": "sunny"}, "sunny")])
    assert "Cause: the agent swapped its system prompt: call 1 was sent under another system prompt than call 0" in message
    assert "'An agent tried to answer and got stuck.'" in message and "provide_final_answer" in message
    assert "with art.no_capture():" in message and "trajectory.exchanges[:1]" in message


def test_a_reply_sent_back_with_text_appended_is_named(tok: Any) -> None:
    call0, messages = first(tok)  # CodeAgent: "print(1)" comes back as "print(1)</code>"
    edited = [*messages, {"role": "assistant", "content": [{"type": "text", "text": "print(1)</code>"}]},
              {"role": "user", "content": "Observation: 1"}]
    message = refusal(tok, [call0, call(tok, edited, {"content": "done"}, "done")])
    assert "Cause: the agent sent call 0's reply back changed" in message and "closing code tag" in message
    assert "print(1)</code>" in message  # the excerpt shows where they part


def test_a_tool_call_sent_back_as_text_is_named(tok: Any) -> None:
    sampled = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    tool_calls = [{"id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    call0, messages = first(tok, {"content": None, "tool_calls": tool_calls}, sampled)
    rewritten = [*messages, {"role": "assistant", "content": "Calling tools:\n[{'id': 'call_1', 'type': 'function'}]"},
                 {"role": "user", "content": "Observation: sunny"}]
    message = refusal(tok, [call0, call(tok, rewritten, {"content": "sunny"}, "sunny")])
    assert "Cause: the agent sent call 0's reply back changed" in message and "Calling tools:" in message


def test_a_reply_sent_back_unchanged_keeps_the_general_causes(tok: Any) -> None:
    """The client sent the reply back as it got it (key order and spacing of the call's arguments
    aside), and the prompt still parts inside it: a template rewrote it, which the requests cannot show."""
    tool_calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": 2}'}}]
    call0, messages = first(tok, {"content": "thinking", "tool_calls": tool_calls}, "<think>x</think>thinking")
    resent = [*messages, {"role": "assistant", "content": " thinking ", "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "f", "arguments": '{"b":2,"a":1}'}}]},
        {"role": "user", "content": "more"}]
    message = refusal(tok, [call0, call(tok, resent, {"content": "ok"}, "ok")])
    assert "Cause:" not in message and "Usual cause:" in message and "trajectory.exchanges[1:]" in message


def test_a_responses_call_is_not_judged_by_messages_it_does_not_carry(tok: Any) -> None:
    """A Responses request carries `input` items (or a `previous_response_id`), not `messages`: its
    reply cannot be looked for there, so the general causes stand; `instructions` is its system prompt."""
    call0, messages = first(tok)
    edited = [*messages, {"role": "assistant", "content": "print(1)</code>"}, {"role": "user", "content": "1"}]
    call1 = call(tok, edited, {"content": "done"}, "done")
    call0.request = {"instructions": SYSTEM, "input": "Weather in Paris?"}
    call1.request = {"instructions": SYSTEM, "previous_response_id": "resp_1", "input": "1"}
    assert "Cause:" not in refusal(tok, [call0, call1])
    call1.request = {"instructions": "Another prompt.", "input": "1"}
    swapped = [{"role": "system", "content": "Another prompt."}, *edited[1:]]
    call1.prompt_token_ids = call(tok, swapped, {"content": "done"}, "done").prompt_token_ids
    assert "Cause: the agent swapped its system prompt" in refusal(tok, [call0, call1])


def test_a_history_that_extends_still_trains(tok: Any) -> None:
    call0, messages = first(tok)
    following = [*messages, {"role": "assistant", "content": "print(1)"}, {"role": "user", "content": "Observation: 1"}]
    call1 = call(tok, following, {"content": "done"}, "done")
    seq = captured_sequence(tok, [call0, call1])
    assert seq.input_ids[: len(call0.prompt_token_ids)] == call0.prompt_token_ids
    assert sum(seq.assistant_mask) == len(call0.choices[0].token_ids) + len(call1.choices[0].token_ids)
