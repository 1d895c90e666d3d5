"""What a run records per step, written one way by every backend: trajectories as JSON lines, a
summary line in history.jsonl, and a "log" event for the live views.

Training and evaluation write through `record_groups` (as ART's `_log` does for both), so the
files a dashboard reads look the same whichever backend trained the model.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from . import events
from .store import ModelStore
from .trajectory import Trajectory, TrajectoryGroup

__all__ = ["as_groups", "mean_and_std", "record_groups", "record_metrics", "summarize", "trajectory_record"]


def trajectory_record(trajectory: Trajectory, group: int) -> dict[str, Any]:
    """What a person (or the dashboard) needs to read a rollout back: the conversation and its score."""
    return {
        "group": group,
        "reward": trajectory.reward,
        "metrics": trajectory.metrics,
        "metadata": trajectory.metadata,
        "messages": trajectory.messages(),
        "tools": trajectory.tools,
        "logs": trajectory.logs,
    }


def mean_and_std(values: list[float]) -> tuple[float, float]:
    """Mean and population std of finite values, computed on values divided by the largest magnitude so
    huge ones (rewards of 1e308) do not overflow on the way; a result too large for a float is capped."""
    size = max((abs(v) for v in values), default=0.0) or 1.0
    unit = [v / size for v in values]
    mean = sum(unit) / len(unit)
    std = math.sqrt(sum((u - mean) ** 2 for u in unit) / len(unit))
    return _capped(mean * size), _capped(std * size)


def _capped(value: float) -> float:
    return max(-sys.float_info.max, min(sys.float_info.max, value))


def summarize(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """Reward mean/std/min/max, the mean of every trajectory metric, and the exception count."""
    trajectories = [t for g in groups for t in g.trajectories]
    rewards = [t.reward for t in trajectories]
    summary: dict[str, float] = {"trajectories": float(len(trajectories))}
    summary["exceptions"] = float(sum(len(g.exceptions) for g in groups))
    if rewards:
        summary["reward"], summary["reward_std"] = mean_and_std(rewards)
        summary["reward_min"] = min(rewards)
        summary["reward_max"] = max(rewards)
    keys = sorted({k for t in trajectories for k in t.metrics})
    for key in keys:
        values = [float(t.metrics[key]) for t in trajectories if key in t.metrics]
        values = [v for v in values if math.isfinite(v)]
        if values:
            summary[key] = mean_and_std(values)[0]
    return summary


def as_groups(items: list[TrajectoryGroup | Trajectory]) -> list[TrajectoryGroup]:
    """Loose trajectories (as `log` accepts them) become one-trajectory groups."""
    return [item if isinstance(item, TrajectoryGroup) else TrajectoryGroup([item]) for item in items]


def record_groups(store: ModelStore, model_name: str, split: str, step: int, groups: list[TrajectoryGroup],
                  metrics: dict[str, float] | None = None) -> dict[str, float]:
    """Write the groups' trajectories and their summary (plus `metrics`) for `split` at `step`; returns the summary.

    Blocking file I/O (fsync per append): call it in a worker thread from async code.
    """
    records = [trajectory_record(t, group=i) for i, g in enumerate(groups) for t in g.trajectories]
    store.append_trajectories(split, step, records)
    summary = {**summarize(groups), **(metrics or {})}
    record_metrics(store, split, step, summary)
    events.emit("log", model=model_name, step=step, split=split, metrics=summary)
    return summary


def record_metrics(store: ModelStore, split: str, step: int, metrics: dict[str, float]) -> None:
    """One history.jsonl line: `metrics` prefixed with `split/`, at `step`."""
    store.append_history({"step": step, "split": split, "time": time.time(),
                          **{f"{split}/{k}": v for k, v in metrics.items()}})
