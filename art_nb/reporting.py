"""Report a model's training to W&B or trackio: one run per model, metrics per step, resumed after a restart.

    reporter = reporting.start(model, backend, report_metrics=None)   # at register
    ...                                                               # train and log as usual
    reporter.close()                                                  # optional: ends the run

`report_metrics` means what it means in ART: None is W&B when a key is found (`WANDB_API_KEY` in
Colab's secrets or the environment), else nothing; `[]` is nothing; otherwise a list of "wandb"
and/or "trackio" (the local-first alternative: its own database on this machine, or a Hugging
Face Space when TRACKIO_SPACE_ID is set).

The reporter listens to `art_nb.events` for its model, so it sees exactly what the run's files
record: each "log" event (a step's rollouts, an evaluation) becomes `{split}/{metric}` and each
"train_finished" the update's metrics as `trainer/{metric}`, both at the step whose rollouts they
belong to (the dashboard's numbering). W&B plots against `training_step`, not its own counter, so
a row logged late (the base model's evaluation at step 0, after training) still lands at step 0.

What leaves the machine is the numbers and the run's config (names, base model, art_nb version).
Trajectories' text goes only with `trajectories=True`: it may hold private data (docs/remote.md's
data-flow table). One W&B run per model, never per step: its id is kept in
`{model_dir}/wandb_run_id`, so after a kernel restart the same run continues; trackio resumes a
run by name (the model's). The W&B key is read with `secrets.find_secret` and handed to W&B's
settings: never printed, logged, or put in the environment.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, cast

from . import events
from ._version import __version__
from .secrets import MissingSecretError, Secret, find_secret
from .store import RUN_ID_FILE, read_jsonl, trajectory_files
from .types import ModelRef, TrainableModelRef

__all__ = ["KEY_NAME", "RUN_ID_FILE", "Reporter", "resolve_targets", "start"]

KEY_NAME = "WANDB_API_KEY"
TARGETS = ("wandb", "trackio")
_MAX_TRAJECTORIES = 256  # rows of one step's trajectory table
_log = logging.getLogger("art_nb")


class _HasModelDir(Protocol):
    def model_dir(self, model: Any) -> Path: ...


class Sink(Protocol):
    """Where rows go: a W&B or trackio run."""

    def log(self, row: dict[str, Any], step: int) -> None: ...

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None: ...

    def finish(self) -> None: ...


def resolve_targets(report_metrics: Sequence[str] | None) -> tuple[list[str], Secret | None]:
    """(targets, W&B key): ART's rule for None (W&B when a key is found), a list checked by name."""
    key = find_secret(None, name=KEY_NAME, required=False)
    if report_metrics is None:
        if key is not None and importlib.util.find_spec("wandb") is None:
            _log.warning("a W&B key was found but the wandb package is not installed, so metrics go to this "
                         "run's files only: pip install wandb (or report_metrics=[] to say so)")
            return [], key
        return (["wandb"] if key is not None else []), key
    if isinstance(report_metrics, str):
        raise TypeError(f"report_metrics is a list, e.g. [{report_metrics!r}]; got the string {report_metrics!r}")
    targets = list(dict.fromkeys(report_metrics))
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"report_metrics has {unknown}; use a list of {', '.join(map(repr, TARGETS))}, [] for none, "
                         "or None for W&B when a WANDB_API_KEY is found")
    if "wandb" in targets and key is None and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        raise MissingSecretError(
            f"report_metrics={targets} needs a W&B key: add a Colab secret named {KEY_NAME} (key icon in the left "
            f"panel, with notebook access on), or set the environment variable {KEY_NAME}; or set WANDB_MODE=offline "
            "to record the run on this machine only")
    return targets, key


class _WandbSink:
    """One W&B run per model directory, resumed by the id kept there."""

    def __init__(self, model: ModelRef, model_dir: Path, key: Secret | None, config: dict[str, Any]) -> None:
        import wandb

        model_dir.mkdir(parents=True, exist_ok=True)  # W&B's files go beside the run's own
        id_file = model_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        # console="off": W&B would otherwise copy the notebook's output (trajectories shown there) to the run.
        settings = wandb.Settings(console="off", **({"api_key": key.reveal()} if key is not None else {}))
        try:
            self.run = wandb.init(project=model.project, name=model.name, id=run_id, resume="allow",
                                  dir=str(model_dir), config=config, reinit="create_new", settings=settings)
        except Exception as error:  # noqa: BLE001 - W&B's errors vary; say what to do, without the key
            text = key.redact(str(error)) if key is not None else str(error)
            raise RuntimeError(f"W&B did not start a run for {model.name} ({type(error).__name__}: {text}); check "
                               f"the {KEY_NAME} Colab secret or environment variable, or set WANDB_MODE=offline") from None
        if not id_file.is_file():
            temporary = id_file.with_name(f".{RUN_ID_FILE}.{uuid.uuid4().hex}")
            temporary.write_text(run_id + "\n")
            temporary.replace(id_file)
        self.run.define_metric("training_step")
        self.run.define_metric("*", step_metric="training_step")

    def log(self, row: dict[str, Any], step: int) -> None:
        self.run.log({**row, "training_step": step})

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        import wandb

        self.run.log({key: wandb.Table(columns=columns, data=rows), "training_step": step})

    def finish(self) -> None:
        self.run.finish()


class _TrackioSink:
    """A trackio run named after the model (trackio resumes by name)."""

    def __init__(self, model: ModelRef, config: dict[str, Any]) -> None:
        import trackio

        self.run = trackio.init(project=model.project, name=model.name, config=config, resume="allow")

    def log(self, row: dict[str, Any], step: int) -> None:
        self.run.log(row, step=step)

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        return None  # trackio has no table type: the numbers only

    def finish(self) -> None:
        self.run.finish()


class Reporter:
    """Listens to one model's events and sends them to its sinks; `close()` ends the runs."""

    def __init__(self, model_name: str, model_dir: Path, sinks: dict[str, Sink], trajectories: bool) -> None:
        self.model_name, self.model_dir, self.sinks, self.trajectories = model_name, model_dir, sinks, trajectories
        self._sent: dict[tuple[str, int], int] = {}  # trajectory records already sent per (split, step)
        self._lock = threading.Lock()  # events come from the backend's thread and the notebook's
        self._unsubscribe = events.subscribe(self._on_event) if sinks else (lambda: None)

    @property
    def targets(self) -> list[str]:
        return list(self.sinks)

    def _on_event(self, event: dict[str, Any]) -> None:
        if event.get("model") != self.model_name or event.get("type") not in ("log", "train_finished"):
            return
        with self._lock:
            if event["type"] == "log":
                split, step = str(event.get("split", "train")), int(event["step"])
                self._send({f"{split}/{k}": v for k, v in _numbers(event.get("metrics")).items()}, step)
                if self.trajectories:
                    self._send_trajectories(split, step)
            else:  # the update made from step s's rollouts: reported at s, as the dashboard shows it
                step = int(event["step"]) - 1
                self._send({f"trainer/{k}": v for k, v in _numbers(event.get("metrics")).items()}, step)

    def _send(self, row: dict[str, float], step: int) -> None:
        if not row:
            return
        for target, sink in self.sinks.items():
            try:
                sink.log(row, step)
            except Exception as error:  # noqa: BLE001 - reporting must never stop training
                _log.warning("reporting step %s to %s failed: %s: %s", step, target, type(error).__name__, error)

    def _send_trajectories(self, split: str, step: int) -> None:
        path = next((p for s, n, p in trajectory_files(self.model_dir) if (s, n) == (split, step)), None)
        records = read_jsonl(path) if path is not None else []
        new = records[self._sent.get((split, step), 0):][:_MAX_TRAJECTORIES]
        self._sent[(split, step)] = len(records)
        if not new:
            return
        rows = [[r.get("group"), r.get("reward"), json.dumps(r.get("messages"), ensure_ascii=False)] for r in new]
        for target, sink in self.sinks.items():
            try:
                sink.log_table(f"{split}/trajectories", ["group", "reward", "messages"], rows, step)
            except Exception as error:  # noqa: BLE001 - reporting must never stop training
                _log.warning("sending step %s's trajectories to %s failed: %s", step, target, type(error).__name__)

    def close(self) -> None:
        """Stop listening and end the runs (a later `start` for the model resumes them)."""
        self._unsubscribe()
        for sink in self.sinks.values():
            sink.finish()
        self.sinks = {}
        with _REGISTRY_LOCK:
            if _ACTIVE.get(str(self.model_dir)) is self:
                del _ACTIVE[str(self.model_dir)]


_ACTIVE: dict[str, Reporter] = {}
_REGISTRY_LOCK = threading.Lock()


def start(model: ModelRef, backend: _HasModelDir, report_metrics: Sequence[str] | None = None, *,
          trajectories: bool = False) -> Reporter:
    """The reporter of `model` (registered with `backend`): one per model directory in a process, so
    registering again keeps the same run; a different `report_metrics` replaces it."""
    targets, key = resolve_targets(report_metrics)
    model_dir = backend.model_dir(model)
    with _REGISTRY_LOCK:
        current = _ACTIVE.get(str(model_dir))
        if current is not None and current.targets == targets and current.trajectories == trajectories:
            return current
    if current is not None:
        current.close()
    config: dict[str, Any] = {"project": model.project, "model": model.name, "art_nb": __version__,
                              "base_model": _base_model(model)}
    sinks: dict[str, Sink] = {}
    if "wandb" in targets:
        sinks["wandb"] = _WandbSink(model, model_dir, key, config)
    if "trackio" in targets:
        sinks["trackio"] = _TrackioSink(model, config)
    reporter = Reporter(model.name, model_dir, sinks, trajectories)
    if sinks:
        with _REGISTRY_LOCK:
            _ACTIVE[str(model_dir)] = reporter
    return reporter


def _base_model(model: ModelRef) -> str | None:
    return cast(TrainableModelRef, model).base_model if model.trainable else None


def _numbers(metrics: Any) -> dict[str, float]:
    """The finite-or-not numeric entries of an event's metrics (bools and text are not plotted)."""
    return {str(k): float(v) for k, v in dict(metrics or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
