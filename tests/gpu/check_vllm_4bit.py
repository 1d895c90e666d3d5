"""On the GPU: vLLM serving 4-bit NF4 weights (ModelConfig.vllm_4bit, on by default with load_in_4bit).

    source .gpu/bin/env.sh && python3 tests/gpu/check_vllm_4bit.py $OUT [MODEL_DIR]

Not a pytest file (one vLLM start, ~1 min on an H200 with eager start-up). Writes OUT/vllm_4bit.json
and exits non-zero when a check fails. On the real SmolLM2 (tests/gpu/conftest.py's folder, or MODEL_DIR):
- the engine starts with `quantization="bitsandbytes"` and an r16 LoRA on every linear module;
- identical requests repeated: are NF4 serving's logprobs reproducible? (7c80458: the first request and later
  ones were up to 0.12 apart, same tokens.) "The same" below means the same tokens and logprobs within
  max(1e-3, twice the spread seen among the repeats), and the gap to the closest repeat is reported;
- the adapter handed over in memory serves the same greedy tokens as from its directory;
- sleep (level 1: weights to the CPU) and wake change nothing: same tokens, logprobs as above,
  with the adapter and without (vLLM's bug report #53888 saw a quantised model's LoRA stop applying after wake);
- the claim behind following the trainer: vLLM's NF4 logprobs of its own greedy tokens are closer to
  those of the trainer's 4-bit model (transformers + bitsandbytes NF4 as art_nb's peft trainer loads it,
  same adapter) than to the unquantised model's.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for art_nb and tests/
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_cpu"))  # engine_check's adapter helpers

PROMPT = [{"role": "user", "content": "Name three colours, separated by commas."}]
SAME = 1e-3


def hf_logprobs(model_dir: Path, adapter: Path, prompt: list[int], completion: list[int], four_bit: bool) -> list[float]:
    """Logprobs of `completion` from transformers + peft on the GPU, in bf16 or NF4 as the peft trainer loads it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    extra: dict[str, Any] = {"device_map": {"": 0}}
    if four_bit:
        extra["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=True)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, **extra),
                                      adapter).eval()
    ids = torch.tensor([prompt + completion], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion, device="cuda").unsqueeze(-1))
    del model
    torch.cuda.empty_cache()
    return picked.squeeze(-1).tolist()


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def main(out: Path, model_dir: Path) -> dict[str, Any]:
    from engine_check import lora_r16, weights_of

    from art_nb.config import LoraConfig, ModelConfig
    from art_nb.local.engines.base import GenerationRequest, SamplingParams
    from art_nb.local.engines.vllm.engine import VLLMEngine
    from art_nb.local.plan.versions import installed_version

    result: dict[str, Any] = {"vllm": installed_version("vllm"), "bitsandbytes": installed_version("bitsandbytes"),
                              "model": str(model_dir), "checks": {}}
    work = out / "vllm_4bit_work"
    work.mkdir(parents=True, exist_ok=True)
    r16 = lora_r16(model_dir, work / "lora_r16")
    started = time.perf_counter()
    config = ModelConfig(load_in_4bit=True, max_seq_len=512, max_batch_size=8, lora=LoraConfig(rank=16, alpha=32))
    engine = await VLLMEngine.create(model_dir, config, enforce_eager=True)
    result["create_s"] = round(time.perf_counter() - started, 1)
    quantization = getattr(getattr(getattr(engine._engine, "vllm_config", None), "model_config", None),
                           "quantization", None)
    result["quantization"] = quantization
    result["reasons"] = [r for r in engine.reasons if "4-bit" in r or "NF4" in r or "weights" in r]
    result["checks"]["served_in_nf4"] = quantization == "bitsandbytes"
    prompt = list(engine.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))

    async def greedy(adapter: str | None, tokens: int = 24) -> Any:
        [sample] = await engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=tokens, temperature=0.0),
                                                           adapter=adapter))
        return sample

    try:
        await engine.load_adapter("disk@1", r16)
        disk, base = await greedy("disk@1"), await greedy(None)
        # The same request again: do NF4 serving's logprobs move between identical requests (bf16: never
        # seen), and is it the first request after start-up that differs (kernels compiled on first use)?
        repeats = [await greedy("disk@1") for _ in range(4)]
        result["repeat"] = {"tokens_equal": all(r.token_ids == disk.token_ids for r in repeats),
                            "gap_first_to_repeats": [round(gap(r.logprobs, disk.logprobs), 6) for r in repeats],
                            "gap_among_repeats": [round(gap(r.logprobs, repeats[0].logprobs), 6) for r in repeats[1:]]}
        runs = [disk, *repeats]
        spread = max(gap(a.logprobs, b.logprobs) for a in runs for b in runs)

        def closest(sample: Any) -> float:
            """The gap to the nearest of the disk adapter's own results: 0 when `sample` is one of them."""
            return min(gap(sample.logprobs, r.logprobs) for r in runs)

        same = max(SAME, 2 * spread)
        result["same_within"] = same
        await engine.load_adapter("mem@1", work / "never-written", weights=weights_of(r16))
        memory = await greedy("mem@1")
        result["memory_vs_disk"] = {"tokens_equal": memory.token_ids == disk.token_ids,
                                    "max_abs_logprob_gap": gap(memory.logprobs, disk.logprobs),
                                    "gap_to_closest_disk_run": closest(memory)}
        result["checks"]["memory_serves_as_disk"] = (memory.token_ids == disk.token_ids
                                                     and gap(memory.logprobs, disk.logprobs) < same)
        result["checks"]["adapter_applies"] = disk.token_ids != base.token_ids

        sleeps = []
        for _ in range(2):
            started = time.perf_counter()
            await engine.sleep()
            await engine.wake()
            sleeps.append(round(time.perf_counter() - started, 3))
        after, after_base = await greedy("disk@1"), await greedy(None)
        result["sleep_wake"] = {"seconds": sleeps, "tokens_equal": after.token_ids == disk.token_ids,
                                "max_abs_logprob_gap": gap(after.logprobs, disk.logprobs),
                                "gap_to_closest_disk_run": closest(after),
                                "base_tokens_equal": after_base.token_ids == base.token_ids}
        result["checks"]["sleep_wake_changes_nothing"] = (after.token_ids == disk.token_ids and
                                                          gap(after.logprobs, disk.logprobs) < same and
                                                          after_base.token_ids == base.token_ids)
    finally:
        await engine.close()
    result["checks"]["closed"] = engine.dead_reason == "the engine was closed"

    completion = list(disk.token_ids)
    nf4 = hf_logprobs(model_dir, r16, prompt, completion, four_bit=True)
    bf16 = hf_logprobs(model_dir, r16, prompt, completion, four_bit=False)
    vllm = list(disk.logprobs)
    result["trainer_agreement"] = {
        "tokens": len(completion),
        "mean_abs_gap_to_nf4_trainer": statistics.fmean(abs(a - b) for a, b in zip(vllm, nf4, strict=True)),
        "max_abs_gap_to_nf4_trainer": gap(vllm, nf4),
        "mean_abs_gap_to_bf16_model": statistics.fmean(abs(a - b) for a, b in zip(vllm, bf16, strict=True)),
        "max_abs_gap_to_bf16_model": gap(vllm, bf16),
    }
    agreement = result["trainer_agreement"]
    result["checks"]["closer_to_the_4bit_trainer"] = (agreement["mean_abs_gap_to_nf4_trainer"]
                                                      < agreement["mean_abs_gap_to_bf16_model"])
    return result


if __name__ == "__main__":
    from tests.gpu.conftest import run_check

    run_check(main, "vllm_4bit.json")
