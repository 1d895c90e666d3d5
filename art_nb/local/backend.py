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

import asyncio
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from art_nb.backend import sft_inputs, train_inputs
from art_nb.config import TrainConfig, report_ignored
from art_nb.pipelining import rollouts_beside
from art_nb.sft_config import TrainSFTConfig
from art_nb.store import model_dir as store_model_dir
from art_nb.store import register_log_path
from art_nb.trajectories import Trajectory, TrajectoryGroup
from art_nb.types import InferenceEndpoint, ModelRef, ProgressCallback, TrainableModelRef, TrainResult, inference_name

from . import quiet, s3
from .loop import BackgroundLoop
from .phases import phase_bar
from .release import release_freed_memory
from .runtime import Runtime, forget, runtime_for
from .state import ModelState, TrainingStoppedError

if TYPE_CHECKING:
    from starlette.types import ASGIApp
    from typing_extensions import Self

__all__ = ["LocalBackend", "TrainingStoppedError"]


class LocalBackend:
    """Serve and train in this process. `path` is where checkpoints and logs go.

    The inference server binds to 127.0.0.1 on a free port; binding elsewhere requires `api_key`.
    What vLLM, Unsloth, transformers and torch print while a model registers goes to the model's
    `logs/register.log` (its path is printed; a failed register shows its last lines), and so do
    their notices until the first train step ends (quiet.py); `verbose=True` shows all of it where
    it was printed. A switch of the backend, not of `ModelConfig`: it changes how this process
    shows the work, not the model (a config that differs makes a re-register an error, and a
    remote backend has no cell to keep quiet).
    ART's arguments are accepted: `in_process` (art_nb always runs in this process) and
    `gpu_cost_per_hour_usd` (no cost accounting here; reported once).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, in_process: bool = True,
                 host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 gpu_cost_per_hour_usd: float | None = None, verbose: bool = False) -> None:
        if gpu_cost_per_hour_usd is not None:
            report_ignored({"gpu_cost_per_hour_usd": "art_nb records no costs"}, "LocalBackend")
        self.path = Path(".art" if path is None else path).expanduser().resolve()
        self.verbose = verbose
        self._address = (host, port, api_key)
        self._current: Runtime | None = runtime_for(self.path, host, port, api_key)  # a bad address fails here

    def __repr__(self) -> str:
        return f"LocalBackend(path={str(self.path)!r})"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        """Close from synchronous code (ART's `with LocalBackend() as backend:`)."""
        if self._current is not None:
            self.loop.run_sync(self._close())
            self._release()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def _runtime(self) -> Runtime:
        """The runtime for this path, made again after `close` (a closed backend registers afresh)."""
        if self._current is None:
            self._current = runtime_for(self.path, *self._address)
        return self._current

    @property
    def loop(self) -> BackgroundLoop:
        """The event loop (in a daemon thread) the engine, server and trainer live on."""
        return self._runtime.loop

    async def openai_app(self) -> ASGIApp:
        """The OpenAI-compatible app over this backend's models (await it on `self.loop`), e.g. to mount
        it in another server next to the engine; the loopback endpoint is started if needed."""
        from .server import create_app

        gate = await self._runtime.ensure_server()
        return create_app(self._runtime, gate)

    async def register(self, model: ModelRef) -> None:
        """Serve and train a TrainableModel; a `Model` served elsewhere (a baseline) is registered for
        logging only: `model.log` records its rollouts under this path, nothing is served."""
        if not model.trainable:
            self._runtime.register_for_logging(model)
            return
        registered = self._runtime.registered(model)
        if registered and self._runtime.state(model).engine.dead_reason is None:  # a re-run cell: nothing loads
            await self.loop.run(self._runtime.register(model))  # type: ignore[arg-type]
            return
        log = register_log_path(store_model_dir(self.path, model.project, model.name))
        output = quiet.RegisterOutput(log, self.path, f"{model.project}/{model.name}", verbose=self.verbose)
        if not self.verbose:
            print(f"register: third-party output (vLLM, Unsloth, transformers...) goes to {log}")
        if registered:  # its engine died: a new one starts
            await self.loop.run(self._runtime.register(model, output=output))  # type: ignore[arg-type]
            return
        on_phase, close = phase_bar(phases=4)  # base model, engine, trainer, checkpoint: minutes on a GPU

        def phase(name: str) -> None:
            output.mark(name)
            on_phase(name)

        try:
            await self.loop.run(self._runtime.register(model, phase, output))  # type: ignore[arg-type]
        finally:
            close()

    def choices(self, model: ModelRef) -> dict[str, str]:
        """What was chosen automatically for `model` (engine, trainer, dtype, threads...) and why."""
        if not model.trainable:
            return {}
        return dict(self._runtime.state(model).choices)

    def inference_endpoint(self, model: ModelRef) -> InferenceEndpoint:
        return InferenceEndpoint(base_url=self._runtime.base_url, api_key=self._runtime.api_key)

    def in_process_http_client(self, model: ModelRef) -> Any | None:
        """For `model.openai_client()`: an httpx client that calls this backend's endpoint without a socket
        (server/inprocess.py), or None before the server runs."""
        server = self._runtime.server
        return None if server is None else server.in_process_http_client()

    def inference_model_name(self, model: ModelRef, step: int | None = None) -> str:
        """`name@step`, the served step by default (as ART's LocalBackend names it); `name` is `project/name`
        when another project registered that name first. The base model is served under its own name."""
        if step is None:
            step = self._runtime.state(model).step
        return inference_name(self._runtime.served_name(model.project, model.name), step)

    async def get_step(self, model: TrainableModelRef) -> int:
        return self._runtime.state(model).step

    async def train(self, model: TrainableModelRef, groups: Iterable[TrajectoryGroup],
                    config: TrainConfig | None = None, *, on_progress: ProgressCallback | None = None,
                    **kwargs: Any) -> TrainResult:
        """One GRPO step. ART's call works unchanged: `backend.train(model, groups, learning_rate=...,
        loss_fn=..., kl_penalty_coef=..., ...)` (art_nb.porting maps each argument onto TrainConfig,
        reporting once those with no equivalent). `on_progress` is called from the trainer's thread
        after each microbatch. Returns the new step, its metrics and its checkpoint's path."""
        # trajectories changed in place since they were built are checked again
        checked, chosen = train_inputs(groups, config, kwargs, "LocalBackend.train")
        try:
            # A pipeline gathering the next step in this task (art_nb.pipelining): its rollouts run beside the step
            beside = rollouts_beside()
            return await self.loop.run(self._runtime.train(model, checked, chosen, on_progress, beside))
        finally:
            quiet.end_first_rollout()

    async def train_sft(self, model: TrainableModelRef, trajectories: Iterable[Trajectory],
                        config: TrainSFTConfig | None = None, _config: Mapping[str, Any] | None = None,
                        verbose: bool = False, *, on_progress: ProgressCallback | None = None) -> TrainResult:
        """Supervised fine-tuning on demonstrations (ART's `train_sft`): one optimizer step per batch of
        `config.batch_size`, one checkpoint for the call, on the same LoRA GRPO trains; the served model
        and the next `train` continue from it. `_config` (ART's `dev.TrainSFTConfig`) changes nothing
        here: metrics are always recorded (history split "sft"). `on_progress` gets one event per batch."""
        from . import sft

        items, chosen = sft_inputs(trajectories, config)

        async def run() -> TrainResult:
            gate = await self._runtime.ensure_server()
            return await sft.train_sft(self._runtime.state(model), gate, items, chosen, on_progress)

        try:
            return await self.loop.run(run())
        finally:
            quiet.end_first_rollout()

    async def log(self, model: ModelRef, trajectories: Iterable[TrajectoryGroup | Trajectory], split: str = "val",
                  step: int | None = None, metrics: dict[str, float] | None = None) -> dict[str, float]:
        return await self.loop.run(self._runtime.log(model, list(trajectories), split, step, metrics))

    async def delete_checkpoints(self, model: TrainableModelRef, steps: Iterable[int] | None = None,
                                 keep_last: int = 1, *, best_metric: str | None = None) -> list[int]:
        """Delete checkpoints: `steps`, or all but the newest `keep_last`, or (ART's rule) all but the
        served one and the best by history metric `best_metric`. The served step is always kept, and
        while a pipeline gathers (art_nb.pipelining) the one before it, which its rollouts sample."""
        steps = None if steps is None else list(steps)
        return await self.loop.run(self._runtime.delete_checkpoints(model, steps, keep_last, best_metric,
                                                                    keep_previous=rollouts_beside()))

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
        key = (model.project, model.name)
        if key in self._runtime.models or key in self._runtime.logged:
            return self._runtime.store(model).dir
        return store_model_dir(self.path, model.project, model.name)

    async def _experimental_push_to_s3(self, model: ModelRef, *, s3_bucket: str | None = None,
                                       prefix: str | None = None, verbose: bool = False, delete: bool = False) -> None:
        """Upload the model's directory (checkpoints, history, trajectories) to
        s3://{bucket}/{prefix}/{project}/models/{name}/ (bucket: `s3_bucket` or $BACKUP_BUCKET), as ART
        lays it out. Waits for the served checkpoint to be complete first. Needs `pip install art-nb[s3]`."""
        if model.trainable and (model.project, model.name) in self._runtime.models:
            await self.wait_for_checkpoint(model)  # type: ignore[arg-type]
        await asyncio.to_thread(s3.push, self.model_dir(model), s3.model_url(model.project, model.name, s3_bucket, prefix),
                                delete=delete, verbose=verbose)

    async def _experimental_pull_from_s3(self, model: ModelRef, *, s3_bucket: str | None = None,
                                         prefix: str | None = None, verbose: bool = False, delete: bool = False,
                                         only_step: int | Literal["latest"] | None = None,
                                         step: int | None = None, latest_only: bool = False,
                                         exclude: list[str] | None = None) -> None:
        """Download the model's directory from S3 (the layout `_experimental_push_to_s3` writes) before
        `register`, which then resumes from the latest checkpoint pulled. `only_step` (an int or
        "latest") pulls one checkpoint plus the run's records; `exclude` skips "checkpoints", "logs"
        (history) or "trajectories". Needs `pip install art-nb[s3]`."""
        if (model.project, model.name) in self._runtime.models:
            raise RuntimeError(f"{model.name!r} is registered already: pull from S3 before `await model.register(backend)` "
                               "(a running model's checkpoints must not change under it)")
        only = step if step is not None else ("latest" if latest_only and only_step is None else only_step)
        await asyncio.to_thread(s3.pull, s3.model_url(model.project, model.name, s3_bucket, prefix),
                                store_model_dir(self.path, model.project, model.name), only_step=only,
                                delete=delete, exclude=exclude or [], verbose=verbose)

    def __call__(self) -> Self:
        """The backend itself: ART code reaches it as `model.backend()`, art_nb code as `model.backend`."""
        return self

    async def close(self) -> None:
        """Stop the engine and server for this path and hand their memory back (the next register starts
        fresh)."""
        if self._current is not None:
            await self.loop.run(self._close())
            self._release()

    async def _close(self) -> None:
        quiet.end_first_rollout()
        await self._runtime.close()
        forget(self._runtime)

    def _release(self) -> None:
        """Stop the closed runtime's loop thread and return the freed model memory to the system."""
        runtime, self._current = self._runtime, None
        runtime.loop.stop()
        release_freed_memory()

    def _state(self, model: ModelRef) -> ModelState:
        """The backend's state for `model` (engine, trainer, store, served step): for tests and benchmarks only."""
        return self._runtime.state(model)
