"""A step's checkpoint, written in the background while the next rollouts and training run.

A train step hands its adapter to the engine in memory (`Trainer.adapter_weights`, on the trainer's
device) and copies the RNG state; everything else runs in a thread here: a host copy of those same
tensors (then put in their place, freeing the device copy), the adapter files written from it, the
optimizer state written as it is (`Trainer.snapshot_state`), meta, fsync, rename into place. The
optimizer state is read there, not copied on the step's path, which is safe because nothing
changes the trainer until the commit has landed: the next `train` runs its forward and backward
passes meanwhile (they change neither weights nor optimizer state) and waits in the trainer's
thread just before its optimizer steps (`CommitWaiter`, the trainer's `before_update`); every
other path that changes the trainer (`train_sft`, a rollback, `trainer.load`, `delete_checkpoints`,
`close`, interpreter exit, an engine replacement) settles it first. Settling waits, and on failure
puts trainer and served adapter back on the newest complete checkpoint so memory, disk and what is
served agree, then raises `CheckpointError`. A crash before the rename leaves the previous
checkpoint as the latest.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from art_nb.store import CheckpointError, write_adapter

from .engines.base import AdapterWeights
from .state import ModelState

if TYPE_CHECKING:
    from .server import InferenceGate

__all__ = ["CommitWaiter", "settle", "start_commit"]

_log = logging.getLogger("art_nb")


def start_commit(state: ModelState, step: int, weights: AdapterWeights,
                 write_state: Callable[[Path], None]) -> asyncio.Future[float]:
    """Write checkpoint `step` (adapter from `weights`, trainer state, meta, fsync, rename) in a thread."""

    def write(directory: Path) -> None:
        on_host = weights.on_host()
        write_adapter(directory, on_host, weights.config)
        write_state(directory)
        weights.tensors.update(on_host)  # the engine has its own copy; the device one is freed (AdapterWeights)

    def commit() -> float:
        mark = time.perf_counter()
        state.store.write_checkpoint(step, write, {"base_model": state.base_model})
        return time.perf_counter() - mark

    task = asyncio.ensure_future(asyncio.to_thread(commit))

    def report(done: asyncio.Future[float]) -> None:
        if not done.cancelled() and done.exception() is not None:
            _log.error("%s; the next train() puts the trainer back on that checkpoint and raises", done.exception())

    task.add_done_callback(report)
    return task


async def settle(state: ModelState, gate: InferenceGate) -> None:
    """Wait for the checkpoint being finished in the background; on failure, roll back and raise.

    How long the commit took is kept in `state.commit_seconds` for the next step's metrics.
    """
    task = state.commit
    if task is None:
        return
    try:
        seconds = await asyncio.shield(task)  # an interrupted wait leaves the commit running
    except Exception as error:
        if state.commit is task:  # the first waiter to see the failure rolls back
            state.commit = None
            await _roll_back(state, gate)
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(f"could not write checkpoint {state.step + 1:04d} ({error!r})") from error
    if state.commit is task:
        state.commit, state.commit_seconds = None, seconds


class CommitWaiter:
    """The trainer's `before_update`: blocks its thread until the commit pending when the step began
    has finished; False (the step is abandoned) when it failed, which `settle` then handles.

    Made on the backend loop (the commit is an asyncio future there); called from the trainer's
    thread, which must not be the loop's. `waited` is how long the trainer was held up.
    """

    def __init__(self, commit: asyncio.Future[float] | None) -> None:
        self.waited = 0.0
        self._commit = commit
        self._done = threading.Event()
        if commit is None or commit.done():
            self._done.set()
        else:
            commit.add_done_callback(lambda _: self._done.set())

    def __call__(self) -> bool:
        mark = time.perf_counter()
        self._done.wait()
        self.waited += time.perf_counter() - mark
        commit = self._commit
        return commit is None or (not commit.cancelled() and commit.exception() is None)


async def _roll_back(state: ModelState, gate: InferenceGate) -> None:
    """Put trainer and served adapter back on the newest complete checkpoint (a commit failed)."""
    failed, good = state.step, state.store.latest_step() or 0
    await gate.pause()
    try:
        await asyncio.to_thread(state.trainer.load, state.store.checkpoint_dir(good))
        state.step = good
        await state.engine.wake()
        if good > 0 and good not in state.loaded_adapters:
            await state.engine.load_adapter(state.adapter_name(good), state.store.checkpoint_dir(good))
            state.loaded_adapters.add(good)
        if failed != good and failed in state.loaded_adapters:
            await state.engine.unload_adapter(state.adapter_name(failed))
            state.loaded_adapters.discard(failed)
    finally:
        gate.resume()
