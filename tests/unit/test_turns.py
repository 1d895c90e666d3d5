"""Token-in/token-out (server/turns.py): a turn the endpoint sampled comes back as the ids it sampled.

Each test plays a rollout against the endpoint's own two steps, `render_prompt` (what the engine is
given) and `completion` (the response, which also keeps the turn), with the sampled ids chosen by
the test, so it knows what the next prompt must begin with. `ModelConfig(assistant_turns="rendered")`
is the path every prompt took before: the same assertions fail there, which is what these tests guard.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from chat_templates import QWEN25_TEMPLATE
from conftest import build_chatml_tokenizer, char_ids

from art_nb.capture import CapturedCall
from art_nb.grpo.captured import captured_sequence
from art_nb.local.engines.base import Sample
from art_nb.local.server.pipeline import completion, render_prompt
from art_nb.local.server.prompt import render_whole
from art_nb.local.server.schema import ChatCompletionRequest
from art_nb.local.server.turns import TurnCache, configure, turn_cache

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    from art_nb.local.plan.base_models import TINY_MODEL, resolve_base_model

    try:
        path = resolve_base_model(TINY_MODEL).path
    except RuntimeError as exc:
        pytest.skip(f"the SmolLM2 tokenizer is not available: {exc}")
    return AutoTokenizer.from_pretrained(path)


def _fresh(tokenizer: Any, mode: str = "sampled", template: str | None = None) -> Any:
    """A copy of `tokenizer` (its own turn cache) set to `mode`."""
    import copy

    tokenizer = copy.deepcopy(tokenizer)
    if template is not None:
        tokenizer.chat_template = template
    configure(tokenizer, mode, 1 << 20)
    return tokenizer


def _call(tokenizer: Any, messages: list[dict[str, Any]], sampled: list[int], finish: str = "stop",
          **extra: Any) -> tuple[list[int], dict[str, Any]]:
    """(prompt ids, response body) of one request whose engine samples `sampled`."""
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **extra})
    prompt = render_prompt(tokenizer, req)
    body = completion("m", prompt, [Sample(list(sampled), [-0.5] * len(sampled), finish)], req, tokenizer)
    return prompt, body


def _captured(request: dict[str, Any], prompt: list[int], body: dict[str, Any]) -> CapturedCall:
    choice = body["choices"][0]
    return CapturedCall(model="m", prompt_token_ids=prompt, request=request, choices=[{
        "token_ids": choice["token_ids"], "logprobs": choice["token_logprobs"], "message": choice["message"]}])


@pytest.mark.parametrize("mode", ["sampled", "rendered"])
def test_a_reply_that_retokenises_differently_comes_back_as_sampled(smollm2, mode) -> None:
    """SmolLM2 sampled `ĠB ab`; its text " Bab" re-tokenises as `ĠBab`. The next prompt must hold the
    sampled ids, or the second turn is trained after ids it was not sampled from."""
    tok = _fresh(smollm2, mode)
    b, ab, bab = tok.convert_tokens_to_ids(["ĠB", "ab", "ĠBab"])
    sampled = [b, ab, tok.eos_token_id]
    first = [{"role": "user", "content": "Say a word."}]
    p1, body = _call(tok, first, sampled)
    assert body["choices"][0]["message"]["content"] == " Bab"
    second = [*first, body["choices"][0]["message"], {"role": "user", "content": "Again."}]
    p2, _ = _call(tok, second, [tok.eos_token_id])
    extends = p2[: len(p1) + len(sampled)] == p1 + sampled
    assert extends == (mode == "sampled")  # "rendered" (every prompt before) re-splits the reply
    if mode == "rendered":
        assert bab in p2[len(p1):]
    # What capture then trains: the exact ids, no realignment (template_fallbacks 0), or 1 realignment.
    calls = [_captured({"messages": first}, p1, body), _captured({"messages": second}, p2, {"choices": [
        {"token_ids": [tok.eos_token_id], "token_logprobs": [-0.5], "message": {}}]})]
    seq = captured_sequence(tok, calls)
    assert seq.realigned == (0 if mode == "sampled" else 1)
    assert [i for i, m in zip(seq.input_ids, seq.assistant_mask, strict=True) if m][:3] == sampled


def test_the_tail_after_a_sampled_turn_is_the_templates_text(smollm2) -> None:
    """Stitching changes nothing where the sampled ids are the canonical ones: same ids as a full render,
    and the sampled EOS stands for the template's end-of-turn token (not written twice)."""
    tok = _fresh(smollm2)
    reply = tok.encode(" Paris is sunny.", add_special_tokens=False) + [tok.eos_token_id]
    first = [{"role": "user", "content": "Weather?"}]
    p1, body = _call(tok, first, reply)
    second = [*first, body["choices"][0]["message"], {"role": "user", "content": "Thanks."}]
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": second})
    p2 = render_prompt(tok, req)
    assert p2[: len(p1) + len(reply)] == p1 + reply
    assert p2 == render_whole(tok, req)  # " Paris is sunny." tokenises as sampled: both paths agree
    assert turn_cache(tok).stitched == 1


def test_a_reply_cut_by_a_stop_string_keeps_the_templates_closing(smollm2) -> None:
    tok = _fresh(smollm2)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    reply = tok.encode(" Act: go\nObservation:", add_special_tokens=False)  # no EOS: stopped at "Observation:"
    first = [{"role": "user", "content": "Go."}]
    p1, body = _call(tok, first, reply + tok.encode(" x", add_special_tokens=False), stop=["Observation:"])
    kept = body["choices"][0]["token_ids"]
    assert body["choices"][0]["message"]["content"] == " Act: go\n"
    second = [*first, body["choices"][0]["message"], {"role": "user", "content": "Observation: ok"}]
    p2, _ = _call(tok, second, [tok.eos_token_id])
    assert p2[: len(p1) + len(kept)] == p1 + kept
    assert p2[len(p1) + len(kept)] == end  # the turn is closed by the template, as the engine never closed it


def _qwen_tool_rollout(tok: Any, reserialise: Any) -> tuple[list[int], list[int], list[int]]:
    """Turn 1 samples a compact <tool_call>; the client sends the call back re-serialised, then the result."""
    call_text = '<tool_call>\n{"name":"get_weather","arguments":{"unit":"c","city":"Paris"}}\n</tool_call>'
    sampled = tok.encode(call_text, add_special_tokens=False) + [tok.eos_token_id]
    first = [{"role": "user", "content": "Weather in Paris?"}]
    p1, body = _call(tok, first, sampled, tools=TOOLS)
    message = body["choices"][0]["message"]
    assert message["tool_calls"] and body["choices"][0]["finish_reason"] == "tool_calls"
    call = message["tool_calls"][0]
    back = {"role": "assistant", "content": None, "tool_calls": [{
        **call, "function": {"name": "get_weather", "arguments": reserialise(call["function"]["arguments"])}}]}
    second = [*first, back, {"role": "tool", "tool_call_id": call["id"], "content": "21 C"}]
    p2, _ = _call(tok, second, [tok.eos_token_id], tools=TOOLS)
    return p1, sampled, p2


@pytest.mark.parametrize("reserialise", [
    lambda a: a,
    lambda a: json.dumps(json.loads(a), indent=2, sort_keys=True),  # key order and whitespace changed
    lambda a: json.dumps(dict(reversed(list(json.loads(a).items()))), separators=(",", ":")),
], ids=["as-sent", "sorted-indented", "reordered-compact"])
@pytest.mark.parametrize("mode", ["sampled", "rendered"])
def test_tool_call_arguments_reserialised_by_the_client_still_match(smollm2, mode, reserialise) -> None:
    """Qwen2.5's template re-renders a call with `tojson` (spaces after ':' and ','): every tool-using
    agent's second prompt parted from the first. With sampled turns it extends it exactly."""
    tok = _fresh(smollm2, mode, template=QWEN25_TEMPLATE)
    p1, sampled, p2 = _qwen_tool_rollout(tok, reserialise)
    assert (p2[: len(p1) + len(sampled)] == p1 + sampled) == (mode == "sampled")
    assert "<tool_response>\n21 C\n</tool_response>" in tok.decode(p2[len(p1) + len(sampled):])


def test_two_rollouts_that_wrote_the_same_call_in_different_ids_each_get_their_own(smollm2) -> None:
    """A group's rollouts often write the same call; one may split it differently (Qwen2.5's tokenizer
    under a forced call: "Lima" as `L ima` in 1 of 8). Each client sends its call back with the id it got,
    and each next prompt must hold that rollout's ids, not the last sample kept for the same text."""
    tok = _fresh(smollm2, template=QWEN25_TEMPLATE)
    head = tok.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "', add_special_tokens=False)
    tail = tok.encode('"}}\n</tool_call>', add_special_tokens=False) + [tok.eos_token_id]
    paris = tok.encode("Paris", add_special_tokens=False)
    split = tok.encode("Par", add_special_tokens=False) + tok.encode("is", add_special_tokens=False)
    assert paris != split
    first = [{"role": "user", "content": "Weather in Paris?"}]
    rollouts = [_call(tok, first, head + city + tail, tools=TOOLS) for city in (split, paris)]  # the split one first
    for (p1, body), city in zip(rollouts, (split, paris), strict=True):
        message = body["choices"][0]["message"]
        second = [*first, message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "9 C"}]
        p2, _ = _call(tok, second, [tok.eos_token_id], tools=TOOLS)
        assert p2[: len(p1) + len(head + city + tail)] == p1 + head + city + tail


def test_an_edited_turn_is_rendered(smollm2) -> None:
    tok = _fresh(smollm2)
    first = [{"role": "user", "content": "Say a word."}]
    _call(tok, first, tok.encode(" Hello", add_special_tokens=False) + [tok.eos_token_id])
    edited = {"role": "assistant", "content": "Goodbye"}
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [*first, edited, {"role": "user", "content": "?"}]})
    assert render_prompt(tok, req) == render_whole(tok, req)
    assert (turn_cache(tok).stitched, turn_cache(tok).missed) == (0, 1)


def test_the_last_kept_turn_is_used_when_a_later_one_was_edited(smollm2) -> None:
    tok = _fresh(smollm2)
    first = [{"role": "user", "content": "One."}]
    a = tok.convert_tokens_to_ids(["ĠB", "ab"]) + [tok.eos_token_id]  # re-splits: shows which path ran
    p1, body = _call(tok, first, a)
    second = [*first, body["choices"][0]["message"], {"role": "user", "content": "Two."}]
    _call(tok, second, tok.encode(" Fine", add_special_tokens=False) + [tok.eos_token_id])
    third = [*second, {"role": "assistant", "content": "Edited"}, {"role": "user", "content": "Three."}]
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": third})
    p3 = render_prompt(tok, req)
    assert p3[: len(p1) + len(a)] == p1 + a
    assert "Edited<|im_end|>\n<|im_start|>user\nThree." in tok.decode(p3)


def test_the_choice_the_client_continued_is_the_one_used(smollm2) -> None:
    tok = _fresh(smollm2)
    first = [{"role": "user", "content": "Pick."}]
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": first, "n": 2})
    p1 = render_prompt(tok, req)
    replies = [tok.encode(" Red", add_special_tokens=False) + [2], tok.convert_tokens_to_ids(["ĠB", "ab"]) + [2]]
    body = completion("m", p1, [Sample(r, [-0.5] * len(r), "stop") for r in replies], req, tok)
    second = [*first, body["choices"][1]["message"], {"role": "user", "content": "Why?"}]
    p2, _ = _call(tok, second, [2])
    assert p2[: len(p1) + len(replies[1])] == p1 + replies[1]


def test_a_template_that_hides_assistant_content_falls_back_to_rendering(chatml_tokenizer) -> None:
    hides = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role != 'assistant' %}{{ m.content }}"
             "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = _fresh(build_chatml_tokenizer(hides))
    first = [{"role": "user", "content": "Hi"}]
    _, body = _call(tok, first, char_ids(tok, "Two") + [tok.eos_token_id])
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [*first, body["choices"][0]["message"], {"role": "user", "content": "?"}]})
    assert render_prompt(tok, req) == render_whole(tok, req)
    assert turn_cache(tok).fallbacks == 1


def test_rendered_mode_keeps_nothing(chatml_tokenizer) -> None:
    tok = _fresh(chatml_tokenizer, "rendered")
    assert turn_cache(tok) is None
    _call(tok, [{"role": "user", "content": "Hi"}], char_ids(tok, "Two") + [tok.eos_token_id])


def test_the_cache_is_bounded_by_ids_and_entries_least_recently_used_first() -> None:
    from array import array

    cache = TurnCache(max_tokens=100, max_entries=3)
    prompt = array("i", [7] * 20)  # one request's choices share their prompt
    for key in (b"a", b"b", b"c"):
        cache.put(key, prompt, [1] * 10)
    assert cache.get(b"a") == [7] * 20 + [1] * 10  # a is now the most recently used
    cache.put(b"d", prompt, [2] * 10)  # 4 entries > 3: b goes
    assert cache.get(b"b") is None and cache.get(b"a") is not None
    assert len(cache) == 3 and cache.tokens == 90
    cache.put(b"e", array("i"), [3] * 80)  # 170 ids > 100: the least recently used go until 80 fit
    assert cache.tokens == 80 and cache.get(b"e") == [3] * 80 and len(cache) == 1
    cache.put(b"huge", array("i"), [4] * 101)  # larger than the whole cache: not kept, nothing dropped for it
    assert cache.get(b"huge") is None and cache.get(b"e") is not None


async def test_the_engine_is_given_the_ids_the_response_reports() -> None:
    """Through the app: what the engine receives is the response's `prompt_token_ids` (what capture
    records), and it begins with the previous prompt + the sampled ids, whichever engine serves."""
    import openai

    from art_nb.local.engines.base import GenerationRequest
    from art_nb.local.server import InferenceGate, ServedModel, create_app, start_server

    tok = _fresh(build_chatml_tokenizer())

    class Engine:
        tokenizer, max_context = tok, 4096

        def __init__(self) -> None:
            self.prompts: list[list[int]] = []

        async def generate(self, request: GenerationRequest) -> list[Sample]:
            self.prompts.append(list(request.prompt_ids))
            ids = char_ids(tok, "Two plus two is four.") + [tok.eos_token_id]  # not how the text re-tokenises
            return [Sample(ids, [-0.1] * len(ids), "stop")]

    engine = Engine()

    class Registry:
        def resolve(self, name: str) -> ServedModel:
            return ServedModel(engine, None, name)  # type: ignore[arg-type]

        def list_models(self) -> list[str]:
            return ["agent"]

    server = await start_server(create_app(Registry(), InferenceGate()))
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    try:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is two plus two?"}]
        first = await client.chat.completions.create(model="agent", messages=messages, stream=True)
        chunks = [chunk async for chunk in first]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        p1 = chunks[0].model_extra["prompt_token_ids"]
        c1 = next(c.choices[0].model_extra["token_ids"] for c in chunks if c.choices and c.choices[0].model_extra.get("token_ids"))
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "Sure?"}]
        second = await client.chat.completions.create(model="agent", messages=messages)
        assert engine.prompts == [p1, second.model_extra["prompt_token_ids"]]
        assert engine.prompts[1][: len(p1) + len(c1)] == p1 + c1
    finally:
        await client.close()
        await server.stop()
