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


def notebook_run(mode: str, steps: int) -> dict[str, Any]:
    evals = {"0": {"reward": -0.7, "win": 0.1}, str(steps): {"reward": 0.2, "win": 0.4}}
    return {"notebook": "tic_tac_toe", "mode": mode, "steps": steps, "wall_s": 100.0 + steps, "summary": {"evals": evals}}


def test_each_notebook_of_a_runner_session_gets_its_row_and_they_move_together(tmp_path: Path) -> None:
    history = load("run_history")
    folder = tmp_path / "tests" / "gpu" / "results" / "notebooks"
    folder.mkdir(parents=True)
    ledger = tmp_path / "history.jsonl"
    (folder / "tic_tac_toe_runs.json").write_text(json.dumps([notebook_run("a100", 12), notebook_run("t4", 4)]))

    added = history.update(tmp_path, ledger, commit="abc1234")
    assert [(r["benchmark"], r["result"].split(",")[0]) for r in added] == [
        ("notebook tic_tac_toe (a100)", "12 steps"), ("notebook tic_tac_toe (t4)", "4 steps")]
    assert len({r["sha"] for r in added}) == 1 and all(history.kept(r, tmp_path) for r in added)
    assert history.update(tmp_path, ledger) == []

    (folder / "tic_tac_toe_runs.json").rename(folder / "tic_tac_toe_runs_old.json")
    assert history.update(tmp_path, ledger) == []
    assert {r["file"].rsplit("/", 1)[1] for r in history.read(ledger)} == {"tic_tac_toe_runs_old.json"}


def test_a_file_without_a_date_is_dated_by_the_commit_that_brought_its_content(tmp_path: Path) -> None:
    history = load("run_history")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    git = lambda *args, when="": subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True,
                                                env={**env, "GIT_COMMITTER_DATE": when, "GIT_AUTHOR_DATE": when})
    log = tmp_path / "tests" / "gpu" / "results" / "gpu_tests.log"
    log.parent.mkdir(parents=True)
    git("init", "-q")
    log.write_text("==== 6 passed in 100.00s ====\n")
    git("add", ".")
    git("commit", "-qm", "first session", when="2026-11-30T06:42:00+00:00")
    log.write_text("==== 8 passed in 300.00s ====\n")  # the next session replaces the log under its name
    git("commit", "-qam", "second session", when="2026-12-03T10:06:00+00:00")

    (row,) = history.rows_for(log, tmp_path)
    assert (row["date"], row["result"]) == ("2026-12-03 10:06", "8 passed in 300.00s")


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
    t4 = rows["gpu_t4_vs_unsloth"]["result"]
    assert "4.07 s/step" in t4 and "4.37 s/step" in t4 and "medians 1.10 (per step 0.80-1.16, NOT settled)" in t4
    assert "TRL / art_sync = 1.30x" in rows["gpu_step"]["result"] and "TRL / art_pipelined = 1.54x" in rows["gpu_step"]["result"]
    endpoint = rows["gpu_throughput"]["result"]
    assert "endpoint / vLLM's OpenAI server 1.29, 1.10, 1.09" in endpoint and "engine called directly 0.98, 0.64, 0.52" in endpoint


def test_make_table_prints_one_line_from_the_command_line() -> None:
    done = subprocess.run([sys.executable, str(BENCH / "make_table.py"), "--one-line",
                           str(BENCH / "results" / "h200" / "gpu_step.json")], capture_output=True, text=True, check=True)
    assert done.stdout.startswith("gpu_step: model ok, art ok, trl ok, art_pipelined ok; TRL / art_sync = 1.30x")
