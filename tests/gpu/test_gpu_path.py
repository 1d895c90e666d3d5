"""The product path on a real GPU: vLLM serves, Unsloth trains, in one process, on the real SmolLM2.

In file order (the tests share one backend, like a notebook): start; generate through the OpenAI
endpoint with token ids and logprobs that agree with the trainer's; hot-load adapters; sleep frees
memory and wake restores identical greedy output; a train step while requests arrive; close and
resume from the checkpoint. Measurements land in $ART_NB_GPU_RESULTS/gpu_path.json (conftest.py).
vLLM starts as a user's does (art_nb's default start-up mode, "fast": CUDA graphs for decoding
without torch.compile; ART_NB_VLLM_STARTUP overrides it), so the graphs are tested with LoRA
adapters swapped under them; speed is the benchmarks' business (bench/).
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

import art_nb as art
from art_nb.envs.tic_tac_toe import TicTacToeScenario, rollout
from art_nb.local.engines.base import EngineError, GenerationRequest, SamplingParams

from .conftest import record

pytestmark = pytest.mark.gpu

NAME = "gpu"
PROMPT = [{"role": "user", "content": "Name three colours, separated by commas."}]
GiB = 1024**3


def make_model(model_dir: Path) -> art.TrainableModel:
    return art.TrainableModel(
        name=NAME, project="gpu", base_model=str(model_dir),
        config=art.ModelConfig(engine="vllm", trainer="unsloth", max_seq_len=1024,
                               lora=art.LoraConfig(rank=8, alpha=16)),
    )


# One event loop for the whole module, driven by plain (sync) tests: the GPU machine has pytest but
# not necessarily pytest-asyncio, and the backend, its OpenAI clients and the tests must share a loop.
_LOOP = asyncio.new_event_loop()


def in_loop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        _LOOP.run_until_complete(test(*args, **kwargs))

    return run


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("art")
    backend = art.LocalBackend(path=path)
    model = make_model(model_dir)
    started = time.perf_counter()
    _LOOP.run_until_complete(model.register(backend))
    record("register_s", round(time.perf_counter() - started, 1))
    yield backend, model, path
    _LOOP.run_until_complete(backend.close())


def runtime_state(backend: art.LocalBackend):
    return backend._state(art.Model(name=NAME, project="gpu"))


async def on_backend(backend: art.LocalBackend, coro):
    """Run an engine coroutine on the backend's loop, where the engine lives."""
    return await backend.loop.run(coro)


async def greedy_ids(backend: art.LocalBackend, prompt_ids: list[int], adapter: str | None,
                     tokens: int = 16) -> list[int]:
    engine = runtime_state(backend).engine
    request = GenerationRequest(prompt_ids, SamplingParams(max_tokens=tokens, temperature=0.0), adapter=adapter)
    [sample] = await on_backend(backend, engine.generate(request))
    return sample.token_ids


async def colour_rollout(model: art.TrainableModel, seed: int) -> art.Trajectory:
    """One-turn rollout whose reward varies within any group (so the step always has a signal)."""
    completion = await model.openai_client().chat.completions.create(
        model=NAME, messages=PROMPT, max_tokens=16, temperature=1.0, logprobs=True, seed=seed)
    choice = completion.choices[0]
    text = (choice.message.content or "").lower()
    return art.Trajectory(messages_and_choices=[*PROMPT, choice], reward=float("red" in text) - 0.02 * len(text))


def prompt_ids(backend: art.LocalBackend) -> list[int]:
    tokenizer = runtime_state(backend).engine.tokenizer
    return list(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False))


@in_loop
async def test_engine_and_trainer_start(stack):
    backend, model, _ = stack
    from art_nb.local.engines.vllm.engine import VLLMEngine

    state = runtime_state(backend)
    assert isinstance(state.engine, VLLMEngine)
    assert state.trainer.name == "unsloth"
    record("choices", backend.choices(model))
    record("engine_reasons", state.engine.reasons)


@in_loop
async def test_generation_returns_token_ids_and_raw_logprobs_matching_the_trainer(stack):
    import torch

    from art_nb.grpo.logprobs import token_logprobs

    backend, model, _ = stack
    completion = await model.openai_client().chat.completions.create(
        model=NAME, messages=PROMPT, max_tokens=24, n=4, temperature=0.7, logprobs=True, seed=1)
    prompt = completion.model_extra["prompt_token_ids"]
    trainer = runtime_state(backend).trainer
    gaps = []
    for choice in completion.choices:
        ids = choice.model_extra["token_ids"]
        logprobs = [entry.logprob for entry in choice.logprobs.content]
        assert 0 < len(ids) == len(logprobs) <= 24
        assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs)
        # The trainer's logprobs of the same tokens at temperature 1: if vLLM had returned
        # temperature-scaled (processed) logprobs, these would be far apart.
        input_ids = torch.tensor([prompt + ids], device="cuda")
        with torch.no_grad():
            mine, _ = token_logprobs(trainer.model, input_ids, torch.ones_like(input_ids), 512)
        mine = mine[0, len(prompt) - 1:].float().cpu()
        gaps.append((mine - torch.tensor(logprobs)).abs().mean().item())
    record("engine_vs_trainer_logprob_mean_abs_gap", [round(g, 4) for g in gaps])
    assert max(gaps) < 0.15, gaps


@in_loop
async def test_adapter_hot_load_changes_outputs_and_unload_restores_base(stack, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    backend, model, _ = stack
    engine = runtime_state(backend).engine
    ids = prompt_ids(backend)
    base = await greedy_ids(backend, ids, None)
    zero = backend.checkpoint_dir(model, 0)  # the fresh LoRA: B = 0, the identity

    def random_adapter(seed: int) -> Path:
        weights = load_file(str(zero / "adapter_model.safetensors"))
        generator = torch.Generator().manual_seed(seed)
        for key, value in weights.items():
            if "lora_B" in key:
                weights[key] = (torch.randn(value.shape, generator=generator) * 0.1).to(value.dtype)
        folder = tmp_path / f"random{seed}"
        folder.mkdir()
        save_file(weights, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text((zero / "adapter_config.json").read_text())
        return folder

    started = time.perf_counter()
    await on_backend(backend, engine.load_adapter("probe", random_adapter(1)))
    record("load_adapter_s", round(time.perf_counter() - started, 2))
    first = await greedy_ids(backend, ids, "probe")
    assert first != base
    # Same name, new weights: a fresh LoRA id, so the new weights are served (not vLLM's cached ones).
    await on_backend(backend, engine.load_adapter("probe", random_adapter(2)))
    second = await greedy_ids(backend, ids, "probe")
    assert second != first
    await on_backend(backend, engine.unload_adapter("probe"))
    with pytest.raises(EngineError, match="not loaded"):
        await greedy_ids(backend, ids, "probe")
    assert await greedy_ids(backend, ids, None) == base


@in_loop
async def test_sleep_frees_memory_and_wake_restores_identical_greedy_output(stack):
    import torch

    backend, _, _ = stack
    engine = runtime_state(backend).engine
    ids = prompt_ids(backend)
    before = await greedy_ids(backend, ids, None, tokens=32)
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    started = time.perf_counter()
    await on_backend(backend, engine.sleep())
    slept = time.perf_counter() - started
    free_asleep = torch.cuda.mem_get_info()[0]
    started = time.perf_counter()
    await on_backend(backend, engine.wake())
    woke = time.perf_counter() - started
    free_woken = torch.cuda.mem_get_info()[0]
    after = await greedy_ids(backend, ids, None, tokens=32)
    record("sleep", {"sleep_s": round(slept, 2), "wake_s": round(woke, 2),
                     "freed_gib": round((free_asleep - free_awake) / GiB, 2),
                     "taken_back_gib": round((free_asleep - free_woken) / GiB, 2)})
    assert free_asleep - free_awake > GiB // 2  # at least the KV cache came back
    assert after == before


@in_loop
async def test_train_step_while_requests_arrive(stack):
    from safetensors.torch import load_file

    backend, model, _ = stack
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(colour_rollout(model, 100 * g + i) for i in range(6)) for g in range(4)], pbar_desc=None)
    client = model.openai_client()

    async def served(name: str) -> tuple[list[int], list[float]]:
        completion = await client.chat.completions.create(
            model=name, messages=PROMPT, max_tokens=16, temperature=0, logprobs=True)
        choice = completion.choices[0]
        return choice.model_extra["token_ids"], [entry.logprob for entry in choice.logprobs.content]

    base_ids, base_logprobs = await served(NAME)  # step 0: the base weights
    # Multi-turn games in flight while the step trains: their next turns wait at the gate, then finish.
    during = [asyncio.ensure_future(rollout(model, TicTacToeScenario(seed=900 + i), inference_name=NAME))
              for i in range(8)]
    await asyncio.sleep(0)  # let them reach the server before the step pauses it
    result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
    finished = await asyncio.gather(*during)
    assert len(finished) == 8 and all(t.reward is not None for t in finished)
    assert result.step == 1
    metrics = result.metrics
    record("train_step_1", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items()})
    assert metrics["tokens_trained"] > 0, metrics
    assert metrics["skipped_nonfinite"] == 0
    first = load_file(str(backend.checkpoint_dir(model, 0) / "adapter_model.safetensors"))
    trained = load_file(str(backend.checkpoint_dir(model, 1) / "adapter_model.safetensors"))
    assert any(not (trained[k] == first[k]).all() for k in first), "the step did not change the adapter"
    engine = backend._state(model).engine
    if engine._from_memory:  # handed over on the GPU; once the checkpoint is written the host copy replaces it
        held = [t for weights in engine._held.values() for t in weights.tensors.values()]
        assert held and all(t.device.type == "cpu" for t in held), "the adapter's GPU copy outlived its checkpoint"
        # page-locked: a pageable copy beside the rollouts slowed them ~1.2 s a step (engines.base.packed_copies)
        assert all(t.is_pinned() for t in held), "the checkpoint's host copy is pageable"
    # The endpoint now serves step 1 as "gpu" and "gpu@1"; "gpu@0" is still the base.
    assert (await served(f"{NAME}@0"))[0] == base_ids
    trained_ids, trained_logprobs = await served(NAME)
    assert (await served(f"{NAME}@1"))[0] == trained_ids
    tokens_changed = trained_ids != base_ids
    logprobs_changed = any(abs(a - b) > 1e-4 for a, b in zip(trained_logprobs, base_logprobs, strict=False))
    record("served_after_step_1", {"tokens_changed": tokens_changed, "logprobs_changed": logprobs_changed})
    assert tokens_changed or logprobs_changed


@in_loop
async def test_close_and_resume_serves_the_same_step(stack, model_dir):
    """A kernel restart: a new process registers the same model and serves the same weights.

    A new process, not the same one: vLLM's sleep-mode allocator (CuMem) allows one engine per
    process, so resuming in a live kernel after `close()` is not possible with vLLM; restart it.
    """
    backend, model, path = stack
    ids = prompt_ids(backend)
    latest = await greedy_ids(backend, ids, f"{NAME}@1")
    await backend.close()
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.gpu.resume_worker", str(path), str(model_dir), json.dumps(ids),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output, _ = await proc.communicate()
    text = output.decode(errors="replace")
    record("resume_new_process_s", round(time.perf_counter() - started, 1))
    assert proc.returncode == 0, text[-3000:]
    result = json.loads(text.strip().splitlines()[-1])
    assert result["step"] == 1
    assert "resumed at step 1" in result["resume"]
    assert result["optimizer_restored"]  # AdamW moments came back
    assert result["greedy"] == latest
    history = [json.loads(line) for line in (path / "gpu/models/gpu/history.jsonl").read_text().splitlines()]
    assert any("train/time/train" in row for row in history)
