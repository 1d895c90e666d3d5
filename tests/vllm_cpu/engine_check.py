"""Exercise art_nb's VLLMEngine on vLLM's CPU build. Runs under .venv-vllm/bin/python, not pytest.

    .venv-vllm/bin/python tests/vllm_cpu/engine_check.py MODEL_DIR RESULT.json

MODEL_DIR: a transformers folder (the main suite passes SmolLM2 from art_nb.models). Each check
appends to RESULT.json as it goes; the pytest wrapper (test_vllm_engine_cpu.py) asserts on it, so
a failure names the check. Also compares vLLM's logprobs with transformers' at temperature 1: the
engine must return raw logprobs, not temperature-scaled ones. Ends with the Engine protocol's shared
conformance cases (tests/engine_cases.py), each outcome recorded under "conformance"; the last of
them closes the engine.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared engine cases

from engine_cases import CASES, PROMPT, Subject, random_lora  # noqa: E402


def hf_logprobs(model_dir: Path, prompt: list[int], completion: list[int], adapter: Path | None = None) -> list[float]:
    """Log-probabilities of `completion` after `prompt` from transformers (+ peft adapter), at temperature 1."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


async def main(model_dir: Path, result_path: Path) -> None:
    from art_nb.config import LoraConfig, ModelConfig
    from art_nb.engines.base import ContextTooLongError, EngineError, GenerationRequest, SamplingParams
    from art_nb.engines.vllm import VLLMEngine

    result: dict[str, Any] = {}

    def save(key: str, value: Any) -> None:
        result[key] = value
        result_path.write_text(json.dumps(result, indent=1))

    work = result_path.parent
    adapters = [random_lora(model_dir, work / f"lora{seed}", seed) for seed in (1, 2)]

    started = time.perf_counter()
    config = ModelConfig(max_seq_len=512, max_batch_size=8, lora=LoraConfig(rank=8, alpha=16))
    engine = await VLLMEngine.create(model_dir, config, enforce_eager=True)
    save("create_s", round(time.perf_counter() - started, 1))
    save("reasons", engine.reasons)
    prompt = list(engine.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))

    async def greedy(adapter: str | None, tokens: int = 12) -> list[int]:
        return (await greedy_sample(adapter, tokens)).token_ids

    async def greedy_sample(adapter: str | None, tokens: int = 12) -> Any:
        request = GenerationRequest(prompt, SamplingParams(max_tokens=tokens, temperature=0.0), adapter=adapter)
        [sample] = await engine.generate(request)
        return sample

    # Sampling: n samples with token ids and one finite, non-positive logprob per token.
    started = time.perf_counter()
    request = GenerationRequest(prompt, SamplingParams(max_tokens=16, temperature=0.7, n=3, seed=0))
    samples = await engine.generate(request)
    save("sample_s", round(time.perf_counter() - started, 2))
    save("samples", [{"n_tokens": len(s.token_ids), "n_logprobs": len(s.logprobs), "finish_reason": s.finish_reason,
                      "logprobs_finite_nonpositive": all(math.isfinite(x) and x <= 0 for x in s.logprobs)}
                     for s in samples])
    # Raw logprobs: sampled at temperature 0.7, but reported under the temperature-1 distribution.
    reference = hf_logprobs(model_dir, prompt, samples[0].token_ids)
    save("max_abs_gap_vs_transformers", max(abs(a - b) for a, b in zip(samples[0].logprobs, reference, strict=True)))

    # Concurrent requests share batches and all complete.
    many = await asyncio.gather(*(engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=8, seed=i)))
                                  for i in range(6)))
    save("concurrent_completed", sum(len(batch) for batch in many))

    # The context check fires before vLLM sees the request.
    try:
        await engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=512)))
        save("context_too_long_raised", False)
    except ContextTooLongError:
        save("context_too_long_raised", True)

    # Adapters: load changes greedy output; the same name with new weights gets a fresh id; unload restores.
    base = await greedy(None)
    await engine.load_adapter("m@1", adapters[0])
    first_sample = await greedy_sample("m@1")
    first = first_sample.token_ids
    # The adapter is applied as peft applies it: same logprobs as transformers + peft.
    reference = hf_logprobs(model_dir, prompt, first, adapters[0])
    save("adapter_max_abs_gap_vs_peft", max(abs(a - b) for a, b in zip(first_sample.logprobs, reference, strict=True)))
    await engine.load_adapter("m@1", adapters[1])
    second = await greedy("m@1")
    await engine.unload_adapter("m@1")
    try:
        await greedy("m@1")
        unloaded_refused = False
    except EngineError:
        unloaded_refused = True
    after = await greedy(None)
    save("adapters", {"base": base, "first": first, "second": second, "after_unload": after,
                      "unloaded_refused": unloaded_refused})

    await engine.sleep()  # no-op off CUDA, must not break anything
    await engine.wake()
    save("greedy_after_sleep_wake_equal", await greedy(None) == base)

    outcomes: dict[str, str] = {}
    subject = Subject(engine, prompt, adapters[0])
    for case in CASES:
        try:
            await case(subject)
            outcomes[case.__name__] = "ok"
        except Exception as exc:  # recorded, and the next case still runs: the report names every failure
            outcomes[case.__name__] = f"{type(exc).__name__}: {exc}"
        save("conformance", outcomes)
    await engine.close()  # the last case closed it already; closing again must be harmless
    save("closed", True)


if __name__ == "__main__":  # vLLM may spawn processes: keep the entry point guarded
    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2])))
