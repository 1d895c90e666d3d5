"""Compare evaluation runs side by side: mean reward and the mean of every metric, per run.

    compare({"base": base_trajectories, "step 6": trained_trajectories})

The notebooks evaluate the base model (`model.get_inference_name(0)`) and the trained LoRA on the
same fixed scenarios; this turns the two lists into one table (Markdown in Jupyter, text elsewhere)
and a dict the notebook can assert on or save.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..trajectories import Trajectory

__all__ = ["Comparison", "compare"]


@dataclass(frozen=True)
class Comparison:
    """`table[run][row]`: mean reward, each metric's mean, and the count, per run."""

    runs: tuple[str, ...]
    rows: tuple[str, ...]
    table: dict[str, dict[str, float]]

    def __str__(self) -> str:
        width = max(12, *(len(r) + 2 for r in self.runs))
        label = max(len(row) for row in self.rows) + 2
        lines = [" " * label + "".join(f"{run:>{width}}" for run in self.runs)]
        for row in self.rows:
            lines.append(f"{row:<{label}}" + "".join(f"{_fmt(self.table[run].get(row)):>{width}}" for run in self.runs))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_markdown_(self) -> str:
        lines = ["| | " + " | ".join(self.runs) + " |", "|---|" + "---:|" * len(self.runs)]
        for row in self.rows:
            lines.append(f"| {row} | " + " | ".join(_fmt(self.table[run].get(row)) for run in self.runs) + " |")
        return "\n".join(lines)


def compare(runs: Mapping[str, Sequence[Trajectory]]) -> Comparison:
    """One column per run (in the given order): `reward` first, then metrics, then `trajectories`."""
    if not runs:
        raise ValueError("compare needs at least one run, e.g. {'base': [...], 'trained': [...]}")
    metric_names = sorted({k for trajectories in runs.values() for t in trajectories for k in t.metrics})
    table: dict[str, dict[str, float]] = {}
    for run, trajectories in runs.items():
        column: dict[str, float] = {"trajectories": float(len(trajectories))}
        if trajectories:
            column["reward"] = statistics.fmean(t.reward for t in trajectories)
        for name in metric_names:
            values = [float(t.metrics[name]) for t in trajectories if name in t.metrics]
            values = [v for v in values if math.isfinite(v)]
            if values:
                column[name] = statistics.fmean(values)
        table[run] = column
    return Comparison(tuple(runs), ("reward", *metric_names, "trajectories"), table)


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if float(value).is_integer() and abs(value) >= 10 else f"{value:.3f}"
