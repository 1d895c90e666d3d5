"""How many torch threads should the CPU engine use? Measure decode speed and decide from data.

Decodes the tiny model (SmolLM2-135M-Instruct) with a plain KV-cache loop at batch 1 and batch 16,
with 1 and 2 intra-op threads, once on the machine as found ("as_found"; the 1-minute load average
is recorded, since a shared machine is rarely idle) and once with a busy-loop process added
("plus_busy_core": what a colleague's job, the rollout code or the notebook's event loop does to us).
Reports decode tokens/s (prefill excluded) and writes every raw timing to
bench/results/cpu_threads.json, which `art_nb/local/plan/threads.py` cites for its default.

    .venv/bin/python bench/cpu_threads.py [--steps 16] [--repeats 3] [--out bench/results/cpu_threads.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from art_nb.local.plan.base_models import TINY_MODEL, resolve_base_model

PROMPT = "Write a short story about a robot who learns to play tic-tac-toe."


@contextmanager
def busy_core() -> Iterator[int]:
    """A subprocess spinning on one core for as long as the block runs; yields its pid."""
    # Spins until its parent is gone, so a killed benchmark leaves no busy process behind.
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    time.sleep(0.5)  # let the scheduler see it before we start timing
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@torch.inference_mode()
def decode_seconds(model, prompt_ids: torch.Tensor, batch: int, steps: int) -> float:
    """Seconds for `steps` greedy decode steps after the prefill, for `batch` copies of the prompt."""
    ids = prompt_ids.repeat(batch, 1)
    cache = {_cache_kwarg(model): DynamicCache()}  # `past_key_values` became `cache` in transformers 5.x
    out = model(input_ids=ids, use_cache=True, **cache)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=token, use_cache=True, **cache)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timing")
    parser.add_argument("--repeats", type=int, default=3, help="timings per configuration (after one warm-up)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu_threads.json")
    args = parser.parse_args()

    resolved = resolve_base_model(TINY_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    model = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32).eval()
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]

    runs = []
    for load in ("as_found", "plus_busy_core"):
        for threads in (1, 2):
            for batch in (1, 16):
                torch.set_num_threads(threads)
                loadavg_before = os.getloadavg()[0]
                with busy_core() if load == "plus_busy_core" else _nothing():
                    decode_seconds(model, prompt_ids, batch, steps=4)  # warm-up
                    seconds = [decode_seconds(model, prompt_ids, batch, args.steps) for _ in range(args.repeats)]
                    loadavg = os.getloadavg()[0]
                best = min(seconds)
                run = {
                    "load": load,
                    "threads": threads,
                    "batch": batch,
                    "decode_steps": args.steps,
                    "seconds": [round(s, 4) for s in seconds],
                    "tokens_per_s_best": round(batch * args.steps / best, 2),
                    "loadavg_1m_before": round(loadavg_before, 2),
                    "loadavg_1m_after": round(loadavg, 2),
                }
                runs.append(run)
                print(f"{load:>14} threads={threads} batch={batch:>2}: {run['tokens_per_s_best']:8.2f} tok/s  {seconds}")

    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        },
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__},
        "model": {"id": TINY_MODEL, "path": str(resolved.path), "source": resolved.source, "dtype": "float32"},
        "prompt_tokens": int(prompt_ids.shape[1]),
        "note": (
            "tokens_per_s_best = batch * decode_steps / fastest repeat; prefill not timed; greedy. as_found: the machine "
            "as it was (it is shared; loadavg shows other work); plus_busy_core: a busy-loop process added."
        ),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def _cache_kwarg(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


if __name__ == "__main__":
    main()
