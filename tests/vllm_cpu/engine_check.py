"""Exercise art_nb's VLLMEngine on vLLM's CPU build. Runs under .venv-vllm/bin/python, not pytest.

    .venv-vllm/bin/python tests/vllm_cpu/engine_check.py MODEL_DIR RESULT.json

MODEL_DIR: a transformers folder (the main suite passes SmolLM2 from art_nb.local.plan.base_models). Each check
appends to RESULT.json as it goes; the pytest wrapper (test_vllm_engine_cpu.py) asserts on it, so
a failure names the check. Also compares vLLM's logprobs with transformers' at temperature 1: the
engine must return raw logprobs, not temperature-scaled ones. Ends with the Engine protocol's shared
conformance cases (tests/engine_cases.py), each outcome recorded under "conformance"; the last of
them closes the engine.

Also: the step loop on the vLLM thread (a request joins a running one mid-way; a cancelled one is
aborted), and adapters handed over in memory (`load_adapter(..., weights=)`): the same greedy tokens
and logprobs as the same adapter from its directory, the directory never read, re-loaded from memory
after vLLM's CPU cache evicted it, the temporary-directory fallback, and the hand-over time (r16).
Constrained decoding: grammar_check.py's cases, on this engine and on the transformers engine.
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

from engine_cases import CASES, PROMPT, Subject, random_lora
from grammar_check import grammar_cases


def lora_r16(model_dir: Path, out: Path) -> Path:
    """A rank-16 LoRA on every linear module (q/k/v/o, gate/up/down: vLLM packs qkv and gate_up), saved by peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(16)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=16, lora_alpha=32, target_modules=modules, init_lora_weights=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    model.save_pretrained(out)
    return out


def weights_of(directory: Path) -> Any:
    """The adapter in `directory` as the trainer hands it over: its tensors and config, in memory."""
    from safetensors.torch import load_file

    from art_nb.local.engines.base import AdapterWeights

    return AdapterWeights(tensors=load_file(str(directory / "adapter_model.safetensors")),
                          config=json.loads((directory / "adapter_config.json").read_text()))


async def handover_timings(engine: Any, weights: Any, later: Path, work: Path, repeats: int) -> dict[str, list[float]]:
    """ms per adapter hand-over, `repeats` times: from memory, vs writing the files (`spill`) and loading them."""
    from art_nb.local.engines.vllm.lora import spill

    timings: dict[str, list[float]] = {"memory_ms": [], "write_ms": [], "disk_ms": []}
    for i in range(repeats):
        started = time.perf_counter()
        await engine.load_adapter(f"t@m{i}", later, weights=weights)
        timings["memory_ms"].append(round(1000 * (time.perf_counter() - started), 2))
        started = time.perf_counter()
        directory = spill(weights, work)
        timings["write_ms"].append(round(1000 * (time.perf_counter() - started), 2))
        started = time.perf_counter()
        await engine.load_adapter(f"t@d{i}", directory)
        timings["disk_ms"].append(round(1000 * (time.perf_counter() - started), 2))
        await engine.unload_adapter(f"t@m{i}")
        await engine.unload_adapter(f"t@d{i}")
    return timings


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
    from art_nb.local.engines.base import ContextTooLongError, EngineError, GenerationRequest, SamplingParams
    from art_nb.local.engines.vllm.engine import VLLMEngine

    result: dict[str, Any] = {}

    def save(key: str, value: Any) -> None:
        result[key] = value
        result_path.write_text(json.dumps(result, indent=1))

    work = result_path.parent
    adapters = [random_lora(model_dir, work / f"lora{seed}", seed) for seed in (1, 2)]

    started = time.perf_counter()
    r16 = lora_r16(model_dir, work / "lora_r16")
    config = ModelConfig(max_seq_len=512, max_batch_size=8, lora=LoraConfig(rank=16, alpha=32))
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

    await step_loop(engine, prompt, save)
    await grammar_cases(engine, model_dir, hf_logprobs, save)  # constrained decoding, beside the HF engine
    await in_memory(engine, greedy_sample, [r16, *adapters], work, save)

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


async def step_loop(engine: Any, prompt: list[int], save: Any) -> None:
    """A request that arrives mid-way joins the running one; a cancelled one is aborted in vLLM."""
    from art_nb.local.engines.base import GenerationRequest, SamplingParams

    core = engine._engine
    steps = [0]
    step = core.step

    def counted() -> Any:  # the vLLM thread looks `step` up on every call (benchmarks time it this way)
        steps[0] += 1
        return step()

    core.step = counted

    def fixed(tokens: int) -> GenerationRequest:
        return GenerationRequest(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))

    async def steps_reach(count: int) -> None:
        while steps[0] < count:
            await asyncio.sleep(0.002)

    try:
        start = steps[0]
        long = asyncio.create_task(engine.generate(fixed(48)))
        await steps_reach(start + 5)
        [short] = await engine.generate(fixed(4))
        short_done = steps[0] - start
        [long_sample] = await long
        save("joined", {"short_tokens": len(short.token_ids), "short_done_at_step": short_done,
                        "long_tokens": len(long_sample.token_ids), "steps": steps[0] - start})

        start = steps[0]
        doomed = asyncio.create_task(engine.generate(fixed(400)))
        await steps_reach(start + 3)
        doomed.cancel()
        try:
            await doomed
        except asyncio.CancelledError:
            pass
        at_cancel = steps[0] - start
        [after] = await engine.generate(fixed(6))
        save("cancel", {"steps_before_cancel": at_cancel, "steps_in_all": steps[0] - start,
                        "served_after": len(after.token_ids), "unfinished_in_vllm": core.has_unfinished_requests()})
    finally:
        core.step = step


async def in_memory(engine: Any, greedy_sample: Any, directories: list[Path], work: Path, save: Any) -> None:
    """Adapters from tensors serve exactly what the same adapter from its directory serves."""
    import torch


    r16, first = directories[0], directories[1]
    later = work / "lands-later"  # where the checkpoint would land: it never exists here
    await engine.load_adapter("disk@1", r16)
    disk = await greedy_sample("disk@1")
    handed = weights_of(r16)
    await engine.load_adapter("mem@1", later, weights=handed)
    memory = await greedy_sample("mem@1")
    await engine.load_adapter("mem8@1", later, weights=weights_of(first))  # r8, q/v/down: a second layout
    await engine.load_adapter("disk8@1", first)
    mem8, disk8 = await greedy_sample("mem8@1"), await greedy_sample("disk8@1")
    save("memory", {
        "from_memory": engine._from_memory, "path_exists": later.exists(),
        "tokens_equal": memory.token_ids == disk.token_ids, "r8_tokens_equal": mem8.token_ids == disk8.token_ids,
        "max_abs_logprob_gap": max(abs(a - b) for a, b in zip(memory.logprobs, disk.logprobs, strict=True)),
        "r8_max_abs_logprob_gap": max(abs(a - b) for a, b in zip(mem8.logprobs, disk8.logprobs, strict=True)),
        "differs_from_r8": memory.token_ids != mem8.token_ids,
    })
    # vLLM keeps max_cpu_loras (4) adapters: four more push mem@1 out; a request for it loads it again by id
    mem_id = engine._adapters["mem@1"].lora_int_id
    for i in range(4):
        await engine.load_adapter(f"fill@{i}", later, weights=weights_of(directories[1 + i % 2]))
    evicted = mem_id not in engine._engine.list_loras()
    again = await greedy_sample("mem@1")
    pristine = weights_of(r16).tensors  # vLLM scales lora_b in place: it must do that to a copy of its own
    untouched = all(torch.equal(tensor, pristine[name]) for name, tensor in handed.tensors.items())
    save("evicted", {"evicted": evicted, "tokens_equal": again.token_ids == disk.token_ids, "weights_untouched": untouched,
                     "max_abs_logprob_gap": max(abs(a - b) for a, b in zip(again.logprobs, disk.logprobs, strict=True))})
    for name in ["disk@1", "mem8@1", "disk8@1", *(f"fill@{i}" for i in range(4))]:
        await engine.unload_adapter(name)
    held_after_unload = sorted(engine._held) == [mem_id]

    # The fallback where vLLM cannot take tensors: a temporary directory, removed at unload.
    engine._from_memory = False
    await engine.load_adapter("spill@1", later, weights=weights_of(r16))
    [spilled] = engine._spilled.values()
    spill_sample = await greedy_sample("spill@1")
    await engine.unload_adapter("spill@1")
    engine._from_memory = True
    save("spill", {"tokens_equal": spill_sample.token_ids == disk.token_ids, "removed": not spilled.exists(),
                   "held_after_unload": held_after_unload})

    # Hand-over time, r16 on every linear module: from memory, vs writing the files and loading them.
    weights = weights_of(r16)
    timings = await handover_timings(engine, weights, later, work, repeats=3)
    await engine.unload_adapter("mem@1")
    save("handover", {**timings, "tensors": len(weights.tensors),
                      "mbytes": round(sum(t.numel() * t.element_size() for t in weights.tensors.values()) / 2**20, 1),
                      "held_after_all_unloaded": len(engine._held)})


if __name__ == "__main__":  # vLLM may spawn processes: keep the entry point guarded
    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2])))
