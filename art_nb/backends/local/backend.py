"""`LocalBackend`: serve and train in this process, on this machine's CPU or GPU.

One runtime per `path` (runtime.py), shared by every `LocalBackend(path)` object in the process, so
re-running the notebook cell that makes the backend reuses the engine that is already loaded.

What a step does when things go wrong (docs/robustness.md has the tests):
- interrupted (cell interrupt, task cancelled): before the optimizer steps, the step is abandoned
  (no checkpoint, weights and step unchanged); after, it finishes and is saved. Either way the
  caller's `CancelledError` arrives only once the backend has settled.
- the checkpoint cannot be written (disk full): the trainer is put back on the last checkpoint, so
  memory, disk and the served adapter agree, and `CheckpointError` says the previous one is intact.
  A step's checkpoint is finished in the background (optimizer state, fsync, rename) while the
  next rollouts run, so that failure is raised by the next `train` (or `wait_for_checkpoint`).
- non-finite loss, gradient or weights: nothing is applied (weights rolled back if needed), the
  skip is counted, and `max_nonfinite_steps` in a row raise `TrainingStoppedError`.
- a dead engine: requests get a 503 naming the cause; `register` again starts a new engine.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ...config import TrainConfig
from ...trajectory import Trajectory, TrajectoryGroup, gathered_groups
from ...types import (
    InferenceEndpoint,
    ModelRef,
    ProgressCallback,
    TrainableModelRef,
    TrainResult,
    inference_name,
)
from .loop import BackgroundLoop
from .runtime import forget, runtime_for
from .state import ModelState, TrainingStoppedError

if TYPE_CHECKING:
    from starlette.types import ASGIApp

__all__ = ["LocalBackend", "TrainingStoppedError"]


class LocalBackend:
    """Serve and train in this process. `path` is where checkpoints and logs go.

    The inference server binds to 127.0.0.1 on a free port; binding elsewhere requires `api_key`.
    """

    def __init__(self, path: str | os.PathLike[str] = ".art", *, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None) -> None:
        self.path = Path(path).expanduser().resolve()
        self._runtime = runtime_for(self.path, host, port, api_key)

    def __repr__(self) -> str:
        return f"LocalBackend(path={str(self.path)!r})"

    @property
    def loop(self) -> BackgroundLoop:
        """The event loop (in a daemon thread) the engine, server and trainer live on."""
        return self._runtime.loop

    async def openai_app(self) -> ASGIApp:
        """The OpenAI-compatible app over this backend's models (await it on `self.loop`), e.g. to mount
        it in another server next to the engine; the loopback endpoint is started if needed."""
        from ...server import create_app

        gate = await self._runtime.ensure_server()
        return create_app(self._runtime, gate)

    async def register(self, model: ModelRef) -> None:
        if not model.trainable:
            raise TypeError(
                "LocalBackend serves TrainableModels; for a model behind another endpoint, give "
                "Model(inference_base_url=...) instead of registering it"
            )
        await self.loop.run(self._runtime.register(model))  # type: ignore[arg-type]

    def choices(self, model: ModelRef) -> dict[str, str]:
        """What was chosen automatically for `model` (engine, trainer, dtype, threads...) and why."""
        return dict(self._runtime.state(model).choices)

    def inference_endpoint(self, model: ModelRef) -> InferenceEndpoint:
        return InferenceEndpoint(base_url=self._runtime.base_url, api_key=self._runtime.api_key)

    def inference_model_name(self, model: ModelRef, step: int | None = None) -> str:
        """`name` (or `project/name` when another project registered that name first), `@step` for a checkpoint."""
        return inference_name(self._runtime.served_name(model.project, model.name), step)

    async def get_step(self, model: TrainableModelRef) -> int:
        return self._runtime.state(model).step

    async def train(self, model: TrainableModelRef, groups: Iterable[TrajectoryGroup],
                    config: TrainConfig | None = None, *, on_progress: ProgressCallback | None = None) -> TrainResult:
        """One GRPO step. `on_progress` is called from the trainer's thread after each microbatch."""
        groups = gathered_groups(groups)  # trajectories changed in place since they were built are checked again
        return await self.loop.run(self._runtime.train(model, groups, config or TrainConfig(), on_progress))

    async def log(self, model: ModelRef, trajectories: Iterable[TrajectoryGroup | Trajectory], split: str = "val",
                  step: int | None = None, metrics: dict[str, float] | None = None) -> dict[str, float]:
        return await self.loop.run(self._runtime.log(model, list(trajectories), split, step, metrics))

    async def delete_checkpoints(self, model: TrainableModelRef, steps: Iterable[int] | None = None,
                                 keep_last: int = 1) -> list[int]:
        steps = None if steps is None else list(steps)
        return await self.loop.run(self._runtime.delete_checkpoints(model, steps, keep_last))

    async def wait_for_checkpoint(self, model: TrainableModelRef) -> int:
        """Wait until the served step's checkpoint is complete on disk, and return that step.

        `train` returns once the new adapter is served; its checkpoint (optimizer state, fsync) is
        finished in the background. Raises `CheckpointError` if that failed, after putting the
        trainer and the served adapter back on the previous checkpoint.
        """
        return await self.loop.run(self._runtime.settle(model))

    def checkpoint_dir(self, model: TrainableModelRef, step: int | None = None) -> Path:
        """Where checkpoint `step` (default: the served one) is; waits for it to be complete when
        called from outside the backend (on its loop, `await wait_for_checkpoint` first)."""
        state = self._runtime.state(model)
        if state.commit is not None and not self.loop.is_current():
            self.loop.run_sync(self._runtime.settle(model))
        return state.store.checkpoint_dir(state.step if step is None else step)

    def model_dir(self, model: ModelRef) -> Path:
        return self._runtime.state(model).store.dir

    async def close(self) -> None:
        """Stop the engine and server for this path (the next register starts fresh)."""
        await self.loop.run(self._runtime.close())
        forget(self._runtime)

    def _state(self, model: ModelRef) -> ModelState:
        """The backend's state for `model` (engine, trainer, store, served step): for tests and benchmarks only."""
        return self._runtime.state(model)
