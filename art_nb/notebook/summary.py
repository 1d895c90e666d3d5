"""The final static summary of a run: reward per step as a table, a PNG and a JSON file.

Static on purpose: it is what a notebook keeps once the kernel is gone (GitHub, nbconvert, a shared
.ipynb), so it is plain Markdown + PNG + text, with no widget. As the last expression of a cell it
displays itself; `save(directory)` writes `summary.json`, `summary.txt` and `reward_curve.png`.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..store import HISTORY_FILE, checkpoint_path, checkpoint_steps, checkpoints_dir, read_jsonl
from .state import RunState

__all__ = ["TrainingSummary", "load_run_files", "summarize", "summary_from_model_dir"]


@dataclass
class TrainingSummary:
    """Reward and timings per step, evaluations, the latest checkpoint, and the curve as PNG bytes."""

    model_name: str | None
    steps: list[dict[str, Any]]
    evals: dict[int, dict[str, float]]
    served_step: int | None
    checkpoint: str | None
    text: str
    png: bytes = field(repr=False, default=b"")

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "served_step": self.served_step,
            "checkpoint": self.checkpoint,
            "steps": self.steps,
            "evals": {str(step): metrics for step, metrics in sorted(self.evals.items())},
        }

    def save(self, directory: str | Path) -> dict[str, Path]:
        """Write summary.json, summary.txt and reward_curve.png into `directory`; return their paths."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / "summary.json", "text": out / "summary.txt", "png": out / "reward_curve.png"}
        paths["json"].write_text(json.dumps(self.to_dict(), indent=2, default=_json_number))
        paths["text"].write_text(self.text + "\n")
        paths["png"].write_bytes(self.png)
        return paths

    def markdown(self) -> str:
        lines = [(f"**Training summary{f' — {self.model_name}' if self.model_name else ''}**: "
                  f"{len(self.steps)} steps, now serving step {self.served_step}"), "",
                 "| step | reward (mean) | min | max | zero-variance groups | exceptions | seconds |",
                 "|---:|---:|---:|---:|---:|---:|---:|"]
        for row in self.steps:
            zero = "" if row.get("zero_variance_groups") is None else f"{row['zero_variance_groups']}/{row['groups']}"
            lines.append(f"| {row['step']} | {_f(row['reward'])} | {_f(row['reward_min'])} | {_f(row['reward_max'])} "
                         f"| {zero} | {row.get('exceptions', 0)} | {_f(sum(row['seconds'].values()) or None, 1)} |")
        warnings = [f"- step {row['step']}: {row['warning']}" for row in self.steps if row.get("warning")]
        if warnings:
            lines += ["", "**Warnings**", *warnings]
        for step, metrics in sorted(self.evals.items()):
            base = " (the base model)" if step == 0 else ""
            lines.append(f"\nEvaluation at step {step}{base}: reward {_f(metrics.get('reward'))}")
        if self.checkpoint:
            lines.append(f"\nLatest checkpoint: `{self.checkpoint}`")
        return "\n".join(lines)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        bundle: dict[str, Any] = {"text/plain": self.text, "text/markdown": self.markdown()}
        if self.png:
            bundle["image/png"] = base64.b64encode(self.png).decode("ascii")
        return bundle

    def __str__(self) -> str:
        return self.text


def summarize(state: RunState, title: str | None = None, metric: str | None = None) -> TrainingSummary:
    """A `TrainingSummary` of `state` (reads a snapshot, so it is safe while events still arrive).

    `metric` is drawn next to the reward (default: the trainer's loss)."""
    from .figures import dashboard_figure, figure_png

    snap = state.snapshot()
    steps = []
    for record in snap.reward_rows():
        steps.append({
            "step": record.step,
            "reward": record.reward,
            "reward_min": record.reward_min,
            "reward_max": record.reward_max,
            "reward_std": record.reward_std,
            "zero_variance_groups": record.zero_variance_groups,
            "groups": record.total_groups,
            "exceptions": int(record.rollout_metrics.get("exceptions", 0)),
            "trained": record.trained,
            "untrainable_trajectories": record.untrainable,
            "warning": record.warning(),
            "metrics": dict(record.rollout_metrics),
            "train_metrics": {k: v for k, v in record.train_metrics.items() if not k.startswith("time/")},
            "seconds": record.timings(),
        })
    if metric is None:
        metric = next((m for m in snap.metric_names() if m == "trainer/loss"), None)
    png = figure_png(dashboard_figure(snap, metric, title))
    return TrainingSummary(snap.model_name, steps, dict(snap.evals), snap.served_step, snap.latest_checkpoint,
                           snap.text(), png)


def summary_from_model_dir(model_dir: str | Path, title: str | None = None) -> TrainingSummary:
    """The summary of a run from its files alone (`history.jsonl`), e.g. after a kernel restart."""
    model_dir = Path(model_dir)
    state = RunState(model_dir.name)
    load_run_files(state, model_dir)
    return summarize(state, title)


def load_run_files(state: RunState, model_dir: Path) -> None:
    """Past steps from the run's history and its latest complete checkpoint, read the store's way.

    The live dashboard starts from these too, so a resumed run shows its past at once.
    """
    state.load_history(read_jsonl(model_dir / HISTORY_FILE))
    checkpoints = checkpoints_dir(model_dir)
    steps = checkpoint_steps(checkpoints)
    if steps:
        state.latest_checkpoint = str(checkpoint_path(checkpoints, steps[-1]))
        state.served_step = steps[-1]


def _f(value: float | None, digits: int = 3) -> str:
    return "" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _json_number(value: Any) -> Any:
    return str(value)
