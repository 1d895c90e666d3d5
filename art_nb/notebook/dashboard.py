"""`Dashboard`: the live view of a training run, built from core ipywidgets and fed by `art_nb.events`.

    dashboard = Dashboard(model, backend, metric="win")
    with dashboard:                       # shows the live view under this cell, records exceptions
        for step in range(await model.get_step(), STEPS):
            groups = await art.gather_trajectory_groups(...)
            await model.train(groups)
    dashboard.summary()                   # the static summary (table + PNG), also for GitHub/nbconvert

What it shows: the reward curve (mean with the min-max band per step, eval points), one metric the
user picks, the time each step spent in rollouts / pause / train / checkpoint / swap, zero-variance
groups, exceptions and warnings, the latest checkpoint, and the sample trajectories of each step.

Only core widgets (HTML, Image, Dropdown, Box), and nothing newer than ipywidgets 7.7, so it renders
in Colab's built-in widget manager, JupyterLab, Notebook 7 and VS Code. Where widgets do not render
at all (nbconvert, GitHub), the same output carries a text report and a PNG of the plots; those are
refreshed after every step through the display id, so a saved notebook shows the latest state.

Events come from the backend's thread; widget changes are handed to the notebook's own event loop
(the one that created the dashboard) when it is running, so all widget traffic leaves one thread.
Re-running the cell that creates a dashboard replaces the previous one for the same model.
"""

from __future__ import annotations

import asyncio
import base64
import html
import logging
import threading
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .. import events
from .state import TIMING_PARTS, TRAINER_PREFIX, RunState
from .summary import TrainingSummary, load_run_files, summarize

if TYPE_CHECKING:
    from ..backend import Backend
    from ..model import Model

__all__ = ["Dashboard"]

_WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
_PROGRESS_INTERVAL_S = 0.25
_ACTIVE: dict[str, Dashboard] = {}
_log = logging.getLogger("art_nb.notebook")


class _WarningsToDashboard(logging.Handler):
    """Warnings and errors from the `art_nb` logger (non-finite steps, engine trouble) land in the view."""

    def __init__(self, dashboard: Dashboard) -> None:
        super().__init__(level=logging.WARNING)
        self.dashboard = dashboard

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.dashboard._add_error(f"{record.levelname.lower()}: {record.getMessage()}")
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


class Dashboard:
    """A live training dashboard for `model` (needs the `notebook` extra: ipywidgets, matplotlib).

    `backend` (default: the one `model` is registered with) or `model_dir` locates the run's files:
    past steps load from `history.jsonl` and the trajectory viewer reads `trajectories/`. `metric`
    picks the second plot (changeable in the view).
    """

    def __init__(
        self,
        model: Model | None = None,
        backend: Backend | None = None,
        *,
        metric: str | None = None,
        title: str | None = None,
        model_dir: str | Path | None = None,
    ) -> None:
        import ipywidgets as widgets

        from .viewer import TrajectoryViewer

        self.model_dir = Path(model_dir) if model_dir is not None else _model_dir(model, backend)
        self.model_name = model.name if model is not None else (self.model_dir.name if self.model_dir else None)
        self.title = title or (f"{self.model_name}" if self.model_name else "training")
        self.state = RunState(self.model_name)
        if self.model_dir is not None:
            load_run_files(self.state, self.model_dir)
        self._metric = metric
        self._png = b""
        self._handles: list[Any] = []
        self._last_progress = 0.0
        self._closed = False
        self._setting_picker = False  # options/value set by the dashboard, not picked by the user
        self._failures_shown: set[str] = set()  # each distinct rendering failure is logged once
        self._owner_thread = threading.get_ident()
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

        self._header = widgets.HTML()
        self._plot = widgets.Image(format="png", layout=widgets.Layout(max_width="100%", height="auto"))
        self._plot.add_class("art-nb-reward-plot")
        self._caption = widgets.HTML()
        self._caption.add_class("art-nb-plot-caption")
        self._metric_picker = widgets.Dropdown(options=[], description="metric", layout=widgets.Layout(width="300px"))
        self._facts = widgets.HTML()
        self._timing = widgets.HTML()
        self._errors = widgets.HTML()
        self._errors.add_class("art-nb-errors")
        self._viewer = TrajectoryViewer(self.model_dir)
        self.widget = widgets.VBox([
            self._header,
            self._plot,
            widgets.HBox([self._metric_picker, self._caption]),
            self._facts,
            self._timing,
            self._errors,
            widgets.HTML("<b>Sample trajectories</b>"),
            self._viewer.widget,
        ])
        self.widget.add_class("art-nb-dashboard")
        self._metric_picker.observe(self._on_metric, names="value")

        key = str(self.model_dir or self.model_name or id(self))
        previous = _ACTIVE.get(key)
        if previous is not None:
            previous.close()
        _ACTIVE[key] = self
        self._unsubscribe = events.subscribe(self._on_event)
        self._log_handler = _WarningsToDashboard(self)
        logging.getLogger("art_nb").addHandler(self._log_handler)
        self._apply("all")

    # ---- events in -----------------------------------------------------------------------------

    def _on_event(self, event: dict[str, Any]) -> None:
        change = self.state.handle(event)
        if change is None:
            return
        if change == "progress":
            now = time.monotonic()
            progress = self.state.progress or {}
            if now - self._last_progress < _PROGRESS_INTERVAL_S and progress.get("done") != progress.get("total"):
                return
            self._last_progress = now
        self._schedule(change)

    def _add_error(self, message: str) -> None:
        self.state.add_error(message)
        self._schedule("errors")

    def _schedule(self, change: str) -> None:
        """Apply `change` on the notebook's thread (directly when already there)."""
        if self._closed:
            return
        loop = self._loop
        if threading.get_ident() == self._owner_thread or loop is None or loop.is_closed() or not loop.is_running():
            self._apply(change)
        else:
            loop.call_soon_threadsafe(self._apply, change)

    def _apply(self, change: str) -> None:
        try:
            if change in ("all", "rollouts", "train", "eval", "metric"):
                self._render_plot()
            if change in ("all", "rollouts", "train", "eval"):
                self._viewer.refresh()
            self._render_text()
            if change in ("train", "eval", "final"):
                self._update_static()
        except Exception as error:  # noqa: BLE001 - a broken view must not stop training, but it says so
            what = f"{type(error).__name__}: {error}"
            if what not in self._failures_shown:
                self._failures_shown.add(what)
                _log.warning("dashboard update failed (%s); the view may be out of date", what)
            _log.debug("dashboard update failed", exc_info=True)

    def _on_metric(self, change: dict[str, Any]) -> None:
        if self._setting_picker:
            return
        if change["new"] and change["new"] != self._metric:
            self._metric = change["new"]
            self._apply("metric")

    # ---- rendering -----------------------------------------------------------------------------

    def _render_plot(self) -> None:
        from .figures import dashboard_figure, figure_png

        snap = self.state.snapshot()
        names = snap.metric_names()
        if self._metric is None and names:
            self._metric = _default_metric(names)
        options = names if self._metric is None or self._metric in names else [self._metric, *names]
        self._setting_picker = True
        try:  # setting options may reset the value (ipywidgets 7 and 8 differ): put the pick back
            if list(self._metric_picker.options) != options:
                self._metric_picker.options = options
            if self._metric is not None and self._metric_picker.value != self._metric:
                self._metric_picker.value = self._metric
        finally:
            self._setting_picker = False
        self._png = figure_png(dashboard_figure(snap, self._metric, f"{self.title}: reward per step"))
        self._plot.value = self._png
        rows = snap.reward_rows()
        self._caption.value = (f"<span class='art-nb-plot-steps' data-steps='{len(rows)}'>reward plot: "
                               f"{len(rows)} step{'s' if len(rows) != 1 else ''}</span>")

    def _render_text(self) -> None:
        snap = self.state.snapshot()
        rows = snap.reward_rows()
        last = rows[-1] if rows else None
        status = []
        if snap.served_step is not None:
            status.append(f"serving step {snap.served_step}")
        if snap.training_step is not None:
            status.append(f"training on step {snap.training_step}'s rollouts…")
        progress = snap.progress
        if progress and progress.get("total"):
            mean = progress.get("reward_mean")
            status.append(f"{html.escape(str(progress.get('desc') or 'rollouts'))}: {progress.get('done')}/"
                          f"{progress.get('total')}" + (f", mean reward {mean:.3f}" if mean is not None else ""))
        if last is not None:
            status.append(f"last reward {last.reward:.3f} (step {last.step})")
        self._header.value = (f"<div style='font-size:110%'><b>{html.escape(self.title)}</b> · "
                              + " · ".join(status or ["waiting for the first step"]) + "</div>")

        facts = []
        trained = [r for r in snap.ordered() if r.zero_variance_groups is not None]
        if trained:
            r = trained[-1]
            facts.append(f"zero-variance groups at step {r.step}: <b>{r.zero_variance_groups}/{r.total_groups}</b> "
                         "<span style='opacity:.7'>(every rollout scored the same: nothing to learn from)</span>")
        warned = [r for r in snap.ordered() if r.warning()]
        if warned:
            r = warned[-1]
            facts.append(f"<span style='color:#b45309' class='art-nb-untrainable'>step {r.step}: "
                         f"<b>{html.escape(r.warning() or '')}</b></span>")
        exceptions = sum(int(r.rollout_metrics.get("exceptions", 0)) for r in snap.ordered())
        live = int((progress or {}).get("exceptions") or 0)
        facts.append(f"rollout exceptions: <b>{exceptions + live}</b>")
        if snap.latest_checkpoint:
            facts.append(f"latest checkpoint: <code>{html.escape(snap.latest_checkpoint)}</code>")
        self._facts.value = "<br>".join(facts)

        timed = [r for r in snap.ordered() if r.timings()]
        if timed:
            t = timed[-1].timings()
            parts = " · ".join(f"{label} {t[key]:.1f}s" for key, label in TIMING_PARTS if key in t)
            self._timing.value = f"step {timed[-1].step} time: {parts} (total {sum(t.values()):.1f}s)"
        if snap.errors:
            items = "".join(f"<li><pre style='white-space:pre-wrap;margin:0'>{html.escape(e)}</pre></li>"
                            for e in snap.errors[-5:])
            self._errors.value = f"<div style='color:#b91c1c'><b>Exceptions and warnings</b><ul>{items}</ul></div>"

    def _bundle(self) -> dict[str, Any]:
        bundle: dict[str, Any] = {
            _WIDGET_MIME: {"version_major": 2, "version_minor": 0, "model_id": self.widget.model_id},
            "text/plain": self.state.text(),
        }
        if self._png:
            bundle["image/png"] = base64.b64encode(self._png).decode("ascii")
        return bundle

    def _update_static(self) -> None:
        """Refresh the text + PNG that frontends without widgets show (and saved notebooks keep)."""
        for handle in self._handles:
            handle.update(self._bundle(), raw=True)

    # ---- public --------------------------------------------------------------------------------

    def show(self) -> None:
        """Display the live view here (call it in the cell that trains: the view updates while it runs)."""
        from IPython.display import display

        handle = display(self._bundle(), raw=True, display_id=True)
        if handle is not None:
            self._handles = [*self._handles[-2:], handle]

    def __enter__(self) -> Dashboard:
        self.show()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if error is not None:
            if isinstance(error, (KeyboardInterrupt, asyncio.CancelledError)):
                self.state.add_error("interrupted: the last complete checkpoint is kept; re-run the cell to resume")
            else:
                self.state.add_error(_error_text(error, tb))
        self._apply("final")
        return False  # never swallow the exception: the cell still fails visibly

    def summary(self, out_dir: str | Path | None = None) -> TrainingSummary:
        """The static summary (Markdown table + PNG); with `out_dir`, also written there as files."""
        result = summarize(self.state, f"{self.title}: reward per step", self._metric)
        if out_dir is not None:
            result.save(out_dir)
        return result

    def close(self) -> None:
        """Stop listening (the widget stays on screen, frozen)."""
        if self._closed:
            return
        self._closed = True
        self._unsubscribe()
        logging.getLogger("art_nb").removeHandler(self._log_handler)
        for key, value in list(_ACTIVE.items()):
            if value is self:
                del _ACTIVE[key]

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return self._bundle()


def _model_dir(model: Model | None, backend: Backend | None) -> Path | None:
    """Where the run's records are, or None before the model is registered (nothing to read yet)."""
    if model is None:
        return None
    try:
        return (backend or model.backend).model_dir(model)
    except RuntimeError:  # not registered (with that backend) yet
        return None


def _error_text(error: BaseException, tb: TracebackType | None) -> str:
    """The error itself first (the text fallback keeps a message's first line), then where it was raised."""
    text = f"{type(error).__name__}: {error}".strip()
    frames = traceback.extract_tb(tb) if tb is not None else []
    if frames:
        text += f"\n(raised in {Path(frames[-1].filename).name}, line {frames[-1].lineno}, in {frames[-1].name})"
    return text


def _default_metric(names: list[str]) -> str:
    """A game metric when there is one (it says more than the loss), else the trainer's loss."""
    rollout = [n for n in names if not n.startswith(TRAINER_PREFIX) and n != "exceptions"]
    if rollout:
        return rollout[0]
    return TRAINER_PREFIX + "loss" if TRAINER_PREFIX + "loss" in names else names[0]
