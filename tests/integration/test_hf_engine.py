"""HFEngine on the real tiny model (SmolLM2-135M-Instruct, CPU): batching, sampling bookkeeping, adapters, errors.

One engine is loaded per module; tests reset `engine.stats` when they assert on it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from art_nb.config import ModelConfig
from art_nb.local.engines.base import (
    ContextTooLongError,
    EngineDeadError,
    EngineError,
    GenerationRequest,
    SamplingParams,
)
from art_nb.local.engines.hf.engine import EngineStats, HFEngine
from art_nb.local.plan.base_models import TINY_MODEL, resolve_base_model
from art_nb.local.plan.choices import Plan

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def model_path() -> Path:
    return resolve_base_model(TINY_MODEL).path


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine(model_path: Path):
    engine = await HFEngine.create(model_path, ModelConfig(max_seq_len=512, max_batch_size=32))
    yield engine
    await engine.close()


def chat(engine: HFEngine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
    )["input_ids"]


def full_forward_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Logprobs of `completion` from one unbatched forward over prompt + completion."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


async def test_greedy_is_deterministic_and_logprobs_match_a_full_forward(engine: HFEngine) -> None:
    prompt = chat(engine, "What is 2+2?")
    [first] = await engine.generate(GenerationRequest(prompt, GREEDY))
    [again] = await engine.generate(GenerationRequest(prompt, GREEDY))
    assert first.token_ids == again.token_ids and len(first.token_ids) > 3
    assert len(first.logprobs) == len(first.token_ids)
    expected = full_forward_logprobs(engine._model, prompt, first.token_ids)
    torch.testing.assert_close(torch.tensor(first.logprobs), expected, atol=1e-4, rtol=0)


async def test_a_chat_reuses_the_previous_turns_keys_and_values_exactly(engine: HFEngine) -> None:
    """Each turn re-renders the conversation through the chat template (the reply as text, as a rollout
    sends it); the prefix cache still finds the earlier turn, and logprobs match a full forward."""
    engine.stats = EngineStats()
    messages = [{"role": "system", "content": "You play a board game. Answer with one move."}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"Board {turn}: X . O / . X . / O . . Your move?"})
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        [sample] = await engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=10, temperature=0.0)))
        expected = full_forward_logprobs(engine._model, prompt, sample.token_ids)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
        messages.append({"role": "assistant", "content": engine.tokenizer.decode(sample.token_ids, skip_special_tokens=True)})
    assert engine.stats.prefix_hits == 3
    assert engine.stats.reused_tokens > 2 * engine.stats.prefilled_tokens  # most of each later prompt came from the cache


async def test_concurrent_requests_share_one_batch(engine: HFEngine) -> None:
    engine.stats = EngineStats()
    prompts = [chat(engine, f"Name a color number {i}.") for i in range(16)]
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    results = await asyncio.gather(*(engine.generate(GenerationRequest(p, params)) for p in prompts))
    assert all(len(samples[0].token_ids) == 8 for samples in results)
    assert engine.stats.batches <= 2
    assert engine.stats.max_batch_size == 16
    assert engine.stats.steps < 16  # decoded together, not one after another


async def test_late_request_joins_the_running_batch_and_padding_changes_nothing(engine: HFEngine) -> None:
    long_prompt, short_prompt = chat(engine, "Tell me a long story about a dragon."), chat(engine, "Hi")
    long_params, short_params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), SamplingParams(max_tokens=4, temperature=0.0)
    [long_alone] = await engine.generate(GenerationRequest(long_prompt, long_params))
    [short_alone] = await engine.generate(GenerationRequest(short_prompt, short_params))

    engine.stats = EngineStats()
    long_task = asyncio.create_task(engine.generate(GenerationRequest(long_prompt, long_params)))
    while engine.stats.steps < 5:
        await asyncio.sleep(0.01)
    [short_joined] = await engine.generate(GenerationRequest(short_prompt, short_params))
    assert not long_task.done()  # answered while the long row was still decoding
    [long_joined] = await long_task

    assert engine.stats.batches == 2 and engine.stats.max_batch_size == 2
    assert long_joined.token_ids == long_alone.token_ids
    assert short_joined.token_ids == short_alone.token_ids
    torch.testing.assert_close(torch.tensor(long_joined.logprobs), torch.tensor(long_alone.logprobs), atol=1e-4, rtol=0)


async def test_max_tokens_ends_with_length(engine: HFEngine) -> None:
    params = SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True, n=3, seed=1)
    samples = await engine.generate(GenerationRequest(chat(engine, "Write a poem."), params))
    assert len(samples) == 3
    assert all(len(s.token_ids) == 5 and s.finish_reason == "length" for s in samples)


async def test_eos_stops_with_stop(engine: HFEngine) -> None:
    [sample] = await engine.generate(GenerationRequest(chat(engine, "What is 2+2?"), SamplingParams(max_tokens=100, temperature=0.0)))
    assert sample.finish_reason == "stop"
    assert sample.token_ids[-1] == engine.tokenizer.eos_token_id  # kept: the trainer learns to stop


async def test_stop_token_and_stop_string_end_the_row_early(engine: HFEngine) -> None:
    prompt = chat(engine, "What is 2+2?")
    [reference] = await engine.generate(GenerationRequest(prompt, GREEDY))
    stop_id = reference.token_ids[2]
    [by_token] = await engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_id,))))
    assert by_token.finish_reason == "stop"
    assert by_token.token_ids == reference.token_ids[: reference.token_ids.index(stop_id) + 1]

    text = engine.tokenizer.decode(reference.token_ids[:4], skip_special_tokens=True)
    stop = text.split()[-1]  # the last word of the first four tokens
    [by_string] = await engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,))))
    assert by_string.finish_reason == "stop"
    assert len(by_string.token_ids) <= 4
    assert stop in engine.tokenizer.decode(by_string.token_ids, skip_special_tokens=True)


async def test_seeded_sampling_does_not_depend_on_batch_neighbours(engine: HFEngine) -> None:
    prompt = chat(engine, "Invent a name for a cat.")
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    [alone] = await engine.generate(GenerationRequest(prompt, params))
    others = [engine.generate(GenerationRequest(chat(engine, f"Say {i}"), SamplingParams(max_tokens=12))) for i in range(5)]
    [crowded], *_ = await asyncio.gather(engine.generate(GenerationRequest(prompt, params)), *others)
    assert crowded.token_ids == alone.token_ids


def random_lora(model_path: Path, out: Path, seed: int):
    """A LoRA adapter with large random B, so greedy output surely changes; returns the peft model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_path), lora).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in peft_model.named_parameters():
            if "lora_B" in name:
                weight.copy_(torch.randn(weight.shape, generator=generator))
    peft_model.save_pretrained(out)
    return peft_model


async def test_adapter_changes_output_and_unloading_restores_base(engine: HFEngine, model_path: Path, tmp_path: Path) -> None:
    peft_model = random_lora(model_path, tmp_path / "lora", seed=0)

    prompt = chat(engine, "What is the capital of France?")
    [base] = await engine.generate(GenerationRequest(prompt, GREEDY))
    await engine.load_adapter("tuned@1", tmp_path / "lora")
    engine.stats = EngineStats()
    [tuned], [base_again] = await asyncio.gather(
        engine.generate(GenerationRequest(prompt, GREEDY, adapter="tuned@1")),
        engine.generate(GenerationRequest(prompt, GREEDY)),
    )
    assert tuned.token_ids != base.token_ids
    expected = full_forward_logprobs(peft_model, prompt, tuned.token_ids)
    torch.testing.assert_close(torch.tensor(tuned.logprobs), expected, atol=1e-4, rtol=0)
    assert base_again.token_ids == base.token_ids  # base rows ran with the adapter disabled
    assert engine.stats.batches == 2  # one adapter per batch

    await engine.unload_adapter("tuned@1")
    with pytest.raises(EngineError, match="no adapter named"):
        await engine.generate(GenerationRequest(prompt, GREEDY, adapter="tuned@1"))
    [after] = await engine.generate(GenerationRequest(prompt, GREEDY))
    assert after.token_ids == base.token_ids


async def test_context_too_long_is_refused_before_queuing(engine: HFEngine) -> None:
    prompt = chat(engine, "hello")
    with pytest.raises(ContextTooLongError, match="exceeds the context"):
        await engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=engine.max_context - len(prompt) + 1)))
    assert engine.max_context == 512


async def test_a_failed_batch_fails_its_requests_and_the_engine_keeps_serving(engine: HFEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    real_step = engine._step

    def broken_step() -> None:
        monkeypatch.setattr(engine, "_step", real_step)  # fail once
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine, "_step", broken_step)
    prompt = chat(engine, "hello")
    results = await asyncio.gather(*(engine.generate(GenerationRequest(prompt, GREEDY)) for _ in range(2)), return_exceptions=True)
    assert all(isinstance(r, EngineError) and "simulated kernel failure" in str(r) for r in results)
    [sample] = await engine.generate(GenerationRequest(prompt, GREEDY))
    assert sample.token_ids


async def test_close_fails_waiting_requests(model_path: Path) -> None:
    engine = await HFEngine.create(model_path, ModelConfig(max_seq_len=256))
    pending = asyncio.create_task(engine.generate(GenerationRequest(chat(engine, "hi"), SamplingParams(max_tokens=200, ignore_eos=True))))
    while engine.stats.steps < 1:
        await asyncio.sleep(0.01)
    await engine.close()
    with pytest.raises(EngineDeadError):
        await pending
    with pytest.raises(EngineDeadError):
        await engine.generate(GenerationRequest(chat(engine, "hi"), GREEDY))


async def test_replacing_an_adapter_keeps_submitted_requests_on_the_old_weights(engine: HFEngine, model_path: Path, tmp_path: Path) -> None:
    random_lora(model_path, tmp_path / "v1", seed=1)
    random_lora(model_path, tmp_path / "v2", seed=2)
    prompt = chat(engine, "Describe the sea.")
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    await engine.load_adapter("m", tmp_path / "v2")
    [v2_alone] = await engine.generate(GenerationRequest(prompt, params, adapter="m"))
    await engine.load_adapter("m", tmp_path / "v1")
    [v1_alone] = await engine.generate(GenerationRequest(prompt, params, adapter="m"))
    assert v1_alone.token_ids != v2_alone.token_ids

    engine.stats = EngineStats()
    in_flight = asyncio.create_task(engine.generate(GenerationRequest(prompt, params, adapter="m")))
    while engine.stats.steps < 3:
        await asyncio.sleep(0.01)
    await engine.load_adapter("m", tmp_path / "v2")  # replaces v1 while a request decodes with it
    [after] = await engine.generate(GenerationRequest(prompt, params, adapter="m"))
    [during] = await in_flight
    assert during.token_ids == v1_alone.token_ids
    assert after.token_ids == v2_alone.token_ids
    await engine.unload_adapter("m")
    assert not engine._adapters.retired
    assert not hasattr(engine._model, "peft_config")  # v1 went when its request ended, v2 on unload: LoRA layers removed


async def test_dtype_and_threads_come_from_the_plan(model_path: Path) -> None:
    """The engine decides neither: a plan for bf16 and two threads gets bf16 weights and a two-thread worker."""
    threads = torch.get_num_threads()
    plan = Plan(device="cpu", dtype="bfloat16", engine="hf", trainer="peft", load_in_4bit=False, cpu_threads=2)
    engine = await HFEngine.create(model_path, ModelConfig(max_seq_len=256, cpu_threads=1), plan)
    try:
        assert next(engine._model.parameters()).dtype == torch.bfloat16
        assert await engine._in_worker(torch.get_num_threads) == 2  # the plan's, not ModelConfig.cpu_threads
        [sample] = await engine.generate(GenerationRequest(chat(engine, "hi"), SamplingParams(max_tokens=4)))
        assert len(sample.token_ids) == len(sample.logprobs) > 0
    finally:
        await engine.close()
        torch.set_num_threads(threads)  # create set this thread's count too


def in_memory(directory: Path):
    """The adapter in `directory` as a train step hands it over: tensors and config, no path."""
    import json

    from safetensors.torch import load_file

    from art_nb.local.engines.base import AdapterWeights

    return AdapterWeights(tensors=load_file(str(directory / "adapter_model.safetensors")),
                          config=json.loads((directory / "adapter_config.json").read_text()))


async def test_a_step_hand_over_refills_the_retired_slot_and_serves_exactly_the_new_weights(
        engine: HFEngine, model_path: Path, tmp_path: Path) -> None:
    """Step N+1's adapter goes into step N-1's retired slot (same config) instead of a new peft slot;
    it must serve what a fresh slot serves, with no KV cached under the old weights reused."""
    for seed in (11, 12, 13):
        random_lora(model_path, tmp_path / f"s{seed}", seed=seed)
    prompt = chat(engine, "Tell me about rivers.")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    await engine.load_adapter("ref@13", tmp_path / "s13")  # from files: a fresh slot, never refilled
    [expected] = await engine.generate(GenerationRequest(prompt, params, adapter="ref@13"))
    await engine.unload_adapter("ref@13")

    await engine.load_adapter("m", tmp_path / "unused-1", weights=in_memory(tmp_path / "s11"))
    first = engine._adapters.lookup("m")
    [old] = await engine.generate(GenerationRequest(prompt, params, adapter="m"))  # caches the prompt's KV under it
    await engine.load_adapter("m", tmp_path / "unused-2", weights=in_memory(tmp_path / "s12"))
    await engine.generate(GenerationRequest(prompt, params))  # a scheduler pass: the retired slot becomes the spare
    assert engine._adapters.spare == first
    await engine.load_adapter("m", tmp_path / "unused-3", weights=in_memory(tmp_path / "s13"))
    assert engine._adapters.lookup("m") == first and engine._adapters.spare is None  # refilled, not new
    [served] = await engine.generate(GenerationRequest(prompt, params, adapter="m"))
    assert served.token_ids == expected.token_ids != old.token_ids
    assert max(abs(a - b) for a, b in zip(served.logprobs, expected.logprobs, strict=True)) < 1e-4

    await engine.unload_adapter("m")
    await engine.generate(GenerationRequest(prompt, params))  # the scheduler deletes what is left
    assert engine._adapters.spare is None and not engine._adapters.retired
    assert not hasattr(engine._model, "peft_config")  # no name bound: no spare kept, LoRA layers removed
