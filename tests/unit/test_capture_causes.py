"""A captured history that does not extend parts: the calls before the parting call and those from it on
train as two sequences, each exactly as sampled, and the second says why with the cause the requests
show: a swapped system prompt (smolagents' final-answer call), a reply sent back changed (smolagents'
CodeAgent closing tag, its ToolCallingAgent's "Calling tools:" text), or, where the client sent the
reply back as it got it, the general causes (a template that rewrites turns). Asked for one sequence
(`captured_sequence`), the same text is the refusal."""

from __future__ import annotations

from typing import Any

import pytest

from art_nb.capture import CapturedCall, CapturedChoice
from art_nb.grpo.captured import CaptureRefused, captured_sequence, captured_sequences
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
    """Why the last call parts the history, after checking that each part is exactly its calls as sampled
    and that asking for one sequence is refused with the same text."""
    parts = captured_sequences(tok, calls)
    assert len(parts) == 2 and parts[0].parted is None and parts[1].parted
    for part, piece in zip(parts, (calls[:-1], calls[-1:]), strict=True):
        expected, trained = [], []
        for c in piece:  # these calls extend each other: the part is their prompts' new tails and samples
            expected += c.prompt_token_ids[len(expected):] + c.choices[0].token_ids
            trained += c.choices[0].token_ids
        assert part.input_ids == expected
        assert [i for i, m in zip(part.input_ids, part.assistant_mask, strict=True) if m] == trained
    with pytest.raises(CaptureRefused) as refused:
        captured_sequence(tok, calls)
    assert str(refused.value) == parts[1].parted
    return parts[1].parted


def test_a_swapped_system_prompt_parts_the_history_and_is_named(tok: Any) -> None:
    call0, messages = first(tok)
    swapped = [{"role": "system", "content": [{"type": "text", "text": "An agent tried to answer and got stuck."}]},
               *messages[1:], {"role": "assistant", "content": "print(1)"}, {"role": "user", "content": "Answer now."}]
    message = refusal(tok, [call0, call(tok, swapped, {"content": "sunny"}, "sunny")])
    assert "Cause: the agent swapped its system prompt: call 1 was sent under another system prompt than call 0" in message
    assert "'An agent tried to answer and got stuck.'" in message and "provide_final_answer" in message
    assert "with art.no_capture():" in message and "trains the calls from call 1 on as a sequence of their own" in message


def test_a_reply_sent_back_with_text_appended_parts_the_history_and_is_named(tok: Any) -> None:
    call0, messages = first(tok)  # CodeAgent: "print(1)" comes back as "print(1)</code>"
    edited = [*messages, {"role": "assistant", "content": [{"type": "text", "text": "print(1)</code>"}]},
              {"role": "user", "content": "Observation: 1"}]
    message = refusal(tok, [call0, call(tok, edited, {"content": "done"}, "done")])
    assert "Cause: the agent sent call 0's reply back changed" in message and "closing code tag" in message
    assert "print(1)</code>" in message  # the excerpt shows where they part


def test_a_tool_call_sent_back_as_text_parts_the_history_and_is_named(tok: Any) -> None:
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
    assert "Cause:" not in message and "Usual cause:" in message


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


def test_a_history_that_extends_is_one_sequence(tok: Any) -> None:
    call0, messages = first(tok)
    following = [*messages, {"role": "assistant", "content": "print(1)"}, {"role": "user", "content": "Observation: 1"}]
    call1 = call(tok, following, {"content": "done"}, "done")
    [seq] = captured_sequences(tok, [call0, call1])
    assert seq.parted is None and captured_sequence(tok, [call0, call1]) == seq
    assert seq.input_ids[: len(call0.prompt_token_ids)] == call0.prompt_token_ids
    assert sum(seq.assistant_mask) == len(call0.choices[0].token_ids) + len(call1.choices[0].token_ids)


def _swapped_then_followed(tok: Any) -> list[CapturedCall]:
    """smolagents' shape: a step, the final-answer call under its own system prompt, and a call after it
    that extends that one."""
    call0, messages = first(tok)
    swapped = [{"role": "system", "content": "Answer now."}, *messages[1:], {"role": "assistant", "content": "print(1)"}]
    call1 = call(tok, swapped, {"content": "sunny"}, "sunny")
    call2 = call(tok, [*swapped, {"role": "assistant", "content": "sunny"}, {"role": "user", "content": "Sure?"}],
                 {"content": "yes"}, "yes")
    return [call0, call1, call2]


def test_the_calls_after_a_parting_extend_the_new_part(tok: Any) -> None:
    calls = _swapped_then_followed(tok)
    first_part, second = captured_sequences(tok, calls)
    assert first_part.input_ids == calls[0].prompt_token_ids + calls[0].choices[0].token_ids
    assert second.input_ids[: len(calls[1].prompt_token_ids)] == calls[1].prompt_token_ids
    assert second.input_ids[-len(calls[2].choices[0].token_ids):] == calls[2].choices[0].token_ids
    assert "captured call 1's prompt" in (second.parted or "")
    trained = [lp for part in (first_part, second) for lp, m in zip(part.engine_logprobs, part.assistant_mask) if m]
    assert trained == [-0.5] * sum(len(c.choices[0].token_ids) for c in calls)  # every sample once, as the engine gave it


def test_a_train_step_gives_every_part_the_trajectorys_advantage(tok: Any) -> None:
    import art_nb as art
    from art_nb.grpo.advantages import prepare_batch

    parted = art.Trajectory(exchanges=_swapped_then_followed(tok), reward=1.0)
    whole = art.Trajectory(exchanges=[first(tok)[0]], reward=0.0)
    batch = prepare_batch([art.TrajectoryGroup([parted, whole])], tok, art.TrainConfig(), max_seq_len=10_000)
    assert [item.advantage for item in batch.items] == pytest.approx([1.0, 1.0, -1.0], abs=1e-5)
    assert [item.parted is not None for item in batch.items] == [False, True, False]
    assert batch.parted_histories == 1 and batch.metrics()["parted_histories"] == 1.0


def test_a_stop_string_written_back_over_other_ids_parts_the_history_instead_of_realigning(tok: Any) -> None:
    """CodeAgent's shape: the reply is cut at its stop string "</code>", the agent writes the tag back, and
    the text still extends the history; but the ids the model sampled (here one per character) are not the
    ones the next prompt holds, so lining them up by text would train the next reply after ids it never
    saw. The history parts there: both replies train after exactly their prompts."""
    call0, messages = first(tok)
    by_chars = [i for ch in "print(1)</code>" for i in tok.encode(ch, add_special_tokens=False)]
    call0.choices = [CapturedChoice(token_ids=by_chars, logprobs=[-0.5] * len(by_chars),
                                    message={"role": "assistant", "content": "print(1)"})]
    call0.request = {**call0.request, "stop": ["</code>"]}
    written_back = [*messages, {"role": "assistant", "content": "print(1)</code>"}, {"role": "user", "content": "1"}]
    call1 = call(tok, written_back, {"content": "done"}, "done")
    assert tok.decode(call1.prompt_token_ids).startswith(tok.decode(call0.prompt_token_ids + by_chars))
    first_part, second = captured_sequences(tok, [call0, call1])
    assert first_part.input_ids == call0.prompt_token_ids + by_chars and first_part.realigned == 0
    assert second.input_ids[: len(call1.prompt_token_ids)] == call1.prompt_token_ids and second.realigned == 0
    assert "Cause: the agent sent call 0's reply back changed" in (second.parted or "")
