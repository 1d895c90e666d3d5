"""HFEngine's prefix cache is exact: every output with it equals the output without it.

Two engines on the same tiny random Llama (tests/faults/tiny.py), one with the cache and one with it
off, get the same requests: multi-turn conversations, games of a group sharing a first prompt, a
next turn joining a running batch (left padding), cached and uncached prompts in one prefill,
adapters loaded, replaced and unloaded. Greedy tokens must be equal and logprobs equal to float
rounding; `stats` must show the cache worked. A tiny Qwen2 with sliding-window attention (a mask
that depends on distances) checks the prefill layout against a plain full forward.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from engine_cases import random_lora
from faults.tiny import build_tiny_model

from art_nb.config import ModelConfig
from art_nb.local.engines.base import GenerationRequest, Sample, SamplingParams
from art_nb.local.engines.hf.engine import EngineStats, HFEngine

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CONFIG = ModelConfig(max_seq_len=512, max_batch_size=16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-prefix"))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engines(model_dir: Path):
    on = await HFEngine.create(model_dir, CONFIG)
    off = await HFEngine.create(model_dir, CONFIG, prefix_cache_bytes=0)
    yield on, off
    await on.close()
    await off.close()


def user(n: int, seed: int) -> list[int]:
    """A user turn: `n` token ids, different per seed (the ids are what matters, not their text)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 300, (n,), generator=generator).tolist()


async def both(engines: tuple[HFEngine, HFEngine], prompt: list[int], params: SamplingParams = GREEDY,
               adapter: str | None = None) -> Sample:
    """The cached engine's sample for `prompt`, after checking it equals the uncached engine's."""
    on, off = engines
    [a], [b] = await asyncio.gather(on.generate(GenerationRequest(prompt, params, adapter)),
                                    off.generate(GenerationRequest(prompt, params, adapter)))
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    return a


def reset(*engines: HFEngine) -> None:
    for engine in engines:
        engine.stats = EngineStats()
        engine.prefix_cache.clear()


async def test_a_conversation_prefills_only_each_turns_new_tokens(engines) -> None:
    on, off = engines
    reset(on, off)
    prompt = user(40, seed=0)
    for turn in range(6):
        sample = await both(engines, prompt)
        prompt = prompt + sample.token_ids + user(12, seed=turn + 1)
    assert on.stats.prefills == off.stats.prefills == 6
    assert on.stats.prefix_hits == 5 and off.stats.prefix_hits == 0
    # each later turn reuses everything up to the previous reply's last token, which was sampled, never fed
    assert on.stats.prefilled_tokens == 40 + 5 * (1 + 12)
    assert on.stats.prefilled_tokens + on.stats.reused_tokens == off.stats.prefilled_tokens
    assert len(on.prefix_cache) == 1  # each turn's entry replaced the one before it


async def test_games_of_a_group_share_their_first_prompt(engines) -> None:
    on, off = engines
    reset(on, off)
    first = user(60, seed=10)
    await both(engines, first)  # one game starts
    assert on.stats.prefix_hits == 0
    samples = [await both(engines, first) for _ in range(3)]  # the others start later: their prompt is cached
    assert on.stats.prefix_hits == 3 and on.stats.reused_tokens == 3 * 59
    # each game goes on with its own opponent move, all at once: each reuses the shared prompt and the reply
    reset(on, off)
    nexts = [first + s.token_ids + user(10, seed=20 + g) for g, s in enumerate(samples)]
    await both(engines, first)  # the cache now holds first + reply
    await asyncio.gather(*(both(engines, p) for p in nexts))
    assert on.stats.prefix_hits == 3 and on.stats.reused_tokens == 3 * (60 + 8 - 1)


async def test_n_samples_of_a_cached_prompt_equal_the_uncached_ones(engines) -> None:
    on, off = engines
    reset(on, off)
    prompt = user(50, seed=30)
    await both(engines, prompt)
    params = SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=7, ignore_eos=True)
    a = await on.generate(GenerationRequest(prompt + user(5, seed=31), params))
    b = await off.generate(GenerationRequest(prompt + user(5, seed=31), params))
    assert on.stats.prefix_hits == 1
    assert [s.token_ids for s in a] == [s.token_ids for s in b]


async def test_a_next_turn_joins_a_running_batch_with_left_padding(engines) -> None:
    on, off = engines
    reset(on, off)
    conversation = user(80, seed=40)
    first = await both(engines, conversation)
    next_turn = conversation + first.token_ids + user(9, seed=41)
    long_params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    long_prompt = user(20, seed=42)  # shorter than the conversation: one of the two caches is left-padded
    [long_alone] = await off.generate(GenerationRequest(long_prompt, long_params))
    [turn_alone] = await off.generate(GenerationRequest(next_turn, GREEDY))

    on.stats = EngineStats()
    long_task = asyncio.create_task(on.generate(GenerationRequest(long_prompt, long_params)))
    while on.stats.steps < 5:
        await asyncio.sleep(0.005)
    [turn_joined] = await on.generate(GenerationRequest(next_turn, GREEDY))
    assert not long_task.done()
    [long_joined] = await long_task
    assert on.stats.batches == 2 and on.stats.max_batch_size == 2 and on.stats.prefix_hits == 1
    assert turn_joined.token_ids == turn_alone.token_ids and long_joined.token_ids == long_alone.token_ids
    torch.testing.assert_close(torch.tensor(turn_joined.logprobs), torch.tensor(turn_alone.logprobs), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(long_joined.logprobs), torch.tensor(long_alone.logprobs), atol=1e-5, rtol=0)


async def test_cached_and_uncached_prompts_prefilled_together(engines) -> None:
    on, off = engines
    reset(on, off)
    a, b = user(70, seed=50), user(30, seed=51)
    await both(engines, a)
    await both(engines, b)
    mixed = [a + user(7, seed=52), b + user(15, seed=53), user(25, seed=54), a + user(7, seed=52), user(90, seed=55)]
    on.stats = EngineStats()
    await asyncio.gather(*(both(engines, p) for p in mixed))
    assert on.stats.batches == 1 and on.stats.prefills == 4  # the duplicate prompt ran once
    assert on.stats.prefix_hits == 2


async def test_adapters_have_their_own_entries_and_lose_them_with_their_weights(engines, model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    on, off = engines
    reset(on, off)
    prompt = user(60, seed=60)
    base = await both(engines, prompt)
    for engine in engines:
        await engine.load_adapter("m@1", random_lora(model_dir, tmp_path / "v1", seed=1))
    on.stats = EngineStats()
    tuned = await both(engines, prompt, adapter="m@1")
    assert tuned.token_ids != base.token_ids
    assert on.stats.prefix_hits == 0  # the base entry holds other keys and values
    tuned_next = prompt + tuned.token_ids + user(6, seed=61)
    await both(engines, tuned_next, adapter="m@1")
    assert on.stats.prefix_hits == 1
    entries = len(on.prefix_cache)

    for engine in engines:  # new weights under the same name: nothing cached for the old ones applies
        await engine.load_adapter("m@1", random_lora(model_dir, tmp_path / "v2", seed=2))
    on.stats = EngineStats()
    await both(engines, tuned_next, adapter="m@1")
    assert on.stats.prefix_hits == 0
    assert len(on.prefix_cache) == entries  # v1's entries went with v1, v2's first prompt came in

    for engine in engines:
        await engine.unload_adapter("m@1")
    assert len(on.prefix_cache) == 1  # only the base prompt's entry is left
    assert (await both(engines, prompt)).token_ids == base.token_ids


async def test_a_cancelled_request_is_not_cached_and_moving_the_weights_clears_the_cache(engines) -> None:
    on, _ = engines
    reset(on)
    prompt = user(40, seed=70)
    task = asyncio.create_task(on.generate(GenerationRequest(prompt, SamplingParams(max_tokens=200, ignore_eos=True))))
    while on.stats.steps < 3:
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    [sample] = await on.generate(GenerationRequest(prompt, GREEDY))  # the batch dropped the cancelled row
    assert len(sample.token_ids) == 8
    assert len(on.prefix_cache) == 1 and on.prefix_cache.nbytes > 0  # the prompt + this reply, not the cancelled row
    await on._in_worker(on._move, torch.device("cpu"))  # what sleep does before training on a GPU
    assert len(on.prefix_cache) == 0 and on.prefix_cache.nbytes == 0


def build_sliding_window_model(directory: Path) -> Path:
    """A tiny Qwen2 whose layers all attend to the last 8 positions only, with the tests' ChatML tokenizer."""
    from conftest import build_chatml_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_chatml_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         use_sliding_window=True, sliding_window=8, max_window_layers=0,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         tie_word_embeddings=False)
    assert set(config.layer_types) == {"sliding_attention"}
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def full_forward_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


async def test_sliding_window_attention_sees_the_same_distances(tmp_path: Path) -> None:
    engine = await HFEngine.create(build_sliding_window_model(tmp_path / "sliding"), CONFIG)
    try:
        conversations = [user(30, seed=80), user(45, seed=81)]
        for turn in range(3):
            samples = await asyncio.gather(*(engine.generate(GenerationRequest(c, GREEDY)) for c in conversations))
            for conversation, [sample] in zip(conversations, samples, strict=True):
                expected = full_forward_logprobs(engine._model, conversation, sample.token_ids)
                torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-5, rtol=0)
            # new parts shorter than the window, so the reused keys are among those attended to
            conversations = [c + s.token_ids + user(1 + i, seed=82 + turn) for i, (c, [s]) in
                             enumerate(zip(conversations, samples, strict=True))]
        assert engine.stats.prefix_hits == 4
    finally:
        await engine.close()


async def test_model_config_sets_the_prefix_cache_budget(model_dir: Path):
    """`ModelConfig(prefix_cache_gib=0)` turns the cache off (the user's safety valve); a size sets its budget."""
    off = await HFEngine.create(model_dir, CONFIG.model_copy(update={"prefix_cache_gib": 0}))
    sized = await HFEngine.create(model_dir, CONFIG.model_copy(update={"prefix_cache_gib": 0.25}))
    try:
        assert off.prefix_cache.budget == 0
        assert sized.prefix_cache.budget == 2**28
    finally:
        await off.close()
        await sized.close()
