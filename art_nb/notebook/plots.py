"""Static plots from history.jsonl: the reward curve a person looks at instead of reading numbers.

Pure matplotlib with the Agg backend, so it works headless (CI, nbconvert, GitHub) as well as in
a notebook; the live dashboard draws the same figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["draw_reward", "plot_reward_curve", "reward_series"]


def reward_series(history: Sequence[dict[str, Any]], split: str = "train") -> dict[str, list[float]]:
    """Per-step mean/min/max reward of `split`, in step order (the last record of a step wins)."""
    by_step: dict[int, dict[str, Any]] = {}
    for record in history:
        if record.get("split") == split and f"{split}/reward" in record:
            by_step[int(record["step"])] = record
    steps = sorted(by_step)

    def pick(key: str) -> list[float]:
        return [float(by_step[s].get(f"{split}/{key}", float("nan"))) for s in steps]

    return {"step": [float(s) for s in steps], "mean": pick("reward"), "min": pick("reward_min"), "max": pick("reward_max")}


def plot_reward_curve(history: Sequence[dict[str, Any]], path: str | Path | None = None, title: str = "reward"):
    """Mean reward per step with the min-max band; the train split, plus any `val` points."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    train, val = reward_series(history, "train"), reward_series(history, "val")
    draw_reward(axis, train, val, title)
    axis.set_xlabel("step (rollouts gathered with the weights of this step)")
    figure.tight_layout()
    if path is not None:
        figure.savefig(path)
        plt.close(figure)
    return figure


def draw_reward(axis: Any, train: dict[str, list[float]], val: dict[str, list[float]] | None = None,
                title: str = "reward") -> None:
    """Draw the mean train reward with its min-max band (and eval means) on a matplotlib `axis`.

    `train`/`val` have the shape `reward_series` returns. Shared by the static plot and the dashboard,
    so both read the same way.
    """
    if train["step"]:
        axis.fill_between(train["step"], train["min"], train["max"], alpha=0.2, color="tab:blue", label="train min-max")
        axis.plot(train["step"], train["mean"], marker="o", color="tab:blue", label="train mean")
    if val and val["step"]:
        axis.plot(val["step"], val["mean"], marker="s", color="tab:orange", label="eval mean")
        if 0.0 in val["step"]:  # step 0's weights are the base model's: the point training is measured from
            base = val["mean"][val["step"].index(0.0)]
            axis.annotate("base model", (0.0, base), textcoords="offset points", xytext=(6, -12),
                          fontsize="small", color="tab:orange")
    axis.set_ylabel("reward")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    if train["step"] or (val and val["step"]):
        axis.legend(loc="best", fontsize="small")
