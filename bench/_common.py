"""What every bench script shares: what ran where, raw numbers to JSON, memory peaks, failure-proof sections.

A benchmark result is only worth publishing with its context, so each script's JSON carries the exact
command, the machine, the package versions, the git commit and the load on the machine, next to every
raw timing (not only a mean). GPU scripts run several independent sections (plain vLLM, the endpoint,
TRL...); `Results.section` keeps one failure from losing the others' numbers: the error is written
into the JSON, the file is rewritten after every section, and one summary line is printed per section.

Also here, because two GPU scripts need it: a random-weight model of a real architecture (Qwen2.5-3B
shape) with the SmolLM2 tokenizer, built once on the machine that runs the benchmark (no hub there).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import math
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from typing_extensions import Self

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the GPU machine runs the working tree, not an installed art_nb

PACKAGES = ("torch", "transformers", "peft", "trl", "accelerate", "datasets", "vllm", "unsloth", "unsloth_zoo",
            "bitsandbytes", "triton", "openai", "uvicorn", "starlette")
MiB = 1024**2
GiB = 1024**3

# Qwen/Qwen2.5-3B-Instruct's config.json (architecture numbers only). The vocabulary is replaced by the
# tokenizer's (SmolLM2's 49152 instead of 151936), which removes ~0.2B embedding parameters: 2.9B left.
QWEN25_3B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
    "num_attention_heads": 16, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "use_sliding_window": False, "attention_dropout": 0.0, "initializer_range": 0.02,
}
# The same family at toy size, for --quick dry runs on a CPU.
QWEN_TINY: dict[str, Any] = {
    **QWEN25_3B, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 8192,
}


# ---- context -----------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    """Command, date, machine, versions, git commit: the header of every results file."""
    from art_nb.local.plan.versions import installed_version

    info: dict[str, Any] = {
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "machine": machine(),
        "versions": {"python": platform.python_version(),
                     **{name: installed_version(name) for name in PACKAGES}},
    }
    dirty = _git(["status", "--porcelain", "--untracked-files=no"])
    if dirty:
        info["git_dirty"] = True
    return info


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError, IndexError):
        kib = int(Path("/proc/meminfo").read_text().splitlines()[0].split()[1])
        info["ram_gib"] = round(kib / 2**20, 1)
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = props.name
            info["gpu_count"] = torch.cuda.device_count()
            info["gpu_memory_gib"] = round(props.total_memory / GiB, 1)
            info["gpu_capability"] = f"sm{props.major}{props.minor}"
            info["cuda"] = torch.version.cuda
    return info


def _git(args: list[str]) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _git_commit() -> str | None:
    return _git(["rev-parse", "HEAD"])


def loadavg() -> float:
    """The 1-minute load average: how much else ran on a shared machine around a timing."""
    return round(os.getloadavg()[0], 2)


def wait_for_memory(need_gib: float, timeout_s: float = 3600) -> float:
    """Wait until the machine has `need_gib` available (it is shared: never push a colleague's job
    into the OOM killer). Returns the seconds waited."""
    started = time.monotonic()
    while True:
        available = available_gib()
        if available >= need_gib or time.monotonic() - started > timeout_s:
            return round(time.monotonic() - started, 1)
        print(f"  waiting for memory: {available:.1f} GiB available, {need_gib} needed", flush=True)
        time.sleep(30)


def available_gib() -> float:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return math.inf


# ---- memory ----------------------------------------------------------------------------------------


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (Linux reports ru_maxrss in KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def current_rss_mib() -> float:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return math.nan


def gpu_memory() -> dict[str, float]:
    """Device-wide use (what nvidia-smi shows: total - free) and PyTorch's own peaks, in GiB."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return {
        "used_gib": round((total - free) / GiB, 2),
        "total_gib": round(total / GiB, 2),
        "torch_allocated_gib": round(torch.cuda.memory_allocated() / GiB, 2),
        "torch_max_allocated_gib": round(torch.cuda.max_memory_allocated() / GiB, 2),
        "torch_max_reserved_gib": round(torch.cuda.max_memory_reserved() / GiB, 2),
    }


def cap_like_a_gpu(cap_gib: float) -> dict[str, Any]:
    """Cap PyTorch as on a `cap_gib` GPU; art_nb's memory plan reads the cap back and plans within it.

    On a real GPU of that size the CUDA context already takes part of it before anything is
    allocated (torch.cuda.mem_get_info's free memory says so); here the device is bigger, so PyTorch's
    cap is `cap` less what this process holds outside PyTorch at the start (its context: nothing else
    runs on the GPU machine). Peaks are then read device-wide, context included, against `cap`.
    """
    import torch

    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    cap, outside = int(cap_gib * GiB), total - free - torch.cuda.memory_reserved()
    torch.cuda.set_per_process_memory_fraction(min((cap - outside) / total, 1.0))
    return {"cap_gib": cap_gib, "device_total_gib": round(total / GiB, 1),
            "used_before_gib": round((total - free) / GiB, 2), "outside_torch_at_start_gib": round(outside / GiB, 2),
            "torch_cap_gib": round((cap - outside) / GiB, 2), "torch_fraction": round((cap - outside) / total, 4)}


class GpuUsedPeak:
    """Polls device-wide used memory (total - free, as nvidia-smi) on a thread while a block runs.

    `torch.cuda.max_memory_reserved` misses vLLM's KV cache and weights when vLLM allocates them
    through its own memory pool (sleep mode), so the device's own count is sampled as well.
    """

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = False
        self._thread: Any = None

    def __enter__(self) -> Self:
        import threading

        import torch

        def poll() -> None:
            while not self._stop:
                with contextlib.suppress(Exception):
                    free, total = torch.cuda.mem_get_info()
                    self.peak_bytes = max(self.peak_bytes, total - free)
                time.sleep(self.interval_s)

        self._thread = threading.Thread(target=poll, name="gpu-used-peak", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join(timeout=5)

    @property
    def peak_gib(self) -> float:
        return round(self.peak_bytes / GiB, 2)


# ---- numbers -----------------------------------------------------------------------------------------


def stats(values: list[float]) -> dict[str, float]:
    """Summary of raw repeats (the raw list is stored next to it)."""
    if not values:
        return {}
    return {
        "n": len(values),
        "mean": round(statistics.fmean(values), 4),
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "stdev": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
    }


def write_json(path: Path, data: Any) -> None:
    """Write atomically: a crash mid-write never leaves a truncated results file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def default_out_dir() -> Path:
    """$OUT on the GPU machine (what comes back), else bench/results."""
    out = os.environ.get("OUT")
    return Path(out) if out else ROOT / "bench" / "results"


class Results:
    """One results file: header first, then sections, rewritten after each section."""

    def __init__(self, path: Path, **header: Any) -> None:
        self.path = path
        self.data: dict[str, Any] = {**environment(), **header, "sections": {}}
        self.save()

    def save(self) -> None:
        write_json(self.path, self.data)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[dict[str, Any]]:
        """Yield a dict to fill; on an exception record it (type, message, traceback tail) and go on."""
        entry: dict[str, Any] = {}
        self.data["sections"][name] = entry
        started = time.perf_counter()
        try:
            yield entry
            entry.setdefault("status", "ok")
        except Exception as exc:  # noqa: BLE001 - a failing section must not lose the others' numbers
            entry["status"] = "error"
            entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            entry["traceback"] = traceback.format_exc()[-4000:]
        finally:
            entry["section_s"] = round(time.perf_counter() - started, 1)
            self.save()
            print(f"[{name}] {entry.get('status')}: {entry.get('summary') or entry.get('error', '')}"
                  f" ({entry['section_s']} s)", flush=True)


@contextlib.contextmanager
def collector_at_default_pace() -> Iterator[None]:
    """The collector's oldest generation at the process's own pace for a block, not the rarer one a backend
    sets while it serves (art_nb/local/release.py): the side a benchmark measures that choice against."""
    from art_nb.local.release import OLDEST_RARER

    serving = gc.get_threshold()
    gc.set_threshold(serving[0], serving[1], max(1, serving[2] // OLDEST_RARER))
    try:
        yield
    finally:
        gc.set_threshold(*serving)


class GcPasses:
    """The garbage collector's passes while armed: how many and how long, the oldest generation apart.

    An oldest-generation pass scans every tracked object and stops every thread while it runs (the
    engine's too), so a rollout benchmark counts them beside its timings."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, float]] = []  # (generation, seconds)
        self.armed, self._start = False, 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.armed:
            self.passes.append((info["generation"], time.perf_counter() - self._start))

    def begin(self) -> None:
        self.passes, self.armed = [], True

    def end(self) -> dict[str, Any]:
        self.armed = False
        oldest = [seconds for generation, seconds in self.passes if generation == 2]
        return {"gc_passes": len(self.passes), "gc_s": round(sum(seconds for _, seconds in self.passes), 6),
                "gc2_count": len(oldest), "gc2_s": round(sum(oldest), 6)}


# ---- models ------------------------------------------------------------------------------------------


def gpu_helpers() -> Any:
    """tests/gpu/conftest.py, loaded by path (its `real_model_dir` converts the staged SmolLM2 GGUF once)."""
    spec = importlib.util.spec_from_file_location("art_nb_gpu_helpers", ROOT / "tests" / "gpu" / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tokenizer_dir() -> Path:
    """A folder with the SmolLM2 tokenizer: $ART_NB_GPU_MODEL, the GPU machine's converted GGUF, else
    art_nb's offline copy."""
    if os.environ.get("ART_NB_GPU_MODEL"):  # also where tests/gpu/conftest.py (it needs pytest) cannot load
        return Path(os.environ["ART_NB_GPU_MODEL"])
    with contextlib.suppress(ImportError):
        found = gpu_helpers().real_model_dir()
        if found is not None:
            return Path(found)
    from art_nb.local.plan.base_models import TINY_MODEL, resolve_base_model

    return resolve_base_model(TINY_MODEL).path


def random_model_dir(shape: dict[str, Any], name: str, cache: Path | None = None) -> Path:
    """A bf16 safetensors model of `shape` with random weights and the SmolLM2 tokenizer, built once.

    Throughput and memory do not depend on weight values, so a real architecture with random
    weights stands in for checkpoints the benchmark machine cannot download. Built on the GPU when
    there is one (seconds instead of a minute), written to a temp folder and renamed into place.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cache = cache or Path(os.environ.get("ART_NB_BENCH_MODELS", "/tmp/art_nb_bench_models"))
    folder = cache / name
    if (folder / "config.json").is_file():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    values = {k: v for k, v in shape.items() if k != "architectures"}
    config = AutoConfig.for_model(
        **values, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = list(shape["architectures"])
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "RANDOM_WEIGHTS.txt").write_text(
        f"Random weights (seed 0) in the shape of {name}; tokenizer: SmolLM2-135M-Instruct. For speed and memory "
        "measurements only.\n")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    tmp.rename(folder)
    return folder


# ---- vLLM start-up modes -----------------------------------------------------------------------------

# art_nb's ways to start vLLM (ModelConfig.vllm_startup): "fast" = full CUDA graphs for decode without
# torch.compile (the default), "compiled" = vLLM's own default (torch.compile + graphs), "eager" = neither.
STARTUP_MODES = ("fast", "compiled", "eager")
STARTUP_ENV = "ART_NB_VLLM_STARTUP"
# The EngineArgs keys that decide compilation and CUDA graphs: what a peer's engine must share to be comparable.
GRAPH_KEYS = ("enforce_eager", "compilation_config")


def startup_env(mode: str) -> dict[str, str]:
    """Environment for a process that must start vLLM in `mode`, whichever switch this art_nb reads
    (ART_NB_VLLM_STARTUP; before it existed, ART_NB_VLLM_ENFORCE_EAGER)."""
    if mode not in STARTUP_MODES:
        raise ValueError(f"startup mode {mode!r}; expected one of {', '.join(STARTUP_MODES)}")
    return {STARTUP_ENV: mode, "ART_NB_VLLM_ENFORCE_EAGER": "1" if mode == "eager" else "0"}


def startup_fields(mode: str) -> dict[str, str]:
    """`ModelConfig` keywords for `mode`: the explicit field where this art_nb has it, else none (the env rules)."""
    from art_nb.config import ModelConfig

    return {"vllm_startup": mode} if "vllm_startup" in ModelConfig.model_fields else {}


def graph_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The compile / CUDA-graph part of vLLM engine kwargs (to give a peer's engine the same setting)."""
    return {k: v for k, v in kwargs.items() if k in GRAPH_KEYS or "cudagraph" in k}


def graph_setting(vllm_config: Any) -> dict[str, Any]:
    """What a built vLLM engine really runs with: eager or not, compile mode, CUDA-graph mode.

    Read from the engine, not from the arguments, so a results file states the setting even where
    a library (TRL, Unsloth) chose it.
    """
    # third-party: vLLM's config objects (names as in vLLM 0.25; absent ones read as None)
    model = getattr(vllm_config, "model_config", None)
    compilation = getattr(vllm_config, "compilation_config", None)

    def name(value: Any) -> Any:
        return getattr(value, "name", value if value is None or isinstance(value, (int, str)) else str(value))

    return {"enforce_eager": getattr(model, "enforce_eager", None),
            "compile_mode": name(getattr(compilation, "mode", None)),
            "cudagraph_mode": name(getattr(compilation, "cudagraph_mode", None)),
            "max_cudagraph_capture_size": getattr(compilation, "max_cudagraph_capture_size", None)}


def describe_graphs(setting: dict[str, Any] | None) -> str:
    """One phrase for a `graph_setting`: "eager", or the compile mode and CUDA-graph mode."""
    if not setting:
        return "unknown"
    if setting.get("enforce_eager"):
        return "eager"
    return f"compile {setting.get('compile_mode')}, CUDA graphs {setting.get('cudagraph_mode')}"


# ---- prompts and parts -------------------------------------------------------------------------------


def rollout_prompts(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """`n` tic-tac-toe first turns on different random boards: what a rollout batch sends (same system
    prompt, different boards), so prefix caching helps as much as it would in training."""
    import random

    from art_nb.envs import tic_tac_toe as ttt

    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        board = ttt.empty_board()
        for mark in "OXO"[: rng.randint(0, 3)]:
            board = ttt.place(board, rng.choice(ttt.legal_moves(board)), mark)
        prompts.append([{"role": "system", "content": ttt.SYSTEM_PROMPT},
                        {"role": "user", "content": ttt.user_message(board)}])
    return prompts


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The token ids art_nb's endpoint renders for `messages` (template text, no extra special tokens)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def run_part(script: Path, part: str, argv: list[str], out_dir: Path, timeout_s: float,
             env: dict[str, str] | None = None, name: str | None = None) -> dict[str, Any]:
    """Run one part of a GPU benchmark in its own process (all of its GPU memory goes back when it exits;
    a crash there costs that part only) and return what it wrote to OUT/_parts/NAME.json (NAME: the part's
    name unless given, e.g. one per vLLM start-up mode; the child must write under the same name)."""
    name = name or part
    path = out_dir / "_parts" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    command = [sys.executable, str(script), "--part", part, *argv]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, check=False,
                              env={**os.environ, **(env or {})})
        code, tail = done.returncode, (done.stdout + done.stderr)[-6000:]
    except subprocess.TimeoutExpired as exc:
        code, tail = "timeout", f"part timed out after {timeout_s} s: " + _text(exc.stdout)[-3000:] + _text(exc.stderr)[-3000:]
    (out_dir / "_parts" / f"{name}.log").write_text(tail)
    data = json.loads(path.read_text()) if path.exists() else {}
    if code != 0 and "error" not in data:
        data["error"] = f"the {name} process ended with {code}"
    if code != 0 or "error" in data:
        data.setdefault("log_tail", tail[-3000:])
    return data


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def measure_part(out_dir: Path, part: str, measure: Callable[[Callable[[dict[str, Any]], None]], dict[str, Any]]) -> None:
    """Inside a part's process: run `measure(write)`, where `write` (re)writes the part's JSON as results
    come in, so a crash keeps what was measured, with the error and traceback added."""
    path = out_dir / "_parts" / f"{part}.json"
    partial: dict[str, Any] = {}

    def write(data: dict[str, Any]) -> None:
        partial.clear()
        partial.update(data)
        write_json(path, data)

    try:
        write(measure(write))
    except Exception as exc:
        write_json(path, {**partial, "error": f"{type(exc).__name__}: {exc}"[:2000],
                          "traceback": traceback.format_exc()[-4000:]})
        raise


def model_section(results: Results, model: Path | None, quick: bool) -> Path | None:
    """The "model" section: `model` as given, else the random-weight 3B (a toy one with --quick), built once."""
    with results.section("model") as entry:
        mark = time.perf_counter()
        if model is None:
            model = random_model_dir(QWEN_TINY if quick else QWEN25_3B,
                                     "qwen-tiny-random" if quick else "qwen2.5-3b-random")
        entry.update(path=str(model), seconds=round(time.perf_counter() - mark, 1),
                     summary=f"{model} ready in {time.perf_counter() - mark:.0f} s")
        return model
    return None  # the section recorded why building the model failed


def weights_note(model: Path | None, quick: bool) -> str:
    """What the results file says about the weights (random ones must be stated as such)."""
    if model is not None:
        return str(model)
    shape = "a toy Qwen2 shape (--quick dry run)" if quick else "Qwen2.5-3B shape"
    return f"random weights ({shape}, SmolLM2 tokenizer): speed and memory only"


# ---- head to head: interleaved repeats ---------------------------------------------------------------

MIN_REPEATS = 3  # a head-to-head reports the median of at least this many repeats per side
TURN_TAG = "@@turn "  # a resident part's protocol lines on stdout start with this (libraries print too)


def interleaved(sides: list[str], rounds: int) -> list[list[str]]:
    """Each round's order: every side once, rotated a place per round (A B C, B C A, C A B; two sides:
    A B, B A), so a slow spell of a shared machine or a warming GPU falls on each side alike."""
    return [sides[r % len(sides):] + sides[:r % len(sides)] for r in range(rounds)]


def head_to_head(repeats: dict[str, list[float]], unit: str = "s") -> dict[str, Any]:
    """Each side's median over its repeats with their spread, and every pair's ratio of medians with
    the range of its per-round ratios (round i of one side over round i of the other).

    A ratio `holds` when every round agrees with the medians about which side is faster: one noisy
    repeat (a slow TRL start, a neighbour's job) then cannot decide it, and a ratio whose rounds
    disagree is reported as not settled. Values are costs (seconds, lower is better); `B/A` > 1
    means A is faster.
    """
    sides: dict[str, Any] = {}
    for name, values in repeats.items():
        if values:
            middle = statistics.median(values)
            sides[name] = {"repeats": [round(v, 4) for v in values], **stats(values),
                           "spread": round((max(values) - min(values)) / middle, 4) if middle else None}
    ratios: dict[str, Any] = {}
    names = list(sides)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ratio = sides[b]["median"] / sides[a]["median"]
            rounds = [rb / ra for ra, rb in zip(repeats[a], repeats[b]) if ra]
            ratios[f"{b}/{a}"] = {"of_medians": round(ratio, 4), "per_round": [round(r, 4) for r in rounds],
                                  "min": round(min(rounds), 4) if rounds else None,
                                  "max": round(max(rounds), 4) if rounds else None,
                                  "holds": bool(rounds) and all((r > 1) == (ratio > 1) for r in rounds)}
    return {"method": f"median of each side's repeats, interleaved in one run (at least {MIN_REPEATS}); spread = "
                      "(max - min) / median; per_round pairs the i-th repeats; holds = every round on the median's side of 1",
            "unit": unit, "enough_repeats": bool(sides) and all(len(repeats[n]) >= MIN_REPEATS for n in sides),
            "sides": sides, "ratios": ratios}


def describe_ratio(h2h: dict[str, Any], pair: str) -> str:
    """One phrase for a pair of `head_to_head`: "1.52x (rounds 1.41-1.60, holds; n=3)"."""
    entry, sides = h2h.get("ratios", {}).get(pair), pair.split("/")
    if not entry:
        return f"{pair}: not measured"
    n = min(len(h2h["sides"][s]["repeats"]) for s in sides)
    held = "holds" if entry["holds"] else "NOT settled: the rounds disagree"
    return f"{entry['of_medians']:.2f}x (rounds {entry['min']:.2f}-{entry['max']:.2f}, {held}; n={n})"


class Resident:
    """A benchmark part in a process of its own that stays up and runs one repeat ("turn") each time it
    is told, so the sides of a head-to-head interleave their repeats in one run without paying their
    start-up per repeat. Only one side runs at a time; on a large GPU both stay resident.

    The part's process answers on stdout with `TURN_TAG` lines: {"ready": {...}} once built, then
    {"done": {...}} (or {"error": ...}) per turn; everything else it prints goes to OUT/_parts/NAME.log.
    """

    def __init__(self, script: Path, part: str, argv: list[str], out_dir: Path, timeout_s: float,
                 env: dict[str, str] | None = None, name: str | None = None) -> None:
        import queue
        import threading

        self.name = name or part
        self.log_path = out_dir / "_parts" / f"{self.name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._tail: list[str] = []
        self.proc = subprocess.Popen([sys.executable, str(script), "--part", part, *argv], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, bufsize=1)
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self._answer(timeout_s, "ready")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                if line.startswith(TURN_TAG):
                    self._lines.put(json.loads(line[len(TURN_TAG):]))
                else:
                    log.write(line)
                    log.flush()
                    self._tail = (self._tail + [line])[-80:]
        self._lines.put(None)

    def _answer(self, timeout_s: float, key: str) -> dict[str, Any]:
        import queue

        try:
            message = self._lines.get(timeout=max(timeout_s, 1))
        except queue.Empty:
            self.close()
            raise RuntimeError(f"{self.name}: no {key} within {timeout_s:.0f} s; log tail:\n{self.tail()}") from None
        if message is None:
            raise RuntimeError(f"{self.name}: the process ended (exit {self.proc.wait()}); log tail:\n{self.tail()}")
        if "error" in message:
            raise RuntimeError(f"{self.name}: {message['error']}\n{message.get('traceback', '')[-3000:]}")
        return message[key]

    def turn(self, timeout_s: float, **command: Any) -> dict[str, Any]:
        """Run one turn with `command` and return what the part measured."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout_s, "done")

    def tail(self, lines: int = 40) -> str:
        return "".join(self._tail[-lines:])

    def close(self, timeout_s: float = 60) -> None:
        """Tell the part to stop (closing its stdin), and end it if it does not."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # our own child
            self.proc.wait()


def announce(**message: Any) -> None:
    """In a resident part's process: one protocol line ({"ready": ...}, {"done": ...}, {"error": ...})."""
    print(TURN_TAG + json.dumps(message, default=str), flush=True)


def next_turn() -> dict[str, Any] | None:
    """In a resident part's process: the next turn's command, or None once the parent is done."""
    line = sys.stdin.readline()
    return json.loads(line) if line.strip() else None


def serve_turns(ready: dict[str, Any], run_turn: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """In a resident part's process: announce `ready`, then run a turn per command until stdin closes;
    a failed turn is reported (with its traceback) and the part goes on."""
    announce(ready=ready)
    while (command := next_turn()) is not None:
        try:
            announce(done=run_turn(command))
        except Exception as exc:  # noqa: BLE001 - the parent records it and may go on with the other sides
            announce(error=f"{type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc()[-4000:])
