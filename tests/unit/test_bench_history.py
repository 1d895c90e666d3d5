"""The run history (bench/results/history.jsonl) and what is generated from it: a row per run that outlives
its results file, and the README's results table and bench/RESULTS.md kept up to date with the files."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def load(name: str) -> Any:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def demo_summary(reward: float) -> dict[str, Any]:
    side = {"games": 32, "valid_move_rate": 0.7, "win": 0.1, "invalid": 0.8, "reward": -0.5}
    return {"base": side, "trained": {**side, "reward": reward}, "trained_step": 8, "seconds_per_step": [40.0, 90.0],
            "commit": "abc1234"}


def test_a_row_is_written_once_per_file_survives_its_file_and_follows_a_move(tmp_path: Path) -> None:
    history = load("run_history")
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    ledger = results / "history.jsonl"
    (results / "cpu_demo_summary.json").write_text(json.dumps(demo_summary(0.1)))

    added = history.update(tmp_path, ledger)
    assert [(r["benchmark"], r["commit"]) for r in added] == [("cpu_demo", "abc1234")]
    assert "mean reward -0.500 -> +0.100" in added[0]["result"]
    assert history.update(tmp_path, ledger) == []  # seen already: no second row

    rows = history.read(ledger)
    rows[0]["commit"] = "fixed00"  # a hand correction (a GPU run's commit) stays
    history.write(rows, ledger)
    (results / "cpu_demo_summary.json").rename(results / "cpu_demo_summary_old.json")
    assert history.update(tmp_path, ledger) == []
    assert history.read(ledger)[0]["file"] == "bench/results/cpu_demo_summary_old.json"
    assert history.read(ledger)[0]["commit"] == "fixed00"

    (results / "cpu_demo_summary_old.json").unlink()  # the next run replaces the file
    (results / "cpu_demo_summary.json").write_text(json.dumps(demo_summary(0.3)))
    added = history.update(tmp_path, ledger, commit="def5678")
    assert added[0]["commit"] == "def5678" and "+0.300" in added[0]["result"]
    rows = history.read(ledger)
    assert len(rows) == 2 and {r["commit"]: history.kept(r, tmp_path) for r in rows} == {"fixed00": False, "def5678": True}
    table = "\n".join(history.render(rows, tmp_path))
    assert "`cpu_demo_summary_old.json` (git history)" in table
    assert "[cpu_demo_summary.json](bench/results/cpu_demo_summary.json)" in table


def test_a_file_replaced_under_the_same_name_is_no_longer_linked_from_its_old_row(tmp_path: Path) -> None:
    history = load("run_history")
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    ledger = results / "history.jsonl"
    path = results / "cpu_demo_summary.json"
    path.write_text(json.dumps(demo_summary(0.1)))
    history.update(tmp_path, ledger)
    path.write_text(json.dumps(demo_summary(0.2)))
    history.update(tmp_path, ledger)
    old, new = history.read(ledger)
    assert not history.kept(old, tmp_path) and history.kept(new, tmp_path)


def test_a_pytest_log_and_a_failing_check_are_summarised() -> None:
    history = load("run_history")
    log = {"log": "...\nPASSED tests/gpu/test_gpu_path.py::x\n======= 8 passed, 11 warnings in 238.44s (0:03:58) =======\n"}
    assert history.headline("tests/gpu", log) == "8 passed, 11 warnings in 238.44s"
    check = {"checks": {"served_in_nf4": True, "sleep_wake_changes_nothing": False}}
    assert history.headline("check_vllm_4bit", check) == "1 of 2 checks passed; failed: sleep_wake_changes_nothing"
    assert history.headline("cpu_demo", {"base": {}}).startswith("(not summarised: KeyError")


def committed_rows() -> list[dict[str, Any]]:
    return load("run_history").read()


def test_every_results_file_in_the_tree_has_its_row() -> None:
    history = load("run_history")
    recorded = {r["sha"] for r in committed_rows()}
    missing = [str(p.relative_to(ROOT)) for p in history.sources()
               if hashlib.sha1(p.read_bytes()).hexdigest()[:12] not in recorded]
    assert not missing, f"run `.venv/bin/python bench/make_table.py` to record {missing}"


def test_the_readme_results_table_is_the_generated_one() -> None:
    table = load("make_table")
    expected = table.results_table(table.latest_rows(committed_rows()))
    assert len(expected) > 10
    assert table.readme_block(ROOT / "README.md") == expected, "run `.venv/bin/python bench/make_table.py`"


def test_results_md_is_the_generated_one() -> None:
    table = load("make_table")
    results = {name: table.load(table.RESULTS, name) for name in table.NAMES}
    expected = table.results_markdown(results, committed_rows(), "../assets/benchmarks.png")
    assert (BENCH / "RESULTS.md").read_text() == expected, "run `.venv/bin/python bench/make_table.py`"


def test_the_latest_h200_runs_are_the_ones_in_the_table() -> None:
    rows = {r["benchmark"]: r for r in load("make_table").latest_rows(committed_rows()) if r["machine"] == "NVIDIA H200"}
    assert "register 52.4 s" in rows["gpu_startup"]["result"]
    assert "peak device use 11.52 GiB" in rows["gpu_memory_fit"]["result"]
    assert "4.56 s/step" in rows["gpu_t4_vs_unsloth"]["result"] and "4.21 s/step" in rows["gpu_t4_vs_unsloth"]["result"]
    assert "step 2.99 s" in rows["gpu_step"]["result"] and "swap 0.054" in rows["gpu_step"]["result"]


def test_make_table_prints_one_line_from_the_command_line() -> None:
    done = subprocess.run([sys.executable, str(BENCH / "make_table.py"), "--one-line",
                           str(BENCH / "results" / "h200" / "gpu_step.json")], capture_output=True, text=True, check=True)
    assert done.stdout.startswith("gpu_step: model ok, art ok, trl ok; TRL step / art_nb step = 1.07")
