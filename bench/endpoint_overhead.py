"""What art_nb's OpenAI endpoint costs: N concurrent chat completions through it vs the engine called directly.

Both paths drive the same `HFEngine` (SmolLM2-135M-Instruct on CPU, the engine LocalBackend built) on
the backend's own event loop:

- endpoint: `model.openai_client().chat.completions.create(...)` x N at once (HTTP on loopback, the
  chat template, JSON, per-token logprob entries: what a rollout pays), `logprobs=True`;
- direct: `engine.generate(GenerationRequest(prompt_ids, SamplingParams(...)))` x N at once, with the
  prompt ids the endpoint renders for the same messages.

Same sampling on both (temperature 1, a seed per request, so both sample the very same tokens; output
length fixed by `ignore_eos` + `max_tokens`). Repeats alternate A B B A ... and record the 1-minute load
average, because the machine is shared. Overhead = endpoint time / direct time - 1 (goal: < 10%); the
process's CPU time is recorded too (the server's work plus the engine's), less sensitive to other jobs.

    .venv/bin/python bench/endpoint_overhead.py [--concurrency 1 8 32] [--tokens 32] [--repeats 4]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, Results, loadavg, peak_rss_mib, stats

MESSAGES = [{"role": "user", "content": "Write a short story about a robot who learns to play tic-tac-toe."}]


async def endpoint_run(model: Any, n: int, tokens: int) -> tuple[float, float, list[list[int]]]:
    client = model.openai_client()
    started, cpu = time.perf_counter(), time.process_time()
    responses = await asyncio.gather(*(
        client.chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=tokens, temperature=1.0,
                                       logprobs=True, seed=i, extra_body={"ignore_eos": True})
        for i in range(n)))
    seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    return seconds, cpu_s, [r.choices[0].model_extra["token_ids"] for r in responses]


async def direct_run(engine: Any, prompt_ids: list[int], n: int, tokens: int) -> tuple[float, float, list[list[int]]]:
    from art_nb.local.engines.base import GenerationRequest, SamplingParams

    started, cpu = time.perf_counter(), time.process_time()
    samples = await asyncio.gather(*(
        engine.generate(GenerationRequest(prompt_ids, SamplingParams(max_tokens=tokens, temperature=1.0, seed=i,
                                                                     ignore_eos=True)))
        for i in range(n)))
    seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    return seconds, cpu_s, [s[0].token_ids for s in samples]


async def run(args: argparse.Namespace, results: Results) -> None:
    import art_nb as art
    from art_nb.local.plan.base_models import TINY_MODEL

    model = art.TrainableModel(name="bench-endpoint", project="bench", base_model=TINY_MODEL,
                               config=art.ModelConfig(max_seq_len=1024))
    backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="art_nb_bench_"))
    await model.register(backend)
    results.data["choices"] = backend.choices(model)
    engine = backend._state(model).engine
    tokenizer = engine.tokenizer
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])  # what the server renders
    check = await model.openai_client().chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=1)
    if check.model_extra.get("prompt_token_ids") != prompt_ids:
        raise RuntimeError("the direct path's prompt ids differ from the endpoint's")
    results.data["prompt_tokens"] = len(prompt_ids)

    def endpoint(n: int) -> Any:
        return endpoint_run(model, n, args.tokens)

    def direct(n: int) -> Any:
        return backend.loop.run(direct_run(engine, prompt_ids, n, args.tokens))  # on the engine's loop

    for n in args.concurrency:
        with results.section(f"concurrency_{n}") as entry:
            await endpoint(n)  # warm-up, both paths
            await direct(n)
            runs: dict[str, list[dict[str, float]]] = {"endpoint": [], "direct": []}
            same_tokens = True
            for repeat in range(args.repeats):
                order = ("endpoint", "direct") if repeat % 2 == 0 else ("direct", "endpoint")
                ids: dict[str, list[list[int]]] = {}
                for side in order:
                    before = loadavg()
                    seconds, cpu_s, ids[side] = await (endpoint(n) if side == "endpoint" else direct(n))
                    runs[side].append({"seconds": round(seconds, 4), "cpu_s": round(cpu_s, 4), "repeat": repeat,
                                       "loadavg_before": before, "loadavg_after": loadavg()})
                same_tokens &= ids["endpoint"] == ids["direct"]
            median = {k: stats([r["seconds"] for r in v])["median"] for k, v in runs.items()}
            overhead = median["endpoint"] / median["direct"] - 1
            cpu = {k: stats([r["cpu_s"] for r in v])["median"] for k, v in runs.items()}
            per_repeat = [round(e["seconds"] / d["seconds"] - 1, 4) for e, d in zip(runs["endpoint"], runs["direct"])]
            entry.update(
                concurrency=n, tokens_per_request=args.tokens, runs=runs,
                seconds={k: stats([r["seconds"] for r in v]) for k, v in runs.items()},
                cpu_seconds={k: stats([r["cpu_s"] for r in v]) for k, v in runs.items()},
                cpu_overhead=round(cpu["endpoint"] / cpu["direct"] - 1, 4),
                tokens_per_s={k: round(n * args.tokens / v, 1) for k, v in median.items()},
                overhead=round(overhead, 4), overhead_per_repeat=per_repeat, same_tokens_sampled=same_tokens,
                summary=f"N={n}: endpoint {median['endpoint']:.2f} s vs direct {median['direct']:.2f} s "
                        f"-> overhead {overhead:+.1%} (per repeat {per_repeat}; CPU time "
                        f"{cpu['endpoint'] / cpu['direct'] - 1:+.1%}); same tokens: {same_tokens}",
            )
    results.data["peak_rss_mib"] = peak_rss_mib()
    await backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=32, help="completion tokens per request (fixed: ignore_eos)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "endpoint_overhead.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results = Results(args.out, benchmark="endpoint_overhead",
                      model="HuggingFaceTB/SmolLM2-135M-Instruct (art_nb's offline GGUF copy, float32), HF engine",
                      sampling={"temperature": 1.0, "max_tokens": args.tokens, "ignore_eos": True, "logprobs": True,
                                "seed": "request index"})
    asyncio.run(run(args, results))
    results.save()


if __name__ == "__main__":
    main()
