"""Trajectories as JSON lines, and the per-split summary that goes into history.jsonl."""

from __future__ import annotations

import math
import statistics
from typing import Any

from ...trajectory import Trajectory, TrajectoryGroup

__all__ = ["trajectory_record", "summarize"]


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


def summarize(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """Reward mean/std/min/max, the mean of every trajectory metric, and the exception count."""
    trajectories = [t for g in groups for t in g.trajectories]
    rewards = [t.reward for t in trajectories]
    summary: dict[str, float] = {"trajectories": float(len(trajectories))}
    summary["exceptions"] = float(sum(len(g.exceptions) for g in groups))
    if rewards:
        summary["reward"] = statistics.fmean(rewards)
        summary["reward_std"] = statistics.pstdev(rewards)
        summary["reward_min"] = min(rewards)
        summary["reward_max"] = max(rewards)
    keys = sorted({k for t in trajectories for k in t.metrics})
    for key in keys:
        values = [float(t.metrics[key]) for t in trajectories if key in t.metrics]
        values = [v for v in values if math.isfinite(v)]
        if values:
            summary[key] = statistics.fmean(values)
    return summary
