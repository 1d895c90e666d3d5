"""What the dashboard knows about a run, built from events and history lines. No widgets, no plotting.

Kept apart from the widget so it is testable in milliseconds and so the text fallback, the figure and
the live widget all read one source. Events arrive from two threads (the notebook's loop emits
`gather_progress`; the backend's loop emits `log`, `train_started`, `train_finished`), so every
change happens under a lock and readers take a `snapshot()`.

Step numbering follows the backend: step `s` is the rollouts gathered with the weights of step `s`
(the `log` event of split "train" at step `s`) and the update made from them (the `train_finished`
event that reports the new step `s + 1`). Rollout time is not reported by the core; it is measured
here as the time from the end of the previous update (or from when watching started) to the moment
the step's rollouts were logged, so it covers the whole gather plus any user code around it.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..records import UNTRAINABLE_FIX

__all__ = ["TIMING_PARTS", "TRAINER_PREFIX", "RunState", "StepRecord"]

TRAINER_PREFIX = "trainer/"
"""Trainer metrics are shown as `trainer/loss` etc., so they never collide with a rollout metric
named the same (tic-tac-toe has a `loss` outcome rate)."""

TIMING_PARTS: tuple[tuple[str, str], ...] = (
    ("rollout", "rollout"),
    ("time/pause", "pause"),
    ("time/train", "train"),
    ("time/save", "checkpoint"),
    ("time/swap", "swap"),
)
"""(metric key, label) of each part of a step, in the order they happen."""

_REWARD_KEYS = {"reward", "reward_std", "reward_min", "reward_max", "trajectories"}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


@dataclass
class StepRecord:
    """One training step: its rollouts' rewards and metrics, the update's metrics and timings."""

    step: int
    reward: float | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    reward_std: float | None = None
    rollout_metrics: dict[str, float] = field(default_factory=dict)
    train_metrics: dict[str, float] = field(default_factory=dict)
    rollout_seconds: float | None = None
    groups_total: int | None = None
    checkpoint: str | None = None

    @property
    def trained(self) -> bool:
        return bool(self.train_metrics)

    @property
    def zero_variance_groups(self) -> int | None:
        value = self.train_metrics.get("zero_variance_groups")
        return None if value is None else int(value)

    @property
    def untrainable(self) -> int:
        """Trajectories of this step with 0 trainable tokens (no Choice: their turns were stored as dicts)."""
        return int(self.train_metrics.get("untrainable_trajectories") or 0)

    def warning(self) -> str | None:
        """What to tell the user about this step's update, or None when nothing is amiss."""
        if not self.untrainable:
            return None
        return (f"{self.untrainable} trajector{'y' if self.untrainable == 1 else 'ies'} with 0 trainable tokens: "
                f"{UNTRAINABLE_FIX}")

    @property
    def total_groups(self) -> int | None:
        if self.groups_total is not None:
            return self.groups_total
        used, zero = self.train_metrics.get("groups"), self.train_metrics.get("zero_variance_groups")
        return None if used is None or zero is None else int(used + zero)

    def timings(self) -> dict[str, float]:
        """Seconds per part of the step (only the parts that were measured)."""
        parts = {"rollout": self.rollout_seconds} | {key: self.train_metrics.get(key) for key, _ in TIMING_PARTS[1:]}
        return {key: value for key, value in parts.items() if value is not None and math.isfinite(value)}

    def metric(self, name: str) -> float | None:
        if name == "reward":
            return self.reward
        if name.startswith(TRAINER_PREFIX):
            return self.train_metrics.get(name[len(TRAINER_PREFIX):])
        return self.rollout_metrics.get(name)


class RunState:
    """Everything the dashboard shows, updated by `handle(event)` and `load_history(records)`."""

    def __init__(self, model_name: str | None = None, *, now: float | None = None) -> None:
        self.model_name = model_name
        self.steps: dict[int, StepRecord] = {}
        self.evals: dict[int, dict[str, float]] = {}
        self.progress: dict[str, Any] | None = None
        self.errors: list[str] = []
        self.latest_checkpoint: str | None = None
        self.served_step: int | None = None
        self.training_step: int | None = None  # the step being trained right now
        self._last_boundary = time.time() if now is None else now  # end of the last update, or start
        self._lock = threading.RLock()

    # ---- input -------------------------------------------------------------------------------

    def handle(self, event: Mapping[str, Any]) -> str | None:
        """Apply one event; return what changed or None: "progress" (a rollout finished), "rollouts"
        (a step's rewards), "training" (an update started), "train" (it finished), "eval"."""
        kind = event.get("type")
        if self.model_name is not None and event.get("model", self.model_name) != self.model_name:
            return None
        with self._lock:
            if kind == "gather_progress":
                self.progress = {k: event.get(k) for k in ("desc", "done", "total", "reward_mean", "exceptions")}
                return "progress"
            if kind == "log":
                return self._on_log(event)
            if kind == "train_started":
                record = self._step(int(event["step"]))
                if event.get("groups") is not None:
                    record.groups_total = int(event["groups"])
                self.training_step = record.step
                return "training"
            if kind == "train_finished":
                return self._on_train_finished(event)
        return None

    def _on_log(self, event: Mapping[str, Any]) -> str:
        step, metrics = int(event["step"]), dict(event.get("metrics") or {})
        self.progress = None  # the gather that produced these rollouts is over
        if event.get("split", "train") != "train":
            self.evals[step] = {k: v for k, v in ((k, _number(v)) for k, v in metrics.items()) if v is not None}
            return "eval"
        record = self._step(step)
        self._set_rollouts(record, metrics)
        now = _number(event.get("time")) or time.time()
        if record.rollout_seconds is None:
            record.rollout_seconds = max(0.0, now - self._last_boundary)
        return "rollouts"

    def _on_train_finished(self, event: Mapping[str, Any]) -> str:
        new_step = int(event["step"])
        record = self._step(new_step - 1)
        record.train_metrics = {k: v for k, v in ((k, _number(v)) for k, v in (event.get("metrics") or {}).items())
                                if v is not None}
        record.checkpoint = event.get("checkpoint")
        self.latest_checkpoint = record.checkpoint or self.latest_checkpoint
        self.served_step = new_step
        self.training_step = None
        self._last_boundary = _number(event.get("time")) or time.time()
        return "train"

    def _set_rollouts(self, record: StepRecord, metrics: Mapping[str, Any]) -> None:
        values = {k: v for k, v in ((k, _number(v)) for k, v in metrics.items()) if v is not None}
        record.reward = values.get("reward")
        record.reward_min = values.get("reward_min")
        record.reward_max = values.get("reward_max")
        record.reward_std = values.get("reward_std")
        record.rollout_metrics = {k: v for k, v in values.items() if k not in _REWARD_KEYS}

    def _step(self, step: int) -> StepRecord:
        if step not in self.steps:
            self.steps[step] = StepRecord(step)
        return self.steps[step]

    def load_history(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Fill in steps from `history.jsonl` lines (a resumed run shows its past at once).

        Per train step the backend writes two lines, both prefixed "train/": the rollout summary,
        then the update's metrics (recognised by its "train/time/..." keys).
        """
        with self._lock:
            for record in records:
                split, step = record.get("split"), record.get("step")
                if not isinstance(step, int) or not isinstance(split, str):
                    continue
                prefix = f"{split}/"
                metrics = {k[len(prefix):]: v for k, v in record.items() if k.startswith(prefix)}
                if split != "train":
                    self.evals[step] = {k: v for k, v in ((k, _number(v)) for k, v in metrics.items()) if v is not None}
                elif any(k.startswith("time/") for k in metrics):
                    target = self._step(step)
                    target.train_metrics = {k: v for k, v in ((k, _number(v)) for k, v in metrics.items())
                                            if v is not None}
                    self.served_step = max(self.served_step or 0, step + 1)
                else:
                    self._set_rollouts(self._step(step), metrics)

    def add_error(self, message: str) -> None:
        with self._lock:
            if not self.errors or self.errors[-1] != message:
                self.errors.append(message)
            del self.errors[:-20]  # the most recent are the useful ones

    # ---- output ------------------------------------------------------------------------------

    def snapshot(self) -> RunState:
        """A consistent copy to read from another thread (plotting takes a while)."""
        with self._lock:
            copied = copy.copy(self)
            copied.steps = copy.deepcopy(self.steps)
            copied.evals = copy.deepcopy(self.evals)
            copied.progress = copy.copy(self.progress)
            copied.errors = list(self.errors)
            return copied

    def ordered(self) -> list[StepRecord]:
        return [self.steps[s] for s in sorted(self.steps)]

    def metric_names(self) -> list[str]:
        """Every metric that can be plotted: rollout metrics, then the trainer's (timings excluded)."""
        rollout = sorted({k for r in self.steps.values() for k in r.rollout_metrics})
        trainer = sorted({TRAINER_PREFIX + k for r in self.steps.values() for k in r.train_metrics
                          if not k.startswith("time/")})
        return rollout + trainer

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """(steps, values) of metric `name`, skipping steps that do not have it."""
        points = [(r.step, r.metric(name)) for r in self.ordered()]
        kept = [(s, v) for s, v in points if v is not None]
        return [s for s, _ in kept], [v for _, v in kept]

    def reward_rows(self) -> list[StepRecord]:
        return [r for r in self.ordered() if r.reward is not None]

    def text(self) -> str:
        """A plain-text report: the live view where widgets do not render, and the summary's body."""
        name = f" {self.model_name}" if self.model_name else ""
        lines = [f"art_nb run{name}: {len(self.reward_rows())} steps with rewards, served step {self.served_step}"]
        lines.append(f"{'step':>5} {'reward':>8} {'min':>7} {'max':>7} {'zero-var':>8} {'exc':>4} "
                     f"{'rollout':>8} {'train':>7} {'ckpt':>6}")
        for r in self.ordered():
            t = r.timings()
            zero = "-" if r.zero_variance_groups is None else f"{r.zero_variance_groups}/{r.total_groups}"
            lines.append(
                f"{r.step:>5} {_fmt(r.reward, 8)} {_fmt(r.reward_min, 7)} {_fmt(r.reward_max, 7)} {zero:>8} "
                f"{int(r.rollout_metrics.get('exceptions', 0)):>4} {_fmt(t.get('rollout'), 8, 's')} "
                f"{_fmt(t.get('time/train'), 7, 's')} {_fmt(t.get('time/save'), 6, 's')}"
                + (f"  ! {r.warning()}" if r.warning() else "")
            )
        for step, metrics in sorted(self.evals.items()):
            base = " (the base model)" if step == 0 else ""
            lines.append(f"eval at step {step}{base}: reward {_fmt(metrics.get('reward'), 0)}")
        if self.latest_checkpoint:
            lines.append(f"latest checkpoint: {self.latest_checkpoint}")
        lines += [f"error: {e.splitlines()[0] if e else e}" for e in self.errors[-3:]]
        return "\n".join(lines)


def _fmt(value: float | None, width: int, unit: str = "") -> str:
    text = "-" if value is None or not math.isfinite(value) else f"{value:.3f}" if not unit else f"{value:.1f}{unit}"
    return f"{text:>{width}}"
