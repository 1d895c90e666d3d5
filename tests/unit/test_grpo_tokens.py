"""tokenize_trajectory: token-exact sequences against a real ChatML template (tiny local tokenizer)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import CHATML_TEMPLATE, build_chatml_tokenizer

from art_nb.grpo.tokens import tokenize_trajectory
from art_nb.trajectory import Choice, Trajectory

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def char_ids(tokenizer, text: str) -> list[int]:
    """One id per character: a valid but non-canonical tokenisation, as a sampler may produce."""
    return [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]


def make_choice(tokenizer, text: str, *, eos: bool = True, tool_calls=None, send_ids: bool = True) -> Choice:
    ids = char_ids(tokenizer, text) + ([tokenizer.eos_token_id] if eos else [])
    logprobs = [-0.01 * (n + 1) for n in range(len(ids))]
    data = {
        "index": 0,
        "finish_reason": ("tool_calls" if tool_calls else "stop") if eos else "length",
        "message": {"role": "assistant", "content": None if tool_calls else text, "tool_calls": tool_calls},
        "logprobs": {
            "content": [{"token": str(i), "logprob": lp, "bytes": None, "top_logprobs": []} for i, lp in zip(ids, logprobs)]
        },
    }
    if send_ids:
        data["token_ids"] = ids
    return Choice.model_validate(data)


def runs(mask: list[bool], values: list) -> list[list]:
    """Consecutive masked stretches of `values`."""
    out, current = [], []
    for m, v in zip(mask, values):
        if m:
            current.append(v)
        elif current:
            out.append(current)
            current = []
    return out + ([current] if current else [])


def test_two_choices_are_token_exact_and_the_rest_is_the_template(chatml_tokenizer):
    tok = chatml_tokenizer
    first = make_choice(tok, "Two plus two is four.")
    second = make_choice(tok, "Paris is sunny", eos=False)  # cut by max_tokens: no eos sampled
    trajectory = Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is two plus two?"},
            first,
            {"role": "user", "content": "The weather in Paris?"},
            second,
        ]
    )
    out = tokenize_trajectory(tok, trajectory, max_seq_len=4096)

    assert char_ids(tok, "Two plus two is four.") != tok.encode("Two plus two is four.", add_special_tokens=False)
    assert runs(out.assistant_mask, out.input_ids) == [first.model_extra["token_ids"], second.model_extra["token_ids"]]
    expected_lp = [[lp.logprob for lp in c.logprobs.content] for c in (first, second)]
    assert runs(out.assistant_mask, out.engine_logprobs) == expected_lp
    assert all(math.isnan(lp) for lp, m in zip(out.engine_logprobs, out.assistant_mask) if not m)
    rendered = tok.apply_chat_template(trajectory.messages(), tokenize=False)
    assert tok.decode(out.input_ids) == rendered
    # The prompt is what the engine tokenised: the whole generation-prompt render, in one piece.
    prompt = tok.encode(tok.apply_chat_template(trajectory.messages()[:2], add_generation_prompt=True, tokenize=False))
    assert out.input_ids[: len(prompt)] == prompt
    assert out.assistant_mask[len(prompt)] and not out.assistant_mask[len(prompt) - 1]
    assert (out.truncated, out.retokenized_choices, out.template_fallbacks) == (False, 0, 0)
    assert out.input_ids.count(tok.eos_token_id) == rendered.count("<|im_end|>")


def test_tool_calls_and_tool_results(chatml_tokenizer):
    tok = chatml_tokenizer
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    calling = make_choice(tok, call_text, tool_calls=[call])
    answer = make_choice(tok, "It is 21 degrees.")
    trajectory = Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "The weather in Paris?"},
            calling,
            {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21})},
            answer,
        ],
        tools=TOOLS,
    )
    out = tokenize_trajectory(tok, trajectory, max_seq_len=4096)

    rendered = tok.apply_chat_template(trajectory.messages(), tools=TOOLS, tokenize=False)
    assert "# Tools" in rendered and "<|im_start|>tool\n" in rendered
    assert tok.decode(out.input_ids) == rendered
    assert runs(out.assistant_mask, out.input_ids) == [calling.model_extra["token_ids"], answer.model_extra["token_ids"]]


def test_post_processed_choice_does_not_repeat_the_sampled_eos(chatml_tokenizer):
    tok = chatml_tokenizer
    # The model wrote compact JSON; the template re-renders the parsed call with spaces.
    sampled = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    choice = make_choice(tok, sampled, tool_calls=[call])
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "Weather?"}, choice], tools=TOOLS)
    out = tokenize_trajectory(tok, trajectory, max_seq_len=4096)

    text = tok.decode(out.input_ids)
    assert text.endswith(sampled + "<|im_end|>\n")
    assert runs(out.assistant_mask, out.input_ids) == [choice.model_extra["token_ids"]]


def test_choice_without_token_ids_is_retokenised(chatml_tokenizer):
    tok = chatml_tokenizer
    choice = make_choice(tok, "Four.", send_ids=False)
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "Two plus two?"}, choice])
    out = tokenize_trajectory(tok, trajectory, max_seq_len=4096)

    assert out.retokenized_choices == 1
    assert tok.decode(out.input_ids) == tok.apply_chat_template(trajectory.messages(), tokenize=False)
    trained = runs(out.assistant_mask, out.input_ids)
    assert trained == [tok.encode("Four.", add_special_tokens=False) + [tok.eos_token_id]]
    assert all(math.isnan(lp) for lp in out.engine_logprobs)  # unknown: the trainer uses its own


def test_truncation_cuts_at_max_seq_len(chatml_tokenizer):
    tok = chatml_tokenizer
    choice = make_choice(tok, "Two plus two is four, and that is all.")
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "Two plus two?"}, choice])
    full = tokenize_trajectory(tok, trajectory, max_seq_len=4096)
    cut = tokenize_trajectory(tok, trajectory, max_seq_len=len(full.input_ids) - 10)

    assert not full.truncated and cut.truncated
    assert len(cut.input_ids) == len(cut.assistant_mask) == len(cut.engine_logprobs) == len(full.input_ids) - 10
    assert cut.input_ids == full.input_ids[: len(cut.input_ids)]
    assert 0 < cut.trainable_tokens < full.trainable_tokens


def test_trajectory_without_choices_has_nothing_to_train(chatml_tokenizer):
    trajectory = Trajectory(
        messages_and_choices=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    )
    out = tokenize_trajectory(chatml_tokenizer, trajectory, max_seq_len=4096)
    assert out.input_ids and out.trainable_tokens == 0


def test_template_that_rewrites_history_falls_back_without_duplicating_text():
    # Qwen3-style: reasoning of earlier assistant turns is dropped once the conversation moves on.
    content = "{%- if message['content'] -%}{{- message['content'] -}}{%- endif -%}"
    stripping = (
        "{%- if message['content'] -%}{%- if message['role'] == 'assistant' and not loop.last -%}"
        "{{- message['content'].split('</think>')[-1] -}}{%- else -%}{{- message['content'] -}}{%- endif -%}"
        "{%- endif -%}"
    )
    assert content in CHATML_TEMPLATE
    tok = build_chatml_tokenizer(CHATML_TEMPLATE.replace(content, stripping))
    first = make_choice(tok, "<think>two and two</think>Four.")
    second = make_choice(tok, "Sunny.")
    trajectory = Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "Two plus two?"},
            first,
            {"role": "user", "content": "Weather?"},
            second,
        ]
    )
    out = tokenize_trajectory(tok, trajectory, max_seq_len=4096)

    assert out.template_fallbacks == 1
    assert runs(out.assistant_mask, out.input_ids) == [first.model_extra["token_ids"], second.model_extra["token_ids"]]
    head = tok.apply_chat_template(trajectory.messages()[:2], tokenize=False)
    expected = head + "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\nSunny.<|im_end|>\n"
    assert tok.decode(out.input_ids) == expected


@pytest.mark.parametrize("max_seq_len", [1, 5])
def test_truncation_inside_the_prompt_leaves_nothing_trainable(chatml_tokenizer, max_seq_len):
    choice = make_choice(chatml_tokenizer, "Four.")
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "Two plus two?"}, choice])
    out = tokenize_trajectory(chatml_tokenizer, trajectory, max_seq_len=max_seq_len)
    assert out.truncated and len(out.input_ids) == max_seq_len and out.trainable_tokens == 0
