"""The dashboard's figure: reward curve, one picked metric, and where each step's time went.

Drawn on a bare `matplotlib.figure.Figure` with the Agg canvas, never through pyplot: pyplot would
register the figure with the notebook's inline backend, which then displays a stray copy under the
cell, and it keeps global state that is not safe to touch from the backend's thread.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from .plots import draw_reward
from .state import TIMING_PARTS, RunState

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["dashboard_figure", "figure_png"]

_TIMING_COLORS = ("tab:green", "tab:gray", "tab:red", "tab:purple", "tab:brown")


def dashboard_figure(state: RunState, metric: str | None = None, title: str | None = None) -> Figure:
    """Three panels from `state` (take a `snapshot()` first when events may arrive meanwhile)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11.0, 3.3), dpi=90, layout="constrained")
    reward_axis, metric_axis, time_axis = figure.subplots(1, 3, gridspec_kw={"width_ratios": [1.3, 1.0, 1.0]})

    rows = state.reward_rows()
    train = {
        "step": [float(r.step) for r in rows],
        "mean": [float(r.reward) for r in rows if r.reward is not None],
        "min": [float(r.reward if r.reward_min is None else r.reward_min) for r in rows if r.reward is not None],
        "max": [float(r.reward if r.reward_max is None else r.reward_max) for r in rows if r.reward is not None],
    }
    evals = sorted((step, m["reward"]) for step, m in state.evals.items() if "reward" in m)
    val = {"step": [float(s) for s, _ in evals], "mean": [float(v) for _, v in evals]}
    draw_reward(reward_axis, train, val, title or "reward per step (mean, min-max)")
    reward_axis.set_xlabel("step")

    if metric:
        steps, values = state.series(metric)
        if steps:
            metric_axis.plot(steps, values, marker="o", color="tab:green")
        metric_axis.set_title(f"{metric} per step")
    else:
        metric_axis.set_title("pick a metric")
    metric_axis.set_xlabel("step")
    metric_axis.grid(alpha=0.3)

    _draw_timings(time_axis, state)
    for axis in (reward_axis, metric_axis, time_axis):
        axis.xaxis.get_major_locator().set_params(integer=True)
    return figure


def _draw_timings(axis, state: RunState) -> None:
    """Stacked bars, one per step: rollout, pause, train, checkpoint, swap seconds."""
    records = [r for r in state.ordered() if r.timings()]
    steps = [r.step for r in records]
    bottom = [0.0] * len(records)
    for (key, label), color in zip(TIMING_PARTS, _TIMING_COLORS):
        heights = [r.timings().get(key, 0.0) for r in records]
        if any(heights):
            axis.bar(steps, heights, bottom=bottom, color=color, label=label, width=0.7)
            bottom = [b + h for b, h in zip(bottom, heights)]
    axis.set_title("seconds per step")
    axis.set_xlabel("step")
    axis.grid(alpha=0.3, axis="y")
    if records:
        axis.legend(loc="upper left", fontsize="x-small")


def figure_png(figure: Figure) -> bytes:
    """The figure as PNG bytes (Agg canvas; works headless and from any thread)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()
