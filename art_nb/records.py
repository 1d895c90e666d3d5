"""What a run records per step, written one way by every backend: trajectories as JSON lines, a
summary line in history.jsonl, and a "log" event for the live views.

Training and evaluation write through `record_groups` (as ART's `_log` does for both), so the
files a dashboard reads look the same whichever backend trained the model.
"""

from __future__ import annotations

import difflib
import math
import sys
import time
from typing import Any

from . import events
from .store import ModelStore
from .trajectories import Choice, Trajectory, TrajectoryGroup

__all__ = ["UNTRAINABLE_FIX", "UnknownMetricError", "as_groups", "best_step", "check_trainable", "has_choice",
           "mean_and_std", "record_groups", "record_metrics", "summarize", "trajectory_record", "unrecorded"]

UNTRAINABLE_FIX = "keep the Choice the endpoint returned in messages_and_choices"
"""How to fix a trajectory with 0 trainable tokens: only a `Choice` carries sampled tokens; an
assistant turn stored as a message dict (`{"role": "assistant", "content": ...}`) is prompt text."""


def trajectory_record(trajectory: Trajectory, group: int) -> dict[str, Any]:
    """What a person (or the dashboard) needs to read a rollout back: the conversation and its score."""
    record = {
        "group": group,
        "reward": trajectory.reward,
        "metrics": trajectory.metrics,
        "metadata": trajectory.metadata,
        # The conversation however it was built (by hand, or captured calls: Trajectory.conversation).
        "messages": trajectory.messages(),
        # Which messages the model sampled (a Choice) and which were written into the prompt: the viewer
        # labels an assistant turn that the model did not play (an example in the prompt).
        "sampled": trajectory.sampled(),
        "tools": trajectory.conversation_tools(),
        "logs": trajectory.logs,
    }
    if trajectory.initial_policy_version is not None or trajectory.final_policy_version is not None:
        # The adapter step it was sampled from, as ART names it (art_nb.pipelining: the step before, pipelined)
        record["initial_policy_version"] = trajectory.initial_policy_version
        record["final_policy_version"] = trajectory.final_policy_version
    if trajectory.additional_histories:
        record["additional_histories"] = [{"messages": h.messages(), "tools": h.tools}
                                          for h in trajectory.additional_histories]
    return record


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
                  metrics: dict[str, float] | None = None, *, skip_recorded: bool = True) -> dict[str, float]:
    """Write the groups' trajectories and their summary (plus `metrics`) for `split` at `step`; returns
    what was recorded.

    Each group is recorded once per model and split: a group written before (ART's loop logs the
    groups `backend.train` already recorded) is skipped, unless `skip_recorded` is False (a train
    step records its batch even when the same groups trained an earlier step). With no groups left, `metrics` alone are
    recorded, and with neither nothing is written. Blocking file I/O (fsync per append): call it in
    a worker thread from async code.
    """
    where = f"{store.dir}:{split}"
    groups = [g for g in groups if not skip_recorded or where not in g._recorded]
    if not groups:
        if metrics:
            record_metrics(store, split, step, dict(metrics))
            events.emit("log", model=model_name, step=step, split=split, metrics=dict(metrics))
        return dict(metrics or {})
    records = [trajectory_record(t, group=i) for i, g in enumerate(groups) for t in g.trajectories]
    store.append_trajectories(split, step, records)
    summary = {**summarize(groups), **(metrics or {})}
    record_metrics(store, split, step, summary)
    for group in groups:
        group._recorded.add(where)
    events.emit("log", model=model_name, step=step, split=split, metrics=summary)
    return summary


def has_choice(trajectory: Trajectory) -> bool:
    """Whether any conversation of `trajectory` (the main one or an additional history) holds a Choice:
    without one it has no sampled token, so nothing of it can be trained."""
    return any(isinstance(item, Choice) for history in [trajectory, *trajectory.additional_histories]
               for item in history.conversation())  # captured calls are Choices there too


def check_trainable(groups: list[TrajectoryGroup]) -> int:
    """The number of trajectories with 0 trainable tokens because they hold no Choice.

    Raises ValueError when that leaves the step nothing to train: no trajectory holds a Choice, or
    none does in the groups whose rewards differ (the only ones GRPO learns from). Such a step used
    to "succeed", write a checkpoint and change nothing. A step whose groups all scored the same is
    a normal no-op and is not refused here.
    """
    trajectories = [t for g in groups for t in g.trajectories]
    untrainable = sum(not has_choice(t) for t in trajectories)
    signal = [t for g in groups if len(set(g.rewards())) > 1 for t in g.trajectories]
    if trajectories and (untrainable == len(trajectories) or (signal and not any(map(has_choice, signal)))):
        where = "" if untrainable == len(trajectories) else " of the groups whose rewards differ"
        raise ValueError(
            f"0 trainable tokens: no trajectory{where} holds a Choice ({untrainable} of {len(trajectories)} have "
            f"none), so this step would train nothing; nothing was trained or saved. "
            f"{_untrainable_cause([t for t in (signal or trajectories) if not has_choice(t)])}"
        )
    return untrainable


def _untrainable_cause(trajectories: list[Trajectory]) -> str:
    """Why these trajectories hold no Choice, and the fix: turns kept as dicts, or (when they hold no
    message at all) model calls a capture scope did not record, e.g. made from threads without the
    trajectory's context."""
    empty = [t for t in trajectories if not t.messages_and_choices and not t.exchanges and not t.additional_histories]
    if not empty:
        return (f"{UNTRAINABLE_FIX[0].upper()}{UNTRAINABLE_FIX[1:]} (messages_and_choices.append("
                "completion.choices[0])), not an assistant message dict built from its text: a dict is prompt "
                "context, only a Choice carries the sampled tokens")
    outside = max(t.calls_outside_context for t in empty)
    threads = (f"the rollouts made {outside} model call{'s' if outside != 1 else ''} from threads without the "
               "trajectory's context (a threading.Thread started by hand), which are recorded nowhere. Start such "
               "a thread with the rollout's context: threading.Thread(target=art.utils.carry_context(work)), or "
               "use asyncio.to_thread / a ThreadPoolExecutor, which carry it" if outside else
               "make the model calls inside `await art.trajectory(...)` (or `with art.Trajectory():`), to an art_nb "
               "endpoint (model.inference_base_url), in the rollout's own context: asyncio tasks, asyncio.to_thread "
               "and ThreadPoolExecutor work carry it; a threading.Thread needs art.utils.carry_context(work)")
    return (f"{len(empty)} of them recorded no model call: {threads}. A trajectory built by hand must "
            f"{UNTRAINABLE_FIX}")


def unrecorded(metrics: dict[str, float], recorded: dict[str, float]) -> dict[str, float]:
    """`metrics` less the entries `recorded` already holds with the same value (a train step's
    metrics, passed back to `model.log` by ART's loop), so none is written twice."""
    return {key: value for key, value in metrics.items() if key not in recorded or recorded[key] != value}


class UnknownMetricError(ValueError):
    """`delete_checkpoints(best_metric=...)` named a metric no logged step has a value of: no step would be
    kept as the best, so a typo ("val/rewrad") would delete the best checkpoint. Nothing was deleted."""


def best_step(history: list[dict[str, Any]], metric: str) -> int:
    """The step whose mean of history `metric` (e.g. "val/reward") is highest. Ties go to the later step,
    as ART's sort-then-last does. `UnknownMetricError`, naming the metrics the history has, when no
    step has a finite value of it. Every backend's `delete_checkpoints` decides through this."""
    values: dict[int, list[float]] = {}
    for line in history:
        value = line.get(metric)
        if isinstance(value, (int, float)) and math.isfinite(value) and isinstance(line.get("step"), int):
            values.setdefault(line["step"], []).append(float(value))
    means = {step: sum(v) / len(v) for step, v in values.items()}
    if not means:
        raise UnknownMetricError(_no_such_metric(history, metric))
    return max(means, key=lambda step: (means[step], step))


def _no_such_metric(history: list[dict[str, Any]], metric: str, shown: int = 30) -> str:
    known = sorted({key for line in history for key, value in line.items()
                    if key not in ("step", "split", "time") and isinstance(value, (int, float))})
    close = difflib.get_close_matches(metric, known, n=1)
    listed = ", ".join(map(repr, known[:shown])) + (f" and {len(known) - shown} more" if len(known) > shown else "")
    return (f"best_metric {metric[:200]!r}: no logged step has a value of it"
            f"{f' (did you mean {close[0]!r}?)' if close else ''}, so no checkpoint would be kept as the best; "
            f"nothing was deleted. Metrics in the history: {listed or 'none yet'} (`model.log(groups, split=...)` "
            "writes them as split/metric)")


def record_metrics(store: ModelStore, split: str, step: int, metrics: dict[str, float]) -> None:
    """One history.jsonl line: `metrics` prefixed with `split/`, at `step`."""
    store.append_history({"step": step, "split": split, "time": time.time(),
                          **{f"{split}/{k}": v for k, v in metrics.items()}})
