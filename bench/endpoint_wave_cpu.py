"""A GPU's rollout wave modelled on a CPU: what the endpoint costs beside vLLM's step loop.

    .venv/bin/python bench/endpoint_wave_cpu.py [--batch-sizes 64 256] [--repeats 5] [--gpu-ms 6]
        [--python-ms 0.8] [--prefill-ms 0] [--out bench/results/endpoint_wave_cpu.json]

On the GPU, the endpoint, the notebook's OpenAI client and vLLM's engine thread share one process: a
decode step is a few ms of GPU work (the GIL released) between short Python stretches, and every
microsecond the request path spends holding the GIL, or a garbage-collector pass stops every thread
for, delays the next step. This runs that shape without a GPU: art_nb's own `VLLMThread` steps a core
whose `step()` spins `--python-ms` (the step's Python) and sleeps `--gpu-ms` (the GPU, GIL released),
and spins `--prefill-ms` more in a step that takes new requests in (on a GPU their prefill runs outside the
decode CUDA graphs, its kernels launched one by one from Python); every request ends after 128 steps, as `ignore_eos` + `max_tokens=128` make vLLM's. The request path
is the real one: `create_app` on its loop thread, the real `openai.AsyncOpenAI` through the in-process
client (what `model.openai_client()` returns), tic-tac-toe prompts through the SmolLM2 tokenizer. The
process holds torch, transformers and peft, as a registered model's does.

Three modes per batch size, interleaved repeat by repeat (median of >= 3 with the spread, per-round
ratios): `engine_direct` (B requests to the engine, no HTTP), `endpoint` (B `chat.completions.create`
calls, heap frozen after set-up and the collector's oldest generation made rarer, as LocalBackend does
after register: art_nb/local/release.py) and `endpoint_gc_default` (the same calls with the oldest
generation at the process's own pace). Each run
records steps, the steps that took requests in, the time before the first and after the last step, when
requests reached the engine, and the collector's passes (count and seconds, the oldest generation apart).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    MIN_REPEATS,
    ROOT,
    GcPasses,
    Results,
    collector_at_default_pace,
    head_to_head,
    tokenizer_dir,
)
from endpoint_per_request import TOKENS, Bench, InstantEngine, call, conversations  # noqa: E402

from art_nb.local.release import freeze_heap  # noqa: E402

MODES = ("engine_direct", "endpoint", "endpoint_gc_default")


class _Finished:
    def __init__(self, request_id: str) -> None:
        self.request_id, self.finished = request_id, True


class SteppedCore:
    """vLLM's LLMEngine as VLLMThread sees it: add_request, then step() until each request has 128 tokens."""

    def __init__(self, python_s: float, gpu_s: float, prefill_s: float) -> None:
        self.python_s, self.gpu_s, self.prefill_s = python_s, gpu_s, prefill_s
        self.open: dict[str, int] = {}
        self.fresh = False  # a request was added since the last step: this step prefills it
        self.spans: list[tuple[float, float]] = []
        self.adds: list[float] = []

    def add_request(self, request_id: str) -> None:
        self.adds.append(time.perf_counter())
        self.open[request_id] = 0
        self.fresh = True

    def step(self) -> list[_Finished]:
        start = time.perf_counter()
        python_s = self.python_s + (self.prefill_s if self.fresh else 0.0)  # a prefill: kernels launched one by one
        self.fresh = False
        while time.perf_counter() - start < python_s / 2:  # schedule and prepare: Python, GIL held
            pass
        time.sleep(self.gpu_s)  # the GPU: GIL released
        middle = time.perf_counter()
        while time.perf_counter() - middle < python_s / 2:  # sample and build outputs
            pass
        done = []
        for request_id in list(self.open):
            self.open[request_id] += 1
            if self.open[request_id] >= TOKENS:
                del self.open[request_id]
                done.append(_Finished(request_id))
        self.spans.append((start, time.perf_counter()))
        return done


class SteppedEngine(InstantEngine):
    """The endpoint's Engine protocol over `SteppedCore`, driven by art_nb's own VLLMThread."""

    def __init__(self, tokenizer: Any, python_s: float, gpu_s: float, prefill_s: float) -> None:
        from art_nb.local.engines.vllm.thread import VLLMThread

        super().__init__(tokenizer)
        self.core = SteppedCore(python_s, gpu_s, prefill_s)
        self.thread = VLLMThread()
        self.thread.attach(self.core.step, lambda: None, lambda exc: None)
        self.ids_made = 0

    async def generate(self, request: Any) -> list[Any]:
        from art_nb.local.engines.base import Sample

        self.ids_made += 1
        request_id = f"wave-{self.ids_made}"
        done = asyncio.get_running_loop().create_future()
        self.thread.add(request_id, lambda: self.core.add_request(request_id), done)
        await done
        return [Sample(self.ids[:TOKENS], self.logprobs[:TOKENS], "length")]


async def one_run(bench: Bench, client: Any, passes: GcPasses, mode: str, batch: int, seed: int) -> dict[str, Any]:
    from art_nb.local.engines.base import GenerationRequest, SamplingParams

    prompts = conversations(batch, seed)
    engine = bench.engine
    core = engine.core
    core.spans, core.adds = [], []
    passes.begin()
    mark = time.perf_counter()
    try:
        if mode == "engine_direct":
            async def direct() -> list[Any]:
                params = SamplingParams(max_tokens=TOKENS)
                return await asyncio.gather(*(engine.generate(GenerationRequest([1, 2, 3], params)) for _ in prompts))

            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(direct(), bench.loop.loop))
        else:
            pace = collector_at_default_pace() if mode == "endpoint_gc_default" else contextlib.nullcontext()
            with pace:
                tokens = await asyncio.gather(*(call(client, "plain", m) for m in prompts))
            assert all(t == TOKENS for t in tokens)
        done = time.perf_counter()
    finally:
        collected = passes.end()
    return {"wall_s": round(done - mark, 4), "steps": len(core.spans), "lead_s": round(core.spans[0][0] - mark, 4),
            "tail_s": round(done - core.spans[-1][1], 4), "last_add_s": round(core.adds[-1] - mark, 4),
            "admitting_steps": sum(1 for i, (start, _) in enumerate(core.spans)
                                   if any((core.spans[i - 1][0] if i else mark) <= t < start for t in core.adds)),
            **collected}


async def measure(args: argparse.Namespace, results: Results) -> None:
    import peft  # noqa: F401 - what a registered model's process holds beside the endpoint
    import torch  # noqa: F401
    import transformers  # noqa: F401

    bench = Bench(args.model or tokenizer_dir(),
                  make_engine=lambda tokenizer: SteppedEngine(tokenizer, args.python_ms / 1000, args.gpu_ms / 1000,
                                                              args.prefill_ms / 1000))
    client = bench.client()
    passes = GcPasses()
    for batch in args.batch_sizes:  # warm-up: template compilation, connections, per-size caches
        await asyncio.gather(*(call(client, "plain", m) for m in conversations(batch, seed=999)))
    freeze_heap()  # as LocalBackend does after register
    results.data["frozen_objects"] = gc.get_freeze_count()
    for batch in args.batch_sizes:
        with results.section(f"B{batch}") as entry:
            runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
            for repeat in range(args.repeats):
                shift = repeat % len(MODES)
                for mode in MODES[shift:] + MODES[:shift]:
                    runs[mode].append(await one_run(bench, client, passes, mode, batch, seed=100 * batch + repeat))
            entry["runs"] = runs
            entry["head_to_head"] = head_to_head({m: [r["wall_s"] for r in runs[m]] for m in MODES}, unit="s per wave")
            medians = {m: statistics.median(r["wall_s"] for r in runs[m]) for m in MODES}
            entry["gc2_s_total"] = {m: round(sum(r["gc2_s"] for r in runs[m]), 4) for m in MODES}
            entry["summary"] = (f"engine_direct / endpoint {medians['engine_direct'] / medians['endpoint']:.3f}; "
                                f"endpoint_gc_default / endpoint {medians['endpoint_gc_default'] / medians['endpoint']:.3f}; "
                                f"oldest-generation GC seconds over {args.repeats} waves: {entry['gc2_s_total']}")
    await client.close()
    bench.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gpu-ms", type=float, default=6.0, help="a decode step's GPU time (GIL released)")
    parser.add_argument("--python-ms", type=float, default=0.8, help="a decode step's Python (GIL held)")
    parser.add_argument("--prefill-ms", type=float, default=0.0,
                        help="more Python (GIL held) in a step that takes new requests in (eager prefill)")
    parser.add_argument("--model", type=Path, default=None, help="a folder with the tokenizer (default: SmolLM2)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "endpoint_wave_cpu.json")
    args = parser.parse_args()
    if args.repeats < MIN_REPEATS:
        parser.error(f"--repeats must be at least {MIN_REPEATS}")
    results = Results(args.out, benchmark="endpoint_wave_cpu", command=" ".join(["python", *sys.argv]),
                      settings={"batch_sizes": args.batch_sizes, "repeats": args.repeats, "gpu_ms": args.gpu_ms,
                                "python_ms": args.python_ms, "prefill_ms": args.prefill_ms, "tokens": TOKENS, "modes": list(MODES)})
    asyncio.run(measure(args, results))


if __name__ == "__main__":
    main()
