"""The run history: one row per benchmark or GPU-test run, kept in bench/results/history.jsonl.

bench/results/ holds the latest run of each benchmark (and the files a doc cites); a new run replaces the
old file, which leaves the tree (git keeps it). Its numbers stay here: `make_table.py` adds a row per run the first
time it sees a results file (keyed by the file's content hash) and never rewrites a row's numbers, so the
history survives the files and a row corrected by hand stays corrected (a GPU run's commit: the device's
copy of the tree may carry a stale .git, so pass `make_table.py --commit` or fix the row).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LEDGER = ROOT / "bench" / "results" / "history.jsonl"
# Where runs are kept (relative to the repository root); inputs such as the CPU step's batch are not runs.
SOURCES = ("bench/results/*.json", "bench/results/h200/*.json", "tests/gpu/results/gpu_tests*.log",
           "tests/gpu/results/vllm_*.json", "tests/gpu/results/notebooks*/*.json")
NOT_RUNS = {"cpu_train_step_batch.json"}
# Results files without a `benchmark` field, named after the script that wrote them.
_BY_PREFIX = (("cpu_demo_summary", "cpu_demo"), ("gpu_tests", "tests/gpu"), ("vllm_memory_adapter", "check_vllm_memory_adapter"),
              ("vllm_4bit", "check_vllm_4bit"), ("load_endpoint", "load_endpoint"), ("cpu_threads", "cpu_threads"),
              ("loss_menu_cpu", "loss_menu_cpu"), ("sft_warm_start_cpu", "sft_warm_start_cpu"), ("tictactoe", "gpu_tictactoe"))


def sources(root: Path = ROOT) -> list[Path]:
    return sorted(p for pattern in SOURCES for p in root.glob(pattern) if p.name not in NOT_RUNS)


def read(ledger: Path = LEDGER) -> list[dict[str, Any]]:
    if not ledger.exists():
        return []
    return [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]


def write(rows: list[dict[str, Any]], ledger: Path = LEDGER) -> None:
    rows = sorted(rows, key=lambda r: (r["date"], r["benchmark"], r["file"]))
    ledger.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def update(root: Path = ROOT, ledger: Path = LEDGER, commit: str | None = None) -> list[dict[str, Any]]:
    """Add the rows of every results file not yet recorded; a recorded file that moved gets its new path."""
    rows = read(ledger)
    by_sha: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_sha.setdefault(row["sha"], []).append(row)
    added = []
    for path in sources(root):
        sha = hashlib.sha1(path.read_bytes()).hexdigest()[:12]
        relative = str(path.relative_to(root))
        if sha in by_sha:
            for row in by_sha[sha]:
                row["file"] = relative
            continue
        new = rows_for(path, root, commit)
        by_sha[sha] = new
        rows += new
        added += new
    write(rows, ledger)
    return added


def rows_for(path: Path, root: Path = ROOT, commit: str | None = None) -> list[dict[str, Any]]:
    """A row per run the file holds. The notebook runner writes one list for all the notebooks it ran in a
    session; each is a run of its own, so each gets a row (they share the file, hence its hash)."""
    text = path.read_text()
    data: Any = json.loads(text) if path.suffix == ".json" else {"log": text}
    sha = hashlib.sha1(path.read_bytes()).hexdigest()[:12]
    rows = []
    for run in (data or [{}]) if isinstance(data, list) else [data]:
        name = benchmark_of(path, run)
        rows.append({"date": _date(path, run, root), "benchmark": name, "machine": _machine(path, run, text),
                     "commit": commit or str(run.get("commit") or run.get("git_commit") or "")[:7],
                     "result": headline(name, run), "file": str(path.relative_to(root)), "sha": sha})
    return rows


def benchmark_of(path: Path, data: dict[str, Any]) -> str:
    if "notebook" in data:
        return f"notebook {data['notebook']} ({data.get('mode')})"
    if data.get("benchmark"):
        return str(data["benchmark"])
    return next((name for prefix, name in _BY_PREFIX if path.stem.startswith(prefix)), path.stem)


def _date(path: Path, data: dict[str, Any], root: Path) -> str:
    """The run's own date, else when git recorded the file as it is now, else now (a file not committed as it is).

    The commit that last changed the file, not the one that added it: a run that replaces its predecessor's
    file under the same name (tests/gpu/results/gpu_tests.log) would otherwise take the first run's date.
    """
    found = str(data.get("date") or "")
    if found:
        return found[:16].replace("T", " ")
    git = lambda *args: subprocess.run(["git", *args, "--", str(path.relative_to(root))], cwd=root,
                                       capture_output=True, text=True, check=False).stdout
    if not git("status", "--porcelain"):
        words = git("log", "-1", "--format=%cd", "--date=format:%Y-%m-%d %H:%M").split()
        if words:
            return " ".join(words)
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M")


def _machine(path: Path, data: dict[str, Any], text: str) -> str:
    machine = data.get("machine") or {}
    if isinstance(machine, dict) and machine.get("gpu"):
        return str(machine["gpu"])
    if isinstance(machine, dict) and (machine.get("usable_cores") or machine.get("cpu_count")):
        return f"CPU, {machine.get('usable_cores') or machine['cpu_count']} cores"
    on_gpu = "h200" in path.parts or "gpu" in path.parts
    return "NVIDIA H200" if on_gpu and "H200" in text or "h200" in path.parts else "GPU" if on_gpu else "CPU"


def headline(name: str, data: dict[str, Any]) -> str:
    """One line of what a run measured, from its results file."""
    for prefix, extract in _HEADLINES:
        if name.startswith(prefix):
            try:
                return extract(data)
            except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as error:
                return f"(not summarised: {type(error).__name__} {error})"
    return _section_summaries(data)


def _section_summaries(data: dict[str, Any]) -> str:
    sections = data.get("sections") or {}
    for key in ("comparison", "verdict"):
        if isinstance(sections.get(key), dict) and sections[key].get("summary"):
            return str(sections[key]["summary"])
    found = [f"{k}: {v['summary']}" for k, v in sections.items()
             if isinstance(v, dict) and v.get("summary") and k not in ("model", "cap")]
    return "; ".join(found) or str(data.get("conclusion") or "-")


def _demo(d: dict[str, Any]) -> str:
    b, t = d["base"], d["trained"]
    steps = d["seconds_per_step"]
    text = (f"{d['trained_step']} steps ({min(steps):.0f}-{max(steps):.0f} s each), {b['games']} greedy games: "
            f"valid-move {b['valid_move_rate']:.3f} -> {t['valid_move_rate']:.3f}, win {b['win']:.3f} -> "
            f"{t['win']:.3f}, invalid games {b['invalid']:.3f} -> {t['invalid']:.3f}, mean reward "
            f"{b['reward']:+.3f} -> {t['reward']:+.3f}")
    return text + (f"; {d['wall_time_with_setup'].split(' (')[0]} with setup" if d.get("wall_time_with_setup") else "")


def _cpu_train_step(d: dict[str, Any]) -> str:
    s = d["summary"]
    return (f"art_nb {s['seconds']['art_nb']['median']:.1f} s, {s['peak_rss_mib']['art_nb'] / 1024:.1f} GiB vs TRL "
            f"{d['versions'].get('trl')} {s['seconds']['trl']['median']:.1f} s, {s['peak_rss_mib']['trl'] / 1024:.1f} GiB: "
            f"{s['ratio_trl_over_art_nb']}x")


def _endpoint_overhead(d: dict[str, Any]) -> str:
    ok = [v for v in d["sections"].values() if v.get("status") == "ok"]
    return ("overhead " + ", ".join(format(v["overhead"], "+.1%") for v in ok) + " at "
            + ", ".join(str(v["concurrency"]) for v in ok) + " concurrent")


def _per_request(d: dict[str, Any]) -> str:
    mine = next(iter(d["sections"].values()))
    other = (d.get("baseline") or {}).get("sections", {})
    other = next(iter(other.values()), {}) if other else {}
    levels = sorted({int(k.split("@")[1]) for k in mine if k.startswith("plain@")})
    cpu = lambda s, n: s.get(f"plain@{n}", {}).get("median_process_cpu_us", 0) / 1000
    text = f"{d.get('transport')}: " + " / ".join(f"{cpu(mine, n):.1f}" for n in levels)
    if other:
        base = d["baseline"]
        text += (f" ms CPU per request vs {base.get('label', 'baseline')} ({base.get('transport')}) "
                 + " / ".join(f"{cpu(other, n):.1f}" for n in levels))
    return text + " ms at " + " / ".join(map(str, levels)) + " concurrent"


def _prefix_cache(d: dict[str, Any]) -> str:
    ok = {k: v for k, v in d["sections"].items() if v.get("status") == "ok"}
    return "cache on vs off: " + ", ".join(f"{k} {v['speedup']:.2f}x" for k, v in ok.items()) + (
        "; same replies" if all(v.get("same_replies") for v in ok.values()) else "; replies differ in "
        + ", ".join(k for k, v in ok.items() if not v.get("same_replies")))


def _throughput(d: dict[str, Any]) -> str:
    comparison = d["sections"].get("comparison") or {}
    by_mode = comparison.get("startup") or {"": {"ratios": comparison.get("ratios", {})}}
    parts = []
    for mode, found in by_mode.items():
        r = found.get("ratios", {})
        if r:
            http = [v.get("endpoint_http_over_plain") for v in r.values()]
            parts.append((f"\"{mode}\" " if mode else "") + "endpoint / plain vLLM "
                         + ", ".join(f"{v['endpoint_over_plain']:.2f}" for v in r.values()) + " at " + ", ".join(r)
                         + ("" if None in http else " (over HTTP " + ", ".join(f"{x:.2f}" for x in http) + ")")
                         + _peer(r, "vllm_server", "endpoint / vLLM's OpenAI server")
                         + _engine_share(r))
    return "; ".join(parts) or _section_summaries(d)


def _peer(ratios: dict[str, Any], peer: str, label: str) -> str:
    """`label` and the endpoint's ratio over `peer` per batch (over HTTP in brackets), where the run had that peer."""
    inside = [v.get(f"endpoint_over_{peer}") for v in ratios.values()]
    if None in inside:
        return ""
    http = [v.get(f"endpoint_http_over_{peer}") for v in ratios.values()]
    return (f"; {label} " + ", ".join(f"{x:.2f}" for x in inside)
            + ("" if None in http else " (over HTTP " + ", ".join(f"{x:.2f}" for x in http) + ")"))


def _engine_share(ratios: dict[str, Any]) -> str:
    """The endpoint's rate over art_nb's engine called directly (the same engine, no HTTP, no SDK), per batch."""
    pairs = [(v.get("endpoint_over_plain"), v.get("engine_direct_over_plain")) for v in ratios.values()]
    if any(a is None or not b for a, b in pairs):
        return ""
    return "; of the engine called directly " + ", ".join(f"{a / b:.2f}" for a, b in pairs)


def _step(d: dict[str, Any]) -> str:
    sections = d["sections"]
    art, trl = sections.get("art", {}), sections.get("trl", {})
    comparison = sections.get("comparison") or {}
    if "head_to_head" in comparison:  # interleaved turns: each side's median, then the ratios with their range
        hours = comparison.get("steps_per_hour", {})
        text = ", ".join(f"{side} {per_hour:.0f} steps/hour" for side, per_hour in hours.items())
        return "; ".join([text or "no side finished", *comparison.get("verdict", "").split("; ")[:3]])
    text = f"art_nb {art['summary']}".split("; vLLM")[0] if art.get("summary") else "art_nb failed"
    if trl.get("summary"):
        text += f"; TRL {trl['summary']}".split("; vLLM")[0]
    verdict = comparison.get("summary") or ""
    return text + (f"; {verdict.split(';')[0]}" if verdict.startswith("TRL step") else "")


def _t4(d: dict[str, Any]) -> str:
    s = d["sections"]
    engine = {"hf": "transformers engine", "vllm": "vLLM"}[d.get("settings", {}).get("art_engine", "hf")]
    sides = [f"{label} " + re.sub(r" over steps \[[^]]*\]", "", s[k]["summary"]) for k, label in (("art", f"art_nb ({engine})"), ("unsloth", "Unsloth's recipe"))
             if s.get(k, {}).get("summary")]
    verdict = (s.get("comparison") or {}).get("summary", "")
    # the ratio of means, and of medians with whether they settle it (a noisy step can flip one, not both)
    said = [part.strip() for part in verdict.split(";") if part.strip().startswith(("art_nb", "medians"))]
    return "; ".join(sides + (said if verdict.startswith("art_nb") else []))


def _memory_fit(d: dict[str, Any]) -> str:
    s = d["sections"]
    kl = s.get("train_step", {}).get("metrics", {}).get("mismatch_kl")
    weights = d.get("settings", {}).get("vllm_4bit")  # "auto" follows the 4-bit trainer: NF4
    return (s["verdict"]["summary"] + f"; rollouts {s['rollouts']['seconds']} s, train step {s['train_step']['seconds']} s"
            + (f"; vLLM weights {'bf16' if weights == 'off' else 'NF4'}" if weights is not None else "")
            + (f", mismatch KL {kl:.3f}" if kl is not None else ""))


def _startup(d: dict[str, Any]) -> str:
    ok = {mode: v for mode, v in d["sections"].items() if v.get("register_s") is not None}
    first = next(iter(ok.values()), {})
    return ("register " + ", ".join(f"{v['register_s']} s \"{mode}\"" for mode, v in ok.items())
            + (f" ({first['startup'].split(':')[0]})" if first.get("startup") else ""))


def _gpu_tests(d: dict[str, Any]) -> str:
    found = re.findall(r"^=*\s*(\d+ passed.*?in [\d.]+s)", d["log"], re.MULTILINE)
    failed = re.findall(r"^=*\s*(\d+ failed.*?in [\d.]+s)", d["log"], re.MULTILINE)
    return (failed or found or ["no pytest summary in the log"])[-1]


def _notebook(d: dict[str, Any]) -> str:
    evals = d["summary"]["evals"]
    first, last = evals[min(evals, key=int)], evals[max(evals, key=int)]
    shown = [k for k in ("reward", "correct", "board_value", "max_tile", "invalid", "win") if k in first]
    return (f"{d['steps']} steps, {d['wall_s']:.0f} s top to bottom; evaluation step {min(evals, key=int)} -> "
            f"{max(evals, key=int)}: " + ", ".join(f"{k} {first[k]:.3f} -> {last[k]:.3f}" for k in shown))


def _checks(d: dict[str, Any]) -> str:
    checks = d["checks"]
    failed = [k for k, v in checks.items() if v is False]
    return f"{len(checks) - len(failed)} of {len(checks)} checks passed" + (f"; failed: {', '.join(failed)}" if failed else "")


def _gpu_tictactoe(d: dict[str, Any]) -> str:
    b = d["base"]
    curves = d.get("curves") or {"sync": d}
    return "; ".join(
        f"{mode + ': ' if len(curves) > 1 else ''}{c['trained_step']} steps in {c['training_s']:.0f} s, "
        f"{b['games']} greedy games: valid-move {b['valid_move_rate']:.2f} -> {c['trained']['valid_move_rate']:.2f}, "
        f"win {b['win']:.3f} -> {c['trained']['win']:.3f}, invalid games {b['invalid']:.3f} -> {c['trained']['invalid']:.3f}"
        for mode, c in curves.items())


def _load(d: dict[str, Any]) -> str:
    waves = d["waves"]
    return (f"{sum(w['rollouts'] for w in waves)} rollouts, {sum(w['requests'] for w in waves)} requests "
            f"({len(waves)} waves, a train step in the first): {d['failed_requests']} failed, {d['total_s']:.0f} s")


def _sft(d: dict[str, Any]) -> str:
    a, b = d["grpo_only"], d["sft_then_grpo"]
    return ("train reward per GRPO step: " + "/".join(f"{x:.3f}" for x in a["train_reward_per_step"]) + " alone, "
            + "/".join(f"{x:.3f}" for x in b["train_reward_per_step"]) + " after SFT")


_HEADLINES: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("cpu_demo", _demo), ("cpu_train_step", _cpu_train_step), ("endpoint_overhead", _endpoint_overhead),
    ("endpoint_per_request", _per_request), ("hf_prefix_cache", _prefix_cache), ("gpu_throughput", _throughput),
    ("gpu_step", _step), ("gpu_t4_vs_unsloth", _t4), ("gpu_memory_fit", _memory_fit), ("gpu_startup", _startup),
    ("tests/gpu", _gpu_tests), ("notebook ", _notebook), ("check_", _checks), ("gpu_tictactoe", _gpu_tictactoe),
    ("load_endpoint", _load), ("sft_warm_start_cpu", _sft))


def kept(row: dict[str, Any], root: Path = ROOT) -> bool:
    """Whether the tree still holds this run's file (a newer run of the same name replaces it)."""
    path = root / row["file"]
    return path.exists() and hashlib.sha1(path.read_bytes()).hexdigest()[:12] == row["sha"]


def render(rows: list[dict[str, Any]], root: Path = ROOT, base: str = "") -> list[str]:
    """Every run as a table, oldest first; a file that has left the tree is named, not linked."""
    lines = ["| date (UTC) | benchmark | machine | commit | result | file |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["date"], r["benchmark"], r["file"])):
        short = r["file"].removeprefix("bench/results/")
        where = f"[{short}]({base}{r['file']})" if kept(r, root) else f"`{short}` (git history)"
        note = f" ({r['note']})" if r.get("note") else ""
        lines.append(f"| {r['date']} | {r['benchmark']} | {r['machine']} | {r['commit'] or '-'} | "
                     f"{r['result'].replace('|', '/')}{note} | {where} |")
    return lines
