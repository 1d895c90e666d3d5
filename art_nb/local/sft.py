"""One `train_sft` call in the in-process backend: the same choreography as a GRPO step (step.py).

Settle the previous checkpoint; record the demonstrations (history split "sft", so the run's
records say this step was supervised); hold new requests; let the engine arrange its memory and
run `trainer.sft_step` over every batch; hand the adapter to the engine as the next step; write
the checkpoint in the background; let requests through. One call is one checkpoint, as in ART, so
the next GRPO step and the served model continue from the SFT weights.

Interrupted before any batch stepped: abandoned, nothing saved. After: what was trained is saved.
Non-finite weights: put back on the last checkpoint, the step does not advance, and it is logged.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING

from art_nb import events
from art_nb.records import record_groups
from art_nb.sft_config import TrainSFTConfig
from art_nb.trajectories import Trajectory, TrajectoryGroup
from art_nb.types import LocalTrainResult, ProgressCallback, TrainResult

from .commit import settle
from .state import ModelState, StepControl
from .step import finish, guarded, publish, run_to_the_end

if TYPE_CHECKING:
    from .server import InferenceGate

__all__ = ["SFT_SPLIT", "train_sft"]

SFT_SPLIT = "sft"  # the history split and trajectory directory of supervised steps
_log = logging.getLogger("art_nb")


async def train_sft(state: ModelState, gate: InferenceGate, trajectories: list[Trajectory], config: TrainSFTConfig,
                    on_progress: ProgressCallback | None) -> TrainResult:
    """Supervised fine-tuning on `trajectories`; returns once the new adapter is served."""
    async with state.train_lock:
        started = time.perf_counter()
        await settle(state, gate)
        if not trajectories:
            return LocalTrainResult(step=state.step, metrics={"trajectories": 0.0},
                                    checkpoint_path=str(state.store.checkpoint_dir(state.step)))
        await asyncio.to_thread(functools.partial(record_groups, skip_recorded=False), state.store,
                                state.model_name, SFT_SPLIT, state.step, [TrajectoryGroup(trajectories)])
        control = StepControl()
        return await run_to_the_end(
            _update(state, gate, trajectories, config, control, guarded(on_progress), started), control, "SFT call")


async def _update(state: ModelState, gate: InferenceGate, trajectories: list[Trajectory], config: TrainSFTConfig,
                  control: StepControl, on_progress: ProgressCallback | None, started: float) -> TrainResult:
    step, new_step = state.step, state.step + 1
    timings: dict[str, float] = {}
    try:
        await gate.pause()
        events.emit("train_started", model=state.model_name, step=step, sft=True, trajectories=len(trajectories))
        mark = time.perf_counter()
        control.training = True
        metrics = await state.engine.train_with(lambda: asyncio.to_thread(
            state.trainer.sft_step, trajectories, config, control.stop.is_set, on_progress))
        timings["time/train"] = time.perf_counter() - mark
        unchanged = ""
        if metrics.get("stopped"):
            unchanged = "interrupted before any batch stepped: abandoned, nothing saved"
        elif metrics.get("skipped_nonfinite"):
            if metrics.get("nonfinite_weights"):
                await asyncio.to_thread(state.trainer.load, state.store.checkpoint_dir(step))
            unchanged = "non-finite loss, gradient or weights: no update kept"
        if unchanged:
            _log.warning("SFT from step %d %s", step, unchanged)
            return LocalTrainResult(step=step, metrics=metrics, checkpoint_path=str(state.store.checkpoint_dir(step)))
        await publish(state, new_step, timings)
    finally:
        gate.resume()
    return await finish(state, SFT_SPLIT, step, {**metrics, **timings}, started, sft=True)
