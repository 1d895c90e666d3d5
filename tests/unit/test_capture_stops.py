"""Captured rollouts that pass `stop=[...]`: the server cuts the text at the stop string but keeps the
ids up to the one that completed it; the client sends the cut text back. With sampled turns (the
default) the next prompt holds every sampled id, so all of them train. With
`assistant_turns="rendered"` the next prompt renders the cut text: grpo/captured.py ends the trained
segment at the ids inside the kept text (exact: those ids were sampled in that context), and still
refuses any other rewrite. Same scripted server as tests/unit/test_capture.py.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

import art_nb as art
from art_nb.grpo.captured import CaptureRefused, captured_sequence
from art_nb.grpo.tokens import tokenize_trajectory
from tests.unit import test_capture
from tests.unit.test_capture import KEY

pytestmark = pytest.mark.asyncio(loop_scope="module")
server, srv = test_capture.server, test_capture.srv  # its scripted server, as fixtures here


async def stopped_rollout(srv: Any, stop: list[str] | None, edit: bool = False, model: str = "agent") -> None:
    client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    for turn in range(2):
        done = await client.chat.completions.create(model=model, messages=messages, stop=stop)
        content = done.choices[0].message.content or ""
        if stop is None:  # the client cuts the text itself
            content = content.split("\n\n")[0]
        if edit:  # the client rewrites what the model wrote
            content = content.upper()
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"again {turn}"}]
    await client.close()


def trained(seq: Any) -> tuple[list[int], list[float]]:
    pairs = [(i, lp) for i, lp, m in zip(seq.input_ids, seq.engine_logprobs, seq.assistant_mask) if m]
    return [i for i, _ in pairs], [lp for _, lp in pairs]


@pytest.mark.parametrize("stop", ["\n\n", "ly 1"])  # at a token boundary, and inside the first word's token(s)
async def test_a_reply_cut_at_a_stop_string_comes_back_whole_with_sampled_turns(srv: Any, stop: str) -> None:
    srv.engines["agent"].script = lambda prompt: f"reply {prompt.count('<|im_start|>user')}\n\nscratch work"
    t = await art.trajectory(stopped_rollout(srv, [stop]))
    tok = srv.engines["agent"].tokenizer
    first, last = t.exchanges[0].choices[0], t.exchanges[1].choices[0]
    assert stop in tok.decode(first.token_ids) and stop not in first.message["content"]
    seq = captured_sequence(tok, t.exchanges)
    assert (seq.stop_trimmed, seq.realigned) == (0, 0)  # the next prompt holds every id sampled
    assert trained(seq) == (first.token_ids + last.token_ids, first.logprobs + last.logprobs)  # type: ignore[operator]
    assert seq.input_ids == t.exchanges[1].prompt_token_ids + last.token_ids


@pytest.mark.parametrize("stop", ["\n\n", "ly 1"])  # at a token boundary, and inside the first word's token(s)
async def test_a_reply_cut_at_a_stop_string_trains_up_to_the_kept_text_when_rendered(srv: Any, stop: str) -> None:
    srv.engines["agent-rendered"].script = lambda prompt: f"reply {prompt.count('<|im_start|>user')}\n\nscratch work"
    t = await art.trajectory(stopped_rollout(srv, [stop], model="agent-rendered"))
    tok = srv.engines["agent-rendered"].tokenizer
    first, last = t.exchanges[0].choices[0], t.exchanges[1].choices[0]
    kept = first.message["content"]
    assert kept == "reply 1\n\nscratch work".split(stop)[0] and stop in tok.decode(first.token_ids)
    seq = captured_sequence(tok, t.exchanges)
    assert seq.stop_trimmed == 1
    keep = max(n for n in range(len(first.token_ids) + 1) if kept.startswith(tok.decode(first.token_ids[:n])))
    ids, logprobs = trained(seq)
    assert ids == first.token_ids[:keep] + last.token_ids  # every trained id was sampled, in this order
    assert logprobs == first.logprobs[:keep] + last.logprobs  # type: ignore[operator]
    assert keep < len(first.token_ids)  # the ids that spelled the stop string are not trained
    assert seq.input_ids == t.exchanges[1].prompt_token_ids + last.token_ids  # the context is the server's
    at = len(t.exchanges[0].prompt_token_ids)
    assert seq.input_ids[at: at + keep] == first.token_ids[:keep]  # each sampled id where it was sampled
    assert tokenize_trajectory(tok, t, 10_000).retokenized_choices == 0


async def test_an_edit_inside_the_kept_text_is_still_refused_and_says_so(srv: Any) -> None:
    srv.engines["agent"].script = lambda prompt: "reply\n\nscratch"
    t = await art.trajectory(stopped_rollout(srv, ["\n\n"], edit=True))
    with pytest.raises(CaptureRefused, match="(?s)does not extend.*Call 0 asked for stop strings.*changed the kept"):
        captured_sequence(srv.engines["agent"].tokenizer, t.exchanges)


async def test_text_cut_by_the_client_without_a_stop_request_is_refused(srv: Any) -> None:
    srv.engines["agent"].script = lambda prompt: "reply\n\nscratch"
    t = await art.trajectory(stopped_rollout(srv, None))
    with pytest.raises(CaptureRefused, match="does not extend") as refused:
        captured_sequence(srv.engines["agent"].tokenizer, t.exchanges)
    assert "stop strings" not in str(refused.value)


async def test_several_identical_choices_cut_at_a_stop_are_one_history(srv: Any) -> None:
    srv.engines["agent"].script = lambda prompt: "same\n\nscratch"
    client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0)

    async def rollout() -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        done = await client.chat.completions.create(model="agent", messages=messages, stop=["\n\n"], n=2)
        messages += [{"role": "assistant", "content": done.choices[1].message.content},
                     {"role": "user", "content": "go on"}]
        await client.chat.completions.create(model="agent", messages=messages, stop=["\n\n"])

    t = await art.trajectory(rollout())
    await client.close()
    # Both choices sampled the same ids, so either is the history the next call continued.
    first, second = t.exchanges
    assert first.choices[0].token_ids == first.choices[1].token_ids
    seq = captured_sequence(srv.engines["agent"].tokenizer, t.exchanges)
    assert seq.input_ids == second.prompt_token_ids + second.choices[0].token_ids
