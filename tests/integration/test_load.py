"""Load, at CI size: 32 concurrent 3-turn rollouts on the in-process endpoint, a train step in the middle.

The same code as bench/load_endpoint.py (which runs 256 on SmolLM2 and commits its numbers in
bench/results/load_endpoint.json), on the tiny random Llama so it stays well under two minutes.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench" / "load_endpoint.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("load_endpoint", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


async def test_concurrent_multi_turn_rollouts_with_a_train_step_in_the_middle(tmp_path: Path) -> None:
    bench = load_bench()
    report = await bench.run_load(bench.LoadConfig(rollouts=32, turns=3, max_tokens=4, model="tiny", train_groups=4),
                                  tmp_path)
    assert report["failed_requests"] == 0, report["failures"]
    for wave in report["waves"]:
        assert wave["completed_rollouts"] == 32 and wave["requests"] == 32 * 3, wave
    train = report["train"]
    assert train["step"] == 1 and train["tokens_trained"] > 0
    assert train["requests_that_overlapped_it"] > 0, "no request was in flight during the step: it was not in the middle"
    assert report["engine"]["max_batch_rows"] > 1, "concurrent requests were not batched"
    memory = report["memory_mb"]
    assert memory["peak_over_baseline"] < 300, memory
    assert abs(memory["wave_2_minus_wave_1"]) < 50, f"memory grew with the number of requests: {memory}"
