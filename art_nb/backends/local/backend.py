"""`LocalBackend`: serve and train in this process, on this machine's CPU or GPU.

One runtime per `path`, shared by every `LocalBackend(path)` object in the process, so re-running
the notebook cell that makes the backend reuses the engine that is already loaded. The runtime owns
one engine per base model, one trainer per trainable model, the loopback OpenAI server, and the
gate that makes requests wait (never fail) while a step trains.

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
import atexit
import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import events
from ...config import ModelConfig, TrainConfig
from ...store import CheckpointError, ModelStore
from ...trajectory import Trajectory, TrajectoryGroup, check_groups
from ..base import InferenceEndpoint, ProgressCallback, TrainResult
from .loop import BackgroundLoop
from ...records import summarize, trajectory_record

if TYPE_CHECKING:
    from ...engines.base import Engine
    from ...model import Model, TrainableModel
    from ...trainers.base import Trainer

__all__ = ["LocalBackend", "TrainingStoppedError"]

_log = logging.getLogger("art_nb")
_RUNTIMES: dict[tuple[Path, str, int], _Runtime] = {}


class TrainingStoppedError(RuntimeError):
    """Too many consecutive updates were non-finite; names the last good checkpoint."""


@dataclass
class _StepControl:
    """Shared by a train step and whoever interrupts it."""

    stop: threading.Event = field(default_factory=threading.Event)
    training: bool = False  # the trainer has the step (before this, cancelling is enough)


@dataclass
class _ModelState:
    model_name: str
    base_model: str
    config: ModelConfig
    store: ModelStore
    engine: Engine
    trainer: Trainer
    step: int
    choices: dict[str, str] = field(default_factory=dict)  # what was picked automatically, and why
    loaded_adapters: set[int] = field(default_factory=set)
    nonfinite_in_row: int = 0
    train_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The newest step's checkpoint being finished in the background (its seconds when done).
    commit: asyncio.Future[float] | None = None
    commit_seconds: float | None = None  # how long the last one took, for the next step's metrics

    def adapter_name(self, step: int) -> str:
        return f"{self.model_name}@{step}"


class _Runtime:
    """Everything that lives on the backend loop for one `path`."""

    def __init__(self, path: Path, host: str, port: int, api_key: str | None) -> None:
        self.path, self.host, self.port = path, host, port
        if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"binding the inference server to {host!r} needs an api_key (loopback does not)")
        # Loopback still gets a random key: other local users cannot drive our engine by accident.
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.loop = BackgroundLoop()
        self.models: dict[str, _ModelState] = {}
        self.engines: dict[tuple[str, str], Engine] = {}
        self.server: Any = None
        self.gate: Any = None
        self.base_url = ""

    # ---- server ------------------------------------------------------------------------------

    async def ensure_server(self) -> None:
        if self.server is not None:
            return
        from ...server import InferenceGate, create_app, start_server

        self.gate = InferenceGate()
        app = create_app(self, self.gate, api_key=self.api_key)
        self.server = await start_server(app, host=self.host, port=self.port)
        self.base_url = self.server.base_url
        _log.info("inference endpoint: %s", self.base_url)

    # ModelRegistry (what the server asks of us)
    async def resolve(self, model_name: str) -> Any:
        from ...server import ServedModel

        name, _, step_text = model_name.partition("@")
        state = self.models.get(name)
        if state is None:
            raise KeyError(model_name)
        if not step_text:
            step = state.step
        elif step_text.isdigit():
            step = int(step_text)
        else:
            raise KeyError(model_name)
        if step == 0:  # a fresh LoRA is the identity: step 0 is the base weights
            return ServedModel(engine=state.engine, adapter=None, name=state.adapter_name(0))
        if step not in state.loaded_adapters:
            if step not in state.store.steps():
                raise KeyError(model_name)
            await state.engine.load_adapter(state.adapter_name(step), state.store.checkpoint_dir(step))
            state.loaded_adapters.add(step)
        return ServedModel(engine=state.engine, adapter=state.adapter_name(step), name=state.adapter_name(step))

    def list_models(self) -> list[str]:
        names = []
        for state in self.models.values():
            names.append(state.model_name)
            names.extend(state.adapter_name(s) for s in sorted(set(state.store.steps()) | state.loaded_adapters))
        return names

    # ---- models ------------------------------------------------------------------------------

    async def register(self, model: TrainableModel) -> dict[str, str]:
        await self.ensure_server()
        state = self.models.get(model.name)
        if state is not None:
            if state.base_model != model.base_model or state.config != model.config:
                raise ValueError(
                    f"model {model.name!r} is already registered with base_model={state.base_model!r} and a "
                    "different config; use a new name, or restart the kernel to change it"
                )
            if _dead_reason(state.engine) is not None:
                await self._replace_engine(state)
            return state.choices
        state = await self._load(model)
        self.models[model.name] = state
        return state.choices

    async def _replace_engine(self, state: _ModelState) -> None:
        """Start a new engine in place of a dead one (for every model it served) and load the latest adapter."""
        async with state.train_lock:
            dead = state.engine
            reason = _dead_reason(dead)
            if reason is None:  # another register replaced it while we waited
                return
            with contextlib.suppress(CheckpointError):  # logged when it failed; rolled back by settle
                await self.settle(state)
            _log.warning("engine for %s is dead (%s); starting a new one", state.model_name, reason)
            key = next(k for k, engine in self.engines.items() if engine is dead)
            with contextlib.suppress(Exception):
                await dead.close()
            engine = await _create_engine(key[1], Path(key[0]), state.config)
            self.engines[key] = engine
            for other in self.models.values():
                if other.engine is dead:
                    other.engine = engine
                    other.loaded_adapters.clear()  # the others load theirs on their next request
            state.choices["engine_restart"] = f"the previous engine died ({reason}); a new one was started"
            if state.step > 0:
                await engine.load_adapter(state.adapter_name(state.step), state.store.checkpoint_dir(state.step))
                state.loaded_adapters.add(state.step)

    async def _load(self, model: TrainableModel) -> _ModelState:
        from ...models import resolve_base_model
        from .plan import plan_for

        store = ModelStore(self.path, model.project, model.name)
        resolved = await asyncio.to_thread(resolve_base_model, model.base_model)
        plan = plan_for(model.config)
        engine_kind, trainer_kind = plan.engine, plan.trainer
        choices = {"base_model": f"{resolved.path} ({resolved.source}: {resolved.reason})", **plan.reasons}
        for key, why in choices.items():
            _log.info("%s: %s", key, why)

        engine_key = (str(resolved.path), engine_kind)
        engine = self.engines.get(engine_key)
        if engine is None:
            engine = await _create_engine(engine_kind, resolved.path, model.config)
            self.engines[engine_key] = engine
        trainer = await asyncio.to_thread(_create_trainer, trainer_kind, resolved.path, model.config)

        step = store.latest_step()
        if step is None:  # a new model: its fresh LoRA is checkpoint 0, so resume always has a start
            step = 0
            await asyncio.to_thread(store.write_checkpoint, 0, trainer.save, {"base_model": model.base_model})
        else:
            await asyncio.to_thread(trainer.load, store.checkpoint_dir(step))
            choices["resume"] = f"resumed at step {step} from {store.checkpoint_dir(step)} (optimizer state included)"
            _log.info("resume: %s", choices["resume"])
        state = _ModelState(model.name, model.base_model, model.config, store, engine, trainer, step, choices)
        if step > 0:
            await engine.load_adapter(state.adapter_name(step), store.checkpoint_dir(step))
            state.loaded_adapters.add(step)
        return state

    def state(self, model: Model) -> _ModelState:
        state = self.models.get(model.name)
        if state is None:
            raise RuntimeError(f"model {model.name!r} is not registered with this backend")
        return state

    # ---- training ----------------------------------------------------------------------------

    async def train(
        self, model: TrainableModel, groups: list[TrajectoryGroup], config: TrainConfig, on_progress: ProgressCallback | None
    ) -> TrainResult:
        state = self.state(model)
        async with state.train_lock:
            started = time.perf_counter()
            await self.settle(state)  # the previous step's checkpoint, finished in the background
            settled: dict[str, float] = {}
            if state.commit_seconds is not None:  # reported with the step after it
                settled = {"time/commit_previous": state.commit_seconds,
                           "time/commit_wait": time.perf_counter() - started}
                state.commit_seconds = None
            step = state.step
            # Nothing lost: the trajectories are on disk before any weight changes.
            records = [trajectory_record(t, group=i) for i, g in enumerate(groups) for t in g.trajectories]
            await asyncio.to_thread(state.store.append_trajectories, "train", step, records)
            rollouts = summarize(groups)
            await asyncio.to_thread(state.store.append_history, {
                "step": step, "split": "train", "time": time.time(), **{f"train/{k}": v for k, v in rollouts.items()}})
            events.emit("log", model=model.name, step=step, split="train", metrics=rollouts)
            control = _StepControl()
            update = asyncio.ensure_future(self._update(model, state, groups, config, control, started, settled))
            try:
                result = await asyncio.shield(update)
            except asyncio.CancelledError:
                # Interrupted. Not training yet (e.g. waiting for requests to drain): just cancel.
                # Training: ask the trainer to stop; it abandons the step unless the optimizer has
                # already stepped, in which case the step is saved. Hold the lock until it settles.
                control.stop.set()
                if not control.training:
                    update.cancel()
                while not update.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait({update})
                if not update.cancelled() and update.exception() is not None:
                    _log.error("the interrupted train step failed: %r", update.exception())
                raise
            assert result is not None  # only an interrupted step is abandoned
            return result

    async def _update(
        self, model: TrainableModel, state: _ModelState, groups: list[TrajectoryGroup], config: TrainConfig,
        control: _StepControl, started: float, settled: dict[str, float],
    ) -> TrainResult | None:
        """Pause serving, take the step, stage its checkpoint, serve it, and start finishing the
        checkpoint in the background. None when `control.stop` abandoned the step."""
        step = state.step
        timings: dict[str, float] = dict(settled)
        mark = time.perf_counter()
        try:
            await self.gate.pause()
            awake = getattr(state.engine, "train_awake", False)  # the memory plan says training fits beside it
            if not awake:
                await state.engine.sleep()
            timings["time/pause"] = time.perf_counter() - mark
            events.emit("train_started", model=model.name, step=step, groups=len(groups))
            mark = time.perf_counter()
            control.training = True  # from here on only the trainer can abandon the step
            import torch  # loaded by the trainer already; here only for its out-of-memory error

            try:
                metrics = await asyncio.to_thread(state.trainer.train_step, groups, config, control.stop.is_set)
            except torch.OutOfMemoryError as error:
                if not awake:
                    raise
                # The plan was wrong for this batch: from now on vLLM sleeps for every step. The
                # optimizer had not stepped (train_step raised, and emptied the allocator's cache on
                # the way out), so taking the step again is exact.
                _log.warning("training ran out of GPU memory beside an awake vLLM (%s); vLLM sleeps for "
                             "training from now on", str(error).splitlines()[0][:200])
                state.engine.train_awake = False
                await state.engine.sleep()
                metrics = await asyncio.to_thread(state.trainer.train_step, groups, config, control.stop.is_set)
            timings["time/train"] = time.perf_counter() - mark
            if metrics.get("stopped"):
                _log.warning("step %d interrupted before the optimizer stepped: abandoned, nothing saved", step)
                return None
            if metrics.get("nonfinite_weights"):  # the update itself went bad: back to the last good weights
                await asyncio.to_thread(state.trainer.load, state.store.checkpoint_dir(step))
            self._check_finite(state, metrics, config)
            metrics["nonfinite_in_row"] = float(state.nonfinite_in_row)
            mark = time.perf_counter()
            new_step = step + 1
            try:
                staged, write_state = await asyncio.to_thread(self._stage, state, new_step)
            except Exception:
                # The update exists only in memory: go back to the last checkpoint so the trainer,
                # the disk and the served adapter agree; the next step starts from there.
                await asyncio.to_thread(state.trainer.load, state.store.checkpoint_dir(step))
                raise
            state.step = new_step  # served from the staged adapter now; on disk once the commit lands
            timings["time/save"] = time.perf_counter() - mark
            mark = time.perf_counter()
            try:
                await state.engine.wake()
                await state.engine.load_adapter(state.adapter_name(new_step), staged)
                state.loaded_adapters.add(new_step)
                for old in sorted(state.loaded_adapters - {new_step}):
                    await state.engine.unload_adapter(state.adapter_name(old))
                    state.loaded_adapters.discard(old)
            finally:  # only now: the engine has read the staged files, and the commit renames them
                state.commit = self._start_commit(state, new_step, staged, write_state)
            timings["time/swap"] = time.perf_counter() - mark
        finally:
            await state.engine.wake()
            self.gate.resume()
        timings["time/step_total"] = time.perf_counter() - started
        metrics = {**metrics, **timings}
        # The update made from step `step`'s rollouts; its weights are served as `new_step`.
        record = {"step": step, "split": "train", "time": time.time(), **{f"train/{k}": v for k, v in metrics.items()}}
        await asyncio.to_thread(state.store.append_history, record)
        events.emit("train_finished", model=model.name, step=new_step, metrics=metrics,
                    checkpoint=str(state.store.checkpoint_dir(new_step)))
        return TrainResult(step=new_step, metrics=metrics)

    @staticmethod
    def _stage(state: _ModelState, step: int) -> tuple[Path, Any]:
        """Copy the trainer state to CPU, write the adapter into a staged directory (both quick)."""
        write_state = state.trainer.snapshot_state()
        return state.store.stage_checkpoint(step, state.trainer.save_adapter), write_state

    def _start_commit(self, state: _ModelState, step: int, staged: Path, write_state: Any) -> asyncio.Future[float]:
        """Finish checkpoint `step` (optimizer state, meta, fsync, rename) in a thread, off the step's path."""

        def commit() -> float:
            mark = time.perf_counter()
            state.store.write_checkpoint(step, write_state, {"base_model": state.base_model}, staged=staged)
            return time.perf_counter() - mark

        task = asyncio.ensure_future(asyncio.to_thread(commit))

        def report(done: asyncio.Future[float]) -> None:
            if not done.cancelled() and done.exception() is not None:
                _log.error("%s; the next train() puts the trainer back on that checkpoint and raises",
                           done.exception())

        task.add_done_callback(report)
        return task

    async def settle(self, state: _ModelState) -> None:
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
                await self._roll_back(state)
            if isinstance(error, CheckpointError):
                raise
            raise CheckpointError(f"could not write checkpoint {state.step + 1:04d} ({error!r})") from error
        if state.commit is task:
            state.commit, state.commit_seconds = None, seconds

    async def _roll_back(self, state: _ModelState) -> None:
        """Put trainer and served adapter back on the newest complete checkpoint (a commit failed)."""
        failed, good = state.step, state.store.latest_step() or 0
        await self.gate.pause()
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
            self.gate.resume()

    def _check_finite(self, state: _ModelState, metrics: dict[str, float], config: TrainConfig) -> None:
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

    async def log(
        self, model: Model, items: list[TrajectoryGroup | Trajectory], split: str, step: int | None,
        metrics: dict[str, float] | None,
    ) -> dict[str, float]:
        state = self.state(model)
        step = state.step if step is None else step
        groups = [g if isinstance(g, TrajectoryGroup) else TrajectoryGroup([g]) for g in items]
        records = [trajectory_record(t, group=i) for i, g in enumerate(groups) for t in g.trajectories]
        await asyncio.to_thread(state.store.append_trajectories, split, step, records)
        summary = {**summarize(groups), **(metrics or {})}
        record = {"step": step, "split": split, "time": time.time(), **{f"{split}/{k}": v for k, v in summary.items()}}
        await asyncio.to_thread(state.store.append_history, record)
        events.emit("log", model=model.name, step=step, split=split, metrics=summary)
        return summary

    async def delete_checkpoints(self, model: TrainableModel, steps: Iterable[int] | None, keep_last: int) -> list[int]:
        state = self.state(model)
        existing = state.store.steps()
        targets = set(steps) if steps is not None else set(existing[: max(0, len(existing) - max(keep_last, 1))])
        targets.discard(state.step)
        await self.settle(state)
        for step in targets & state.loaded_adapters:
            await state.engine.unload_adapter(state.adapter_name(step))
            state.loaded_adapters.discard(step)
        return await asyncio.to_thread(state.store.delete_checkpoints, sorted(targets))

    async def close(self) -> None:
        for state in self.models.values():
            try:
                await self.settle(state)
            except CheckpointError as error:  # already rolled back and logged; closing goes on
                _log.error("%s", error)
        for engine in self.engines.values():
            await engine.close()
        self.engines.clear()
        self.models.clear()
        if self.server is not None:
            await self.server.stop()
            self.server = None


def finish_checkpoints() -> None:
    """Wait for checkpoints still being finished in the background; runs at interpreter exit.

    The backend loop is a daemon thread: without this, a script that ends right after its last
    `train` would report a checkpoint failure nowhere (the write itself is joined with the thread pool).
    """
    for runtime in list(_RUNTIMES.values()):
        for state in list(runtime.models.values()):
            if state.commit is None:
                continue
            try:
                runtime.loop.run_sync(runtime.settle(state), timeout=600)
            except Exception as error:  # noqa: BLE001 - at exit, the log is all there is
                _log.error("checkpoint of %s at exit: %s", state.model_name, error)


atexit.register(finish_checkpoints)


def _dead_reason(engine: Engine) -> str | None:
    """Why `engine` stopped serving, or None while it serves (engines without the property never die)."""
    return getattr(engine, "dead_reason", None)


async def _create_engine(kind: str, path: Path, config: ModelConfig) -> Engine:
    if kind == "vllm":
        from ...engines.vllm import VLLMEngine

        return await VLLMEngine.create(path, config)
    from ...engines.hf import HFEngine

    return await HFEngine.create(path, config)


def _create_trainer(kind: str, path: Path, config: ModelConfig) -> Trainer:
    if kind == "unsloth":
        from ...trainers.unsloth import UnslothTrainer

        return UnslothTrainer(path, config)
    from ...trainers.peft import PeftTrainer

    return PeftTrainer(path, config)


class LocalBackend:
    """Serve and train in this process. `path` is where checkpoints and logs go.

    The inference server binds to 127.0.0.1 on a free port; binding elsewhere requires `api_key`.
    """

    def __init__(self, path: str | os.PathLike[str] = ".art", *, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None) -> None:
        self.path = Path(path).expanduser().resolve()
        key = (self.path, host, port)
        runtime = _RUNTIMES.get(key)
        if runtime is None:
            runtime = _RUNTIMES[key] = _Runtime(self.path, host, port, api_key)
        self._runtime = runtime

    def __repr__(self) -> str:
        return f"LocalBackend(path={str(self.path)!r})"

    async def register(self, model: Model) -> None:
        if not model.trainable:
            raise TypeError(
                "LocalBackend serves TrainableModels; for a model behind another endpoint, give "
                "Model(inference_base_url=...) instead of registering it"
            )
        await self._runtime.loop.run(self._runtime.register(model))  # type: ignore[arg-type]

    def choices(self, model: Model) -> dict[str, str]:
        """What was chosen automatically for `model` (engine, trainer, dtype, threads...) and why."""
        return dict(self._runtime.state(model).choices)

    def inference_endpoint(self, model: Model) -> InferenceEndpoint:
        return InferenceEndpoint(base_url=self._runtime.base_url, api_key=self._runtime.api_key)

    def inference_model_name(self, model: Model, step: int | None = None) -> str:
        return model.name if step is None else f"{model.name}@{step}"

    async def get_step(self, model: TrainableModel) -> int:
        return self._runtime.state(model).step

    async def train(self, model: TrainableModel, groups: Iterable[TrajectoryGroup], config: TrainConfig | None = None,
                    *, on_progress: ProgressCallback | None = None) -> TrainResult:
        groups = list(groups)
        for i, group in enumerate(groups):
            if not isinstance(group, TrajectoryGroup):
                raise TypeError(f"groups[{i}] is a {type(group).__name__}; train takes gathered TrajectoryGroups")
            if group.pending:
                raise ValueError(f"groups[{i}] has rollouts that were never awaited: gather them first")
        check_groups(groups)  # trajectories changed in place since they were built are checked again
        return await self._runtime.loop.run(self._runtime.train(model, groups, config or TrainConfig(), on_progress))

    async def log(self, model: Model, trajectories: Iterable[TrajectoryGroup | Trajectory], split: str = "val",
                  step: int | None = None, metrics: dict[str, float] | None = None) -> dict[str, float]:
        return await self._runtime.loop.run(self._runtime.log(model, list(trajectories), split, step, metrics))

    async def delete_checkpoints(self, model: TrainableModel, steps: Iterable[int] | None = None,
                                 keep_last: int = 1) -> list[int]:
        steps = None if steps is None else list(steps)
        return await self._runtime.loop.run(self._runtime.delete_checkpoints(model, steps, keep_last))

    async def wait_for_checkpoint(self, model: TrainableModel) -> int:
        """Wait until the served step's checkpoint is complete on disk, and return that step.

        `train` returns once the new adapter is served; its checkpoint (optimizer state, fsync) is
        finished in the background. Raises `CheckpointError` if that failed, after putting the
        trainer and the served adapter back on the previous checkpoint.
        """
        runtime = self._runtime
        state = runtime.state(model)
        await runtime.loop.run(runtime.settle(state))
        return state.step

    def checkpoint_dir(self, model: TrainableModel, step: int | None = None) -> Path:
        """Where checkpoint `step` (default: the served one) is; waits for it to be complete when
        called from outside the backend (on its loop, `await wait_for_checkpoint` first)."""
        runtime = self._runtime
        state = runtime.state(model)
        if state.commit is not None and not runtime.loop.is_current():
            runtime.loop.run_sync(runtime.settle(state))
        return state.store.checkpoint_dir(state.step if step is None else step)

    def model_dir(self, model: Model) -> Path:
        return self._runtime.state(model).store.dir

    async def close(self) -> None:
        """Stop the engine and server for this path (the next register starts fresh)."""
        await self._runtime.loop.run(self._runtime.close())
        _RUNTIMES.pop((self._runtime.path, self._runtime.host, self._runtime.port), None)

