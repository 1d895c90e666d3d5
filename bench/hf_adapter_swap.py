"""The transformers engine's adapter hand-over on a train step: a new peft slot each step vs refilling the retired one.

A step hands the engine its new LoRA in memory (`load_adapter(name, path, weights=)`); the previous
step's slot retires once no request uses it. "new_slot" makes a fresh peft adapter every time (what the
engine did before, forced here by giving every load its own config key); "refill" copies into the
retired slot of the same config (`local/engines/hf/batch.AdapterTable`). Both in the same run, in alternating blocks
(a refill needs the slot retired by the load before it, made for the same config), on
SmolLM2-135M-Instruct (art_nb's offline copy), a LoRA on all linear modules. Reported per load: the
seconds `load_adapter` took plus the seconds the scheduler then spent deleting retired slots.

    .venv/bin/python bench/hf_adapter_swap.py [--loads 6] [--rank 16] [--out bench/results/hf_adapter_swap.json]

Measured (2-core shared CPU, r16): see bench/results/hf_adapter_swap.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, Results, loadavg, stats

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapter(model_dir: Path, rank: int, seed: int) -> Any:
    """A trainer's adapter as a step hands it over (tensors + config), with random B so it matters."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from art_nb.local.engines.base import AdapterWeights

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES, init_lora_weights=False))
    with tempfile.TemporaryDirectory() as directory:  # the config exactly as save_pretrained writes it
        model.save_pretrained(directory)
        config = json.loads((Path(directory) / "adapter_config.json").read_text())
    return AdapterWeights(tensors={k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()},
                          config=config)


async def run(model_dir: Path, loads: int, rank: int) -> dict[str, Any]:
    from art_nb.config import ModelConfig
    from art_nb.local.engines.base import GenerationRequest, SamplingParams
    from art_nb.local.engines.hf import engine as hf_engine
    from art_nb.local.engines.hf.engine import HFEngine

    weights = [adapter(model_dir, rank, seed) for seed in range(2)]
    engine = await HFEngine.create(model_dir, ModelConfig(max_seq_len=512))
    prompt = list(engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=False))
    delete_s: list[float] = []
    delete = engine._delete_adapters

    def timed_delete(internals: list[str]) -> None:
        started = time.perf_counter()
        delete(internals)
        delete_s.append(time.perf_counter() - started)

    engine._delete_adapters = timed_delete  # type: ignore[method-assign]
    key = hf_engine._config_key
    result: dict[str, Any] = {"new_slot": [], "refill": []}
    blocks = [mode for _ in range(2) for mode in ("new_slot", "refill")]
    for i, mode in enumerate(m for m in blocks for _ in range(loads)):
        hf_engine._config_key = key if mode == "refill" else (lambda w, i=i: f"{key(w)}#{i}")  # type: ignore[assignment]
        delete_s.clear()
        started = time.perf_counter()
        await engine.load_adapter("m", Path("/nonexistent"), weights=weights[i % 2])
        load = time.perf_counter() - started
        await engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=1)))  # a scheduler pass
        result[mode].append({"load_s": round(load, 4), "delete_s": round(sum(delete_s), 4),
                             "total_s": round(load + sum(delete_s), 4)})
    hf_engine._config_key = key
    await engine.close()
    for mode in ("new_slot", "refill"):
        # The first two loads of a block set it up (a refill needs a slot retired by a load of its own mode).
        runs = [r for j, r in enumerate(result[mode]) if j % loads >= 2]
        result[f"{mode}_total_s"] = stats([r["total_s"] for r in runs])
    result["new_slot_over_refill"] = round(result["new_slot_total_s"]["median"] / result["refill_total_s"]["median"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", type=int, default=6, help="loads per block (two blocks a mode; the first two of each set it up)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "hf_adapter_swap.json")
    args = parser.parse_args()
    from art_nb.local.plan.base_models import TINY_MODEL, resolve_base_model

    model_dir = resolve_base_model(TINY_MODEL).path
    results = Results(args.out, benchmark="hf_adapter_swap", settings={"loads": args.loads, "rank": args.rank,
                                                                      "modules": MODULES, "model": str(model_dir)})
    with results.section("swap") as entry:
        entry["load_before"] = loadavg()
        entry.update(asyncio.run(run(model_dir, args.loads, args.rank)))
        entry["load_after"] = loadavg()
        entry["summary"] = (f"new slot {entry['new_slot_total_s']['median']:.3f} s vs refill "
                            f"{entry['refill_total_s']['median']:.3f} s per hand-over: {entry['new_slot_over_refill']}x")
    print(results.data["sections"]["swap"].get("summary") or results.data["sections"]["swap"])


if __name__ == "__main__":
    main()
