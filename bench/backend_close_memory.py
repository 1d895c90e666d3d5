"""What a closed LocalBackend leaves behind: resident memory and threads after register, a train step and close,
cycle after cycle in one process (a notebook that closes a backend and registers the next model; a test worker).

Two sides, each in a fresh process, the same cycles on SmolLM2-135M-Instruct (art_nb's offline copy, CPU):
"as shipped" (`LocalBackend.close` ends the backend's loop thread and hands freed memory back,
`local/release.py`) and "close without release" (the same close with the thread stop and the release turned
off: what close did before). Resident memory (VmRSS) and live threads after each cycle.

    .venv/bin/python bench/backend_close_memory.py [--cycles 4] [--out bench/results/backend_close_memory.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from _common import ROOT, Results, loadavg

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"
SIDES = ("as_shipped", "close_without_release")


def rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmRSS in /proc/self/status")


async def cycle(index: int) -> None:
    """Register, four rollouts, one train step, close: what a notebook does with one model."""
    import art_nb as art

    backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="art_nb_close_"))
    model = art.TrainableModel(name=f"m{index}", project="close", base_model=TINY,
                               config=art.ModelConfig(max_seq_len=512, lora=art.LoraConfig(rank=8, alpha=32)))
    await model.register(backend)
    messages = [{"role": "user", "content": "Say something short."}]

    async def rollout(seed: int) -> art.Trajectory:
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=16, temperature=1.0, seed=seed)
        return art.Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=float(seed))

    group = art.TrajectoryGroup([await rollout(seed) for seed in range(4)])
    await model.train([group], config=art.TrainConfig(learning_rate=1e-4))
    await backend.close()


def side(name: str, cycles: int) -> dict[str, Any]:
    """In the child process: run the cycles and report memory and threads after each."""
    if name == "close_without_release":
        from art_nb.local import backend as backend_module
        from art_nb.local.loop import BackgroundLoop

        backend_module.release_freed_memory = lambda: None  # type: ignore[assignment]
        BackgroundLoop.stop = lambda self: None  # type: ignore[method-assign]
    rows = []
    for index in range(cycles):
        asyncio.run(cycle(index))
        rows.append({"cycle": index + 1, "rss_gib": round(rss_gib(), 3), "threads": threading.active_count()})
        print(name, rows[-1], flush=True)
    return {"cycles": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "backend_close_memory.json")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # the child process's part
    args = parser.parse_args()
    if args.side:
        print("RESULT " + json.dumps(side(args.side, args.cycles)), flush=True)
        return
    results = Results(args.out, benchmark="backend_close_memory", settings={"cycles": args.cycles, "model": TINY},
                      loadavg_at_start=loadavg())
    found: dict[str, Any] = {}
    for name in SIDES:
        with results.section(name) as entry:
            done = subprocess.run([sys.executable, __file__, "--side", name, "--cycles", str(args.cycles)],
                                  capture_output=True, text=True, cwd=ROOT, check=True)
            line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
            entry.update(json.loads(line[len("RESULT "):]))
            last = entry["cycles"][-1]
            found[name] = last
            entry["summary"] = f"after {last['cycle']} cycles: {last['rss_gib']:.2f} GiB resident, {last['threads']} threads"
    with results.section("comparison") as entry:
        shipped, before = found["as_shipped"], found["close_without_release"]
        entry["summary"] = (f"after {shipped['cycle']} register/train/close cycles: {shipped['rss_gib']:.2f} GiB resident "
                            f"and {shipped['threads']} threads as shipped vs {before['rss_gib']:.2f} GiB and "
                            f"{before['threads']} threads with close not releasing")
    print(results.data["sections"]["comparison"]["summary"])


if __name__ == "__main__":
    main()
