"""On the GPU: vLLM serves a LoRA handed over in memory exactly as from its directory, and its steps run back to back.

    source .gpu/bin/env.sh && python3 tests/gpu/check_vllm_memory_adapter.py $OUT [MODEL_DIR]

Not a pytest file (one vLLM start, < 90 s on an H200 with eager start-up). Writes
OUT/vllm_memory_adapter.json and exits non-zero when a check fails. Checks, on the real SmolLM2 (the
folder tests/gpu/conftest.py converts from the staged GGUF, or MODEL_DIR):
- an r16 adapter on every linear module, loaded with `weights=` from a path that
  never exists, gives the same greedy tokens and logprobs as the same adapter from its directory;
  after vLLM's CPU cache evicted it, a request loads it again from memory; the same adapter as float32
  tensors on the GPU (how the trainer hands it over) serves the same; hand-over times (memory, from the
  host and from the GPU, vs write + load by path); `from_memory` False would mean vLLM 0.25 fell back (the log says why);
- item 1: the gap between two `step()` calls while 8 requests decode (the vLLM thread loops step
  itself; the old asyncio driver left ~0.4 ms there).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for art_nb and tests/
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_cpu"))  # engine_check's adapter helpers

PROMPT = [{"role": "user", "content": "Name three colours, separated by commas."}]


async def main(out: Path, model_dir: Path) -> dict[str, Any]:
    import torch
    from engine_check import handover_timings, lora_r16, weights_of

    from art_nb.config import LoraConfig, ModelConfig
    from art_nb.local.engines.base import GenerationRequest, SamplingParams
    from art_nb.local.engines.vllm.engine import VLLMEngine
    from art_nb.local.plan.versions import installed_version

    result: dict[str, Any] = {"vllm": installed_version("vllm"), "model": str(model_dir), "checks": {}}
    work = out / "vllm_memory_adapter_work"
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    r16 = lora_r16(model_dir, work / "lora_r16")
    result["adapter_s"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    config = ModelConfig(max_seq_len=512, max_batch_size=8, lora=LoraConfig(rank=16, alpha=32))
    engine = await VLLMEngine.create(model_dir, config, enforce_eager=True)
    result["create_s"] = round(time.perf_counter() - started, 1)
    prompt = list(engine.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))

    async def greedy(adapter: str | None, tokens: int = 24) -> Any:
        [sample] = await engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=tokens, temperature=0.0),
                                                           adapter=adapter))
        return sample

    try:
        later = work / "lands-later"
        await engine.load_adapter("disk@1", r16)
        disk = await greedy("disk@1")
        await engine.load_adapter("mem@1", later, weights=weights_of(r16))
        memory = await greedy("mem@1")
        base = await greedy(None)
        gap = max(abs(a - b) for a, b in zip(memory.logprobs, disk.logprobs, strict=True))
        result["memory"] = {"from_memory": engine._from_memory, "tokens_equal": memory.token_ids == disk.token_ids,
                            "max_abs_logprob_gap": gap, "differs_from_base": memory.token_ids != base.token_ids,
                            "path_exists": later.exists()}
        result["checks"]["memory_serves_as_disk"] = (memory.token_ids == disk.token_ids and gap < 1e-3
                                                     and not later.exists())
        result["checks"]["vllm_took_tensors"] = engine._from_memory is True
        # As the trainer hands it over on a GPU: float32 on the device (the host copy comes later)
        on_gpu = weights_of(r16)
        on_gpu = type(on_gpu)(tensors={k: v.to("cuda", torch.float32) for k, v in on_gpu.tensors.items()},
                              config=on_gpu.config)
        await engine.load_adapter("gpu@1", later, weights=on_gpu)
        from_gpu = await greedy("gpu@1")
        gpu_gap = max(abs(a - b) for a, b in zip(from_gpu.logprobs, disk.logprobs, strict=True))
        result["from_gpu_tensors"] = {"tokens_equal": from_gpu.token_ids == disk.token_ids,
                                      "max_abs_logprob_gap": gpu_gap}
        result["checks"]["gpu_tensors_serve_as_disk"] = from_gpu.token_ids == disk.token_ids and gpu_gap < 1e-3
        await engine.unload_adapter("gpu@1")

        mem_id = engine._adapters["mem@1"].lora_int_id
        for i in range(4):  # max_cpu_loras is 4: these push mem@1 out of vLLM's CPU cache
            await engine.load_adapter(f"fill@{i}", later, weights=weights_of(r16))
        evicted = mem_id not in engine._engine.list_loras()
        again = await greedy("mem@1")
        result["evicted"] = {"evicted": evicted, "tokens_equal": again.token_ids == disk.token_ids}
        result["checks"]["reloaded_after_eviction"] = evicted and again.token_ids == disk.token_ids
        for i in range(4):
            await engine.unload_adapter(f"fill@{i}")

        timings = await handover_timings(engine, weights_of(r16), later, work, repeats=5)
        result["handover"] = {**timings, **{f"median_{k}": statistics.median(v) for k, v in timings.items()}}
        timings = await handover_timings(engine, on_gpu, later, work, repeats=5)
        result["handover_from_gpu"] = {**timings, **{f"median_{k}": statistics.median(v) for k, v in timings.items()}}

        result["step_gaps"] = await step_gaps(engine, prompt)
    finally:
        await engine.close()
    result["checks"]["closed"] = engine.dead_reason == "the engine was closed"
    return result


async def step_gaps(engine: Any, prompt: list[int]) -> dict[str, Any]:
    """Time between the end of one step() and the start of the next while 8 requests decode 128 tokens."""
    from art_nb.local.engines.base import GenerationRequest, SamplingParams

    core, marks = engine._engine, []
    step = core.step

    def timed() -> Any:
        began = time.perf_counter()
        try:
            return step()
        finally:
            marks.append((began, time.perf_counter()))

    core.step = timed
    try:
        params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
        await asyncio.gather(*(engine.generate(GenerationRequest(prompt, params)) for _ in range(8)))
    finally:
        core.step = step
    gaps = sorted(1000 * (marks[i + 1][0] - marks[i][1]) for i in range(len(marks) - 1))
    steps = [1000 * (end - began) for began, end in marks]
    return {"steps": len(marks), "median_gap_ms": round(statistics.median(gaps), 4),
            "p90_gap_ms": round(gaps[int(0.9 * (len(gaps) - 1))], 4), "median_step_ms": round(statistics.median(steps), 3)}


if __name__ == "__main__":
    from tests.gpu.conftest import run_check

    run_check(main, "vllm_memory_adapter.json")
