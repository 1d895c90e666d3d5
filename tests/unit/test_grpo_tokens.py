"""tokenize_trajectory: token-exact sequences against a real ChatML template (tiny local tokenizer)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import CHATML_TEMPLATE, build_chatml_tokenizer, char_ids, make_choice

from art_nb.grpo.tokens import tokenize_trajectory
from art_nb.trajectories import Trajectory, template_message

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def sampled(*choices) -> list[list[int]]:
    return [c.model_extra["token_ids"] for c in choices]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def render(tokenizer, messages, generation_prompt: bool = False, tools=None) -> str:
    """The reference: the template's own render of the conversation, as the server renders it."""
    return tokenizer.apply_chat_template(
        [template_message(m) for m in messages], tools=tools, add_generation_prompt=generation_prompt, tokenize=False
    )


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

    assert char_ids(tok, "Two plus two is four.") != encode(tok, "Two plus two is four.")  # not canonical
    assert runs(out.assistant_mask, out.input_ids) == sampled(first, second)
    expected_lp = [[lp.logprob for lp in c.logprobs.content] for c in (first, second)]
    assert runs(out.assistant_mask, out.engine_logprobs) == expected_lp
    assert all(math.isnan(lp) for lp, m in zip(out.engine_logprobs, out.assistant_mask) if not m)
    rendered = render(tok, trajectory.messages())
    assert tok.decode(out.input_ids) == rendered
    # The prompt is what the engine tokenised: the whole generation-prompt render, in one piece.
    prompt = encode(tok, render(tok, trajectory.messages()[:2], generation_prompt=True))
    assert out.input_ids[: len(prompt)] == prompt
    assert out.assistant_mask[len(prompt)] and not out.assistant_mask[len(prompt) - 1]
    assert (out.truncated, out.retokenized_choices, out.template_fallbacks) == (False, 0, 0)
    assert out.input_ids.count(tok.eos_token_id) == rendered.count("<|im_end|>")


def test_tool_calls_and_tool_results(chatml_tokenizer):
    tok = chatml_tokenizer
    function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    call = {"id": "call_1", "type": "function", "function": function}
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

    rendered = render(tok, trajectory.messages(), tools=TOOLS)
    assert "# Tools" in rendered and "<|im_start|>tool\n" in rendered
    assert tok.decode(out.input_ids) == rendered
    assert runs(out.assistant_mask, out.input_ids) == sampled(calling, answer)


def test_post_processed_choice_does_not_repeat_the_sampled_eos(chatml_tokenizer):
    tok = chatml_tokenizer
    # The model wrote compact JSON; the template re-renders the parsed call with spaces.
    compact = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    call = {"id": "c", "type": "function", "function": function}
    choice = make_choice(tok, compact, tool_calls=[call])
    trajectory = Trajectory(
        messages_and_choices=[{"role": "user", "content": "Weather?"}, choice], tools=TOOLS
    )
    out = tokenize_trajectory(tok, trajectory, max_seq_len=4096)

    text = tok.decode(out.input_ids)
    assert text.endswith(compact + "<|im_end|>\n")
    assert runs(out.assistant_mask, out.input_ids) == sampled(choice)


def test_choice_without_token_ids_is_retokenised(chatml_tokenizer):
    tok = chatml_tokenizer
    choice = make_choice(tok, "Four.", send_ids=False)
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "Two plus two?"}, choice])
    out = tokenize_trajectory(tok, trajectory, max_seq_len=4096)

    assert out.retokenized_choices == 1
    assert tok.decode(out.input_ids) == render(tok, trajectory.messages())
    trained = runs(out.assistant_mask, out.input_ids)
    assert trained == [encode(tok, "Four.") + [tok.eos_token_id]]
    assert all(math.isnan(lp) for lp in out.engine_logprobs)  # unknown: the trainer uses its own


def test_truncation_cuts_at_max_seq_len(chatml_tokenizer):
    tok = chatml_tokenizer
    choice = make_choice(tok, "Two plus two is four, and that is all.")
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "Two plus two?"}, choice])
    full = tokenize_trajectory(tok, trajectory, max_seq_len=4096)
    cut = tokenize_trajectory(tok, trajectory, max_seq_len=len(full.input_ids) - 10)

    assert not full.truncated and cut.truncated
    assert len(cut.input_ids) == len(full.input_ids) - 10
    assert len(cut.assistant_mask) == len(cut.engine_logprobs) == len(cut.input_ids)
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
    assert runs(out.assistant_mask, out.input_ids) == sampled(first, second)
    head = render(tok, trajectory.messages()[:2])
    expected = head + "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\nSunny.<|im_end|>\n"
    assert tok.decode(out.input_ids) == expected


@pytest.mark.parametrize("max_seq_len", [1, 5])
def test_truncation_inside_the_prompt_leaves_nothing_trainable(chatml_tokenizer, max_seq_len):
    choice = make_choice(chatml_tokenizer, "Four.")
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "Two plus two?"}, choice])
    out = tokenize_trajectory(chatml_tokenizer, trajectory, max_seq_len=max_seq_len)
    assert out.truncated and len(out.input_ids) == max_seq_len and out.trainable_tokens == 0
