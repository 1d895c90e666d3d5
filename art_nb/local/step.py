"""One train step in the in-process backend, start to finish.

The choreography, in order: record the rollouts (nothing lost: on disk before any weight changes);
hold new requests (they wait, never fail); let the engine arrange its memory and run the trainer
(`Engine.train_with`: sleeping, out-of-memory fallback and waking are the engine's business), which
waits for the previous checkpoint only just before its optimizer steps (commit.py); settle that
checkpoint (a failure rolls back and raises); hand the new adapter to the engine in memory; write
the checkpoint in the background; let requests through. What happens when things go wrong is in
backend.py's docstring.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from art_nb import events
from art_nb.config import TrainConfig
from art_nb.pipelining import policy_lag
from art_nb.records import UNTRAINABLE_FIX, check_trainable, record_groups, record_metrics
from art_nb.trajectories import TrajectoryGroup
from art_nb.types import LocalTrainResult, ProgressCallback, TrainResult

from .commit import CommitWaiter, settle, start_commit
from .engines.base import AdapterWeights
from .state import ModelState, StepControl, TrainingStoppedError

if TYPE_CHECKING:
    from .server import InferenceGate

__all__ = ["finish", "guarded", "publish", "run_to_the_end", "train"]

T = TypeVar("T")

_log = logging.getLogger("art_nb")


async def train(state: ModelState, gate: InferenceGate, groups: list[TrajectoryGroup], config: TrainConfig,
                on_progress: ProgressCallback | None, beside: bool = False) -> TrainResult:
    """One GRPO step on `groups`; returns once the new adapter is served (its checkpoint finishes later).

    A step with nothing to train because its trajectories hold no Choice is refused (ValueError)
    before anything is recorded or saved; a step where only some lack one trains the rest and
    records how many in `untrainable_trajectories`, with a warning.

    `beside`: the next step's rollouts run now (art_nb.pipelining). Requests are then held only if the
    engine sleeps for training (`Engine.train_with`'s `hold`), so an engine that serves while it
    trains keeps answering them, and the new adapter is handed over without holding them.
    """
    untrainable = check_trainable(groups)
    async with state.train_lock:
        started = time.perf_counter()
        if state.commit is not None and state.commit.done():
            await settle(state, gate)  # one that already failed rolls back and raises before anything is recorded
        reported: dict[str, float] = {"untrainable_trajectories": float(untrainable),
                                      **policy_lag(groups, state.step), **({"pipeline/beside": 1.0} if beside else {})}
        if untrainable:
            _log.warning("step %d: %d of %d trajectories have 0 trainable tokens (no Choice): %s; the rest train",
                         state.step, untrainable, sum(len(g.trajectories) for g in groups), UNTRAINABLE_FIX)
        await asyncio.to_thread(functools.partial(record_groups, skip_recorded=False), state.store,
                                state.model_name, "train", state.step, groups)
        control = StepControl()
        result = await run_to_the_end(
            _update(state, gate, groups, config, control, guarded(on_progress), reported, started, beside),
            control, "train step")
        assert result is not None  # only an interrupted step is abandoned
        return result


async def run_to_the_end(update: Coroutine[Any, Any, T], control: StepControl, what: str) -> T:
    """Run a step's update, and on an interrupt stop it the way the step can be stopped.

    Not training yet (e.g. waiting for requests to drain): just cancel. Training: ask the trainer to
    stop; it abandons the update unless the optimizer has already stepped, in which case it is saved.
    Either way the caller (holding the train lock) waits until the update has settled, then re-raises.
    """
    task = asyncio.ensure_future(update)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        control.stop.set()
        if not control.training:
            task.cancel()
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            _log.error("the interrupted %s failed: %r", what, task.exception())
        raise


async def _update(state: ModelState, gate: InferenceGate, groups: list[TrajectoryGroup], config: TrainConfig,
                  control: StepControl, on_progress: ProgressCallback | None,
                  timings: dict[str, float], started: float, beside: bool) -> TrainResult | None:
    """Hold requests (unless rollouts run beside the step), take the step, stage its checkpoint, serve
    it, and start finishing the checkpoint in the background. None when `control.stop` abandoned the step."""
    step, new_step = state.step, state.step + 1
    mark = time.perf_counter()
    try:
        if not beside:
            await gate.pause()  # inside: an interrupt while requests drain must reopen the gate too
        timings["time/pause"] = time.perf_counter() - mark
        events.emit("train_started", model=state.model_name, step=step, groups=len(groups))
        mark = time.perf_counter()
        control.training = True  # from here on only the trainer can abandon the step
        # The previous checkpoint is still being written; the trainer waits for it before its update
        before_update = CommitWaiter(state.commit)
        metrics = await state.engine.train_with(lambda: asyncio.to_thread(
            state.trainer.train_step, groups, config, control.stop.is_set, on_progress, before_update),
            hold=gate.pause)
        timings["time/train"] = time.perf_counter() - mark
        await settle(state, gate)  # done by now unless the step ended early; a failure rolls back and raises
        if state.commit_seconds is not None:  # reported with the step after it
            timings |= {"time/commit_previous": state.commit_seconds, "time/commit_wait": before_update.waited}
            state.commit_seconds = None
        if metrics.get("stopped"):
            _log.warning("step %d interrupted before the optimizer stepped: abandoned, nothing saved", step)
            return None
        if metrics.get("nonfinite_weights"):  # the update itself went bad: back to the last good weights
            await asyncio.to_thread(state.trainer.load, state.store.checkpoint_dir(step))
        _count_nonfinite(state, metrics, config)
        await publish(state, new_step, timings, keep_recent=beside)
    finally:
        gate.resume()
    result = await finish(state, "train", step, {**metrics, **timings}, started)
    state.train_metrics = dict(result.metrics)
    return result


async def publish(state: ModelState, new_step: int, timings: dict[str, float], keep_recent: bool = False) -> None:
    """Serve the trainer's update as step `new_step` and start writing its checkpoint in the background;
    `state.step` becomes `new_step`. Requests are held, or (`keep_recent`, a pipeline's rollouts running)
    still ask for the previous step, which then stays loaded as one of the recent ones.

    The update reaches the engine in memory: `time/save` is the trainer's CPU copy of the adapter
    (and RNG state), `time/swap` the engine taking it. Nothing is read from disk on this path; the
    checkpoint (adapter files from the same copy, optimizer state, fsync, rename) is commit.py's.
    """
    step = state.step
    mark = time.perf_counter()
    try:
        weights, write_state = await asyncio.to_thread(_copy_update, state)
    except Exception:
        # The update exists only in memory: go back to the last checkpoint so the trainer,
        # the disk and the served adapter agree; the next step starts from there.
        await asyncio.to_thread(state.trainer.load, state.store.checkpoint_dir(step))
        raise
    state.step = new_step  # served from memory now; on disk once the commit lands
    timings["time/save"] = time.perf_counter() - mark
    mark = time.perf_counter()
    try:
        await _serve(state, new_step, weights, keep=state.config.max_loaded_adapters if keep_recent else 1)
    finally:  # whether or not the engine took it, the update is the trainer's now: make it durable
        state.commit = start_commit(state, new_step, weights, write_state)
    timings["time/swap"] = time.perf_counter() - mark


async def finish(state: ModelState, split: str, step: int, metrics: dict[str, float], started: float,
                 **event: Any) -> LocalTrainResult:
    """Record the metrics of the update made from step `step` (served as `state.step` now) under `split`
    and announce it; the result the caller returns."""
    metrics = {**metrics, "time/step_total": time.perf_counter() - started}
    await asyncio.to_thread(record_metrics, state.store, split, step, metrics)
    checkpoint = str(state.store.checkpoint_dir(state.step))
    events.emit("train_finished", model=state.model_name, step=state.step, metrics=metrics, checkpoint=checkpoint,
                **event)
    return LocalTrainResult(step=state.step, metrics=metrics, checkpoint_path=checkpoint)


def _copy_update(state: ModelState) -> tuple[AdapterWeights, Callable[[Path], None]]:
    """The adapter as CPU tensors, and the writer of the trainer state (its RNG copied now)."""
    return state.trainer.adapter_weights(), state.trainer.snapshot_state()


async def _serve(state: ModelState, step: int, weights: AdapterWeights, keep: int) -> None:
    """Serve `step`'s adapter from memory and drop older ones from the engine beyond `keep` adapters
    (least recently used first, never one a request is using; their files stay on disk)."""
    async with state.adapter_lock:  # requests may load old steps meanwhile (adapters.py)
        await state.engine.load_adapter(state.adapter_name(step), state.store.checkpoint_dir(step), weights=weights)
        state.loaded_adapters.add(step)
        for old in state.loaded_adapters.beyond(keep, keep=step):
            await state.engine.unload_adapter(state.adapter_name(old))
            state.loaded_adapters.discard(old)


def _count_nonfinite(state: ModelState, metrics: dict[str, float], config: TrainConfig) -> None:
    if metrics.get("skipped_nonfinite"):
        state.nonfinite_in_row += 1
        _log.warning("step %d: non-finite loss or gradient, update skipped (%d in a row)",
                     state.step, state.nonfinite_in_row)
        if state.nonfinite_in_row >= config.max_nonfinite_steps:
            raise TrainingStoppedError(
                f"{state.nonfinite_in_row} consecutive updates were non-finite; training stopped. The last "
                f"good checkpoint is step {state.step} at {state.store.checkpoint_dir(state.step)}"
            )
    else:
        state.nonfinite_in_row = 0
    metrics["nonfinite_in_row"] = float(state.nonfinite_in_row)


def guarded(on_progress: ProgressCallback | None) -> ProgressCallback | None:
    """The caller's progress callback, called from the trainer's thread; its failure never fails the step."""
    if on_progress is None:
        return None

    def call(event: dict[str, Any]) -> None:
        try:
            on_progress(event)
        except Exception:  # noqa: BLE001 - a broken progress view must not stop training
            _log.exception("on_progress callback failed")

    return call
