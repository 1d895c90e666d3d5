"""Load on the in-process endpoint: hundreds of concurrent multi-turn rollouts, a train step in the middle.

    .venv/bin/python bench/load_endpoint.py [--rollouts 256] [--turns 3] [--max-tokens 4]
        [--model smollm2|tiny] [--out bench/results/load_endpoint.json]

Two waves of `--rollouts` rollouts, all started at once (groups of 4 sharing a prompt, as GRPO
gathers them), each `--turns` requests long through the real OpenAI client, LocalBackend, endpoint
and transformers engine:

1. wave 1, and in its middle (once a third of its requests have been answered) one GRPO train step
   on groups gathered beforehand: requests that arrive meanwhile wait at the gate, those already
   inside the engine finish first; after the step, the rollouts' next turns are served by the new
   weights;
2. wave 2, the same load again on the trained model: resident memory after it should match
   memory after wave 1 (no growth per request).

A failed request is counted, not raised (max_exceptions); the run exits 1 if any failed. Resident
memory (RSS) is sampled every 0.2 s. `run_load` is what tests/integration/test_load.py runs at a
smaller count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import art_nb as art  # noqa: E402
from art_nb.trajectories import Choice, choice_to_message  # noqa: E402

GROUP_SIZE = 4


@dataclass
class LoadConfig:
    rollouts: int = 256
    turns: int = 3
    max_tokens: int = 4
    model: str = "smollm2"  # or "tiny": the 2-layer random Llama of tests/faults/tiny.py
    train_groups: int = 8


class RssSampler:
    """Resident memory of this process, every `period` seconds, in a daemon thread."""

    def __init__(self, period: float = 0.2) -> None:
        import psutil

        self._process = psutil.Process()
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self._start, self._process.memory_info().rss / 2**20))
            self._stop.wait(period)

    def now(self) -> float:
        return self._process.memory_info().rss / 2**20

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Recorder:
    """Per-request timings and failures, and when the train step ran."""

    def __init__(self) -> None:
        self.requests: list[tuple[float, float]] = []  # (start, end), perf_counter
        self.failures: list[str] = []
        self.train_window: tuple[float, float] | None = None
        self.answered = 0
        self.third = asyncio.Event()
        self.target = 0

    def done(self, start: float) -> None:
        self.requests.append((start, time.perf_counter()))
        self.answered += 1
        if self.target and self.answered >= self.target:
            self.third.set()


async def rollout(model: art.TrainableModel, scenario: int, seed: int, config: LoadConfig, rec: Recorder) -> art.Trajectory:
    client = model.openai_client()
    items: list[Any] = [{"role": "user", "content": f"Game {scenario}: say one word."}]
    for turn in range(config.turns):
        messages = [choice_to_message(m) if isinstance(m, Choice) else m for m in items]
        start = time.perf_counter()
        try:
            completion = await client.chat.completions.create(
                model=model.get_inference_name(), messages=messages, max_tokens=config.max_tokens,
                temperature=1.0, logprobs=True, seed=seed * 10 + turn)
        except Exception as error:
            rec.failures.append(f"{type(error).__name__}: {error}"[:300])
            raise
        rec.done(start)
        items.append(completion.choices[0])
        if turn + 1 < config.turns:
            items.append({"role": "user", "content": "Another."})
    text = "".join(m.message.content or "" for m in items if isinstance(m, Choice))
    return art.Trajectory(messages_and_choices=items, reward=len(set(text)) / 10)


async def wave(model: art.TrainableModel, config: LoadConfig, rec: Recorder, offset: int) -> list[art.TrajectoryGroup]:
    groups = [
        art.TrajectoryGroup(rollout(model, g, offset + g * GROUP_SIZE + i, config, rec) for i in range(GROUP_SIZE))
        for g in range(config.rollouts // GROUP_SIZE)
    ]
    return await art.gather_trajectory_groups(groups, pbar_desc=None, max_exceptions=config.rollouts)


def _latency(requests: list[tuple[float, float]]) -> dict[str, float]:
    seconds = sorted(end - start for start, end in requests)
    if not seconds:
        return {}
    return {"p50_s": round(statistics.median(seconds), 3), "p95_s": round(seconds[int(0.95 * (len(seconds) - 1))], 3),
            "max_s": round(seconds[-1], 3)}


def _base_model(config: LoadConfig, scratch: Path) -> tuple[str, str]:
    if config.model == "tiny":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from faults.tiny import build_tiny_model

        return str(build_tiny_model(scratch / "tiny")), "tiny random Llama (hidden 32, 2 layers), tests/faults/tiny.py"
    from art_nb.local.plan.base_models import TINY_MODEL, resolve_base_model

    resolved = resolve_base_model(TINY_MODEL)
    return TINY_MODEL, f"{TINY_MODEL} ({resolved.source}: {resolved.path})"


async def run_load(config: LoadConfig, scratch: Path) -> dict[str, Any]:
    """Run both waves and the train step; return everything measured (see the module docstring)."""
    base_model, described = _base_model(config, scratch)
    model_config = art.ModelConfig(max_seq_len=512, lora=art.LoraConfig(rank=8, alpha=16))
    if config.model == "tiny":
        model_config = art.ModelConfig(max_seq_len=256, lora=art.LoraConfig(rank=4, alpha=8))
    backend = art.LocalBackend(path=scratch / "art")
    model = art.TrainableModel(name="load", project="bench", base_model=base_model, config=model_config)
    rss = RssSampler()
    started = time.perf_counter()
    try:
        await model.register(backend)
        engine = backend._state(model).engine
        warm = Recorder()
        train_groups = await wave(model, LoadConfig(**{**asdict(config), "rollouts": config.train_groups * GROUP_SIZE,
                                                       "turns": 1}), warm, offset=10**6)
        baseline = rss.now()

        # Wave 1, with a train step once a third of its requests have been answered.
        first = Recorder()
        first.target = max(1, config.rollouts * config.turns // 3)
        wave1_start = time.perf_counter()
        gathering = asyncio.ensure_future(wave(model, config, first, offset=0))
        third = asyncio.ensure_future(first.third.wait())
        await asyncio.wait({gathering, third}, return_when=asyncio.FIRST_COMPLETED)
        third.cancel()
        in_flight_at_train = backend._runtime.gate.in_flight
        train_start = time.perf_counter()
        result = await model.train(train_groups, config=art.TrainConfig(learning_rate=1e-4, loss="ppo"))
        served_after = model.get_inference_name()  # read while the backend is open (it names the served step)
        first.train_window = (train_start, time.perf_counter())
        groups1 = await gathering
        wave1_time = time.perf_counter() - wave1_start
        after_wave1 = rss.now()

        # Wave 2 on the trained model.
        second = Recorder()
        wave2_start = time.perf_counter()
        groups2 = await wave(model, config, second, offset=10**5)
        wave2_time = time.perf_counter() - wave2_start
        after_wave2 = rss.now()
    finally:
        rss.stop()
        await backend.close()

    assert first.train_window is not None
    t0, t1 = first.train_window
    waited = sum(1 for start, end in first.requests if start < t1 and end > t0)
    failures = first.failures + second.failures + warm.failures
    peak = max(mb for _, mb in rss.samples)
    return {
        "config": asdict(config),
        "model": described,
        "waves": [
            {"name": "wave 1 (train step in the middle)", "rollouts": config.rollouts,
             "completed_rollouts": sum(len(g) for g in groups1), "requests": len(first.requests),
             "failed_requests": len(first.failures), "wall_s": round(wave1_time, 2), **_latency(first.requests)},
            {"name": "wave 2 (after the step)", "rollouts": config.rollouts,
             "completed_rollouts": sum(len(g) for g in groups2), "requests": len(second.requests),
             "failed_requests": len(second.failures), "wall_s": round(wave2_time, 2), **_latency(second.requests)},
        ],
        "train": {
            "step": result.step, "seconds": round(t1 - t0, 2), "tokens_trained": result.metrics.get("tokens_trained"),
            "phases_s": {k.removeprefix("time/"): round(v, 3) for k, v in result.metrics.items() if k.startswith("time/")},
            "requests_in_engine_when_it_started": in_flight_at_train,
            "requests_that_overlapped_it": waited,
            "served_after": served_after,
        },
        "memory_mb": {
            "after_register_and_warmup": round(baseline, 1), "peak": round(peak, 1),
            "after_wave_1": round(after_wave1, 1), "after_wave_2": round(after_wave2, 1),
            "peak_over_baseline": round(peak - baseline, 1), "wave_2_minus_wave_1": round(after_wave2 - after_wave1, 1),
            "samples": len(rss.samples),
        },
        "engine": {"max_batch_rows": engine.stats.max_batch_size, "forward_steps": engine.stats.steps,
                   "tokens_sampled": engine.stats.tokens},
        "failures": failures[:5],
        "failed_requests": len(failures),
        "total_s": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=256)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "load_endpoint.json")
    args = parser.parse_args()
    config = LoadConfig(rollouts=args.rollouts, turns=args.turns, max_tokens=args.max_tokens, model=args.model)
    import torch

    with tempfile.TemporaryDirectory() as scratch:
        report = asyncio.run(run_load(config, Path(scratch)))
    report = {
        "command": " ".join(["python bench/load_endpoint.py", *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "load_average_1m_at_end": round(os.getloadavg()[0], 2), "torch_threads": torch.get_num_threads()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "art_nb": art.__version__},
        **report,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("waves", "train", "memory_mb", "failed_requests", "total_s")}, indent=2))
    sys.exit(1 if report["failed_requests"] else 0)


if __name__ == "__main__":
    main()
