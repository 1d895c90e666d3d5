"""The in-process backend's runtime: one per `path` in this process, living on its own event loop.

It owns the loopback OpenAI server and the gate that holds requests during a step, one engine per
base model (shared by the models on it), and the per-model state (store, trainer, served step). It
is also the registry the server resolves model names through. A train step is in step.py, the
background half of a checkpoint in commit.py.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import secrets
import threading
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from art_nb.config import ModelConfig, TrainConfig
from art_nb.records import as_groups, best_step, record_groups, unrecorded
from art_nb.store import CheckpointError, ModelMismatchError, ModelStore
from art_nb.trajectories import Trajectory, TrajectoryGroup
from art_nb.types import ModelRef, ProgressCallback, TrainableModelRef, TrainResult
from art_nb.web import is_loopback

from . import resume
from . import step as train_step
from .adapters import use_step
from .build import build
from .commit import settle
from .engines.vllm.args import MemorySnapshot, planned_memory
from .loop import BackgroundLoop
from .phases import PhaseCallback, PhaseClock
from .release import freeze_heap
from .state import ModelState

if TYPE_CHECKING:
    from .engines.base import Engine
    from .plan.choices import Plan
    from .server import InferenceGate, RunningServer, ServedModel
    from .trainers.base import Trainer

__all__ = ["Runtime", "runtime_for"]

_log = logging.getLogger("art_nb")
_RUNTIMES: dict[tuple[Path, str, int], Runtime] = {}


def runtime_for(path: Path, host: str, port: int, api_key: str | None) -> Runtime:
    """The runtime for (path, host, port), made on first use: re-running a notebook cell reuses the engine."""
    key = (path, host, port)
    runtime = _RUNTIMES.get(key)
    if runtime is None:
        if not _RUNTIMES:
            atexit.register(finish_checkpoints)
        runtime = _RUNTIMES[key] = Runtime(path, host, port, api_key)
    return runtime


def forget(runtime: Runtime) -> None:
    _RUNTIMES.pop((runtime.path, runtime.host, runtime.port), None)


class Runtime:
    """Everything that lives on the backend loop for one `path`."""

    def __init__(self, path: Path, host: str, port: int, api_key: str | None) -> None:
        self.path, self.host, self.port = path, host, port
        if api_key is None and not is_loopback(host):
            raise ValueError(f"binding the inference server to {host!r} needs an api_key (loopback does not)")
        # Loopback still gets a random key: other local users cannot drive our engine by accident.
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.loop = BackgroundLoop()
        self.models: dict[tuple[str, str], ModelState] = {}  # (project, name)
        self.logged: dict[tuple[str, str], ModelStore] = {}  # models registered for logging only
        self._registering: dict[tuple[str, str], asyncio.Lock] = {}
        self.engines: dict[tuple[str, str], Engine] = {}  # (base model path, engine kind)
        self.server: RunningServer | None = None
        # (base model path, engine kind) -> the memory snapshot its vLLM engine was planned from (build.py)
        self.snapshots: dict[tuple[str, str], MemorySnapshot] = {}
        self.gate: InferenceGate | None = None
        self.base_url = ""

    # ---- the loopback server and the registry it resolves names through ---------------------

    async def ensure_server(self) -> InferenceGate:
        if self.server is None or self.gate is None:
            from .server import InferenceGate, create_app, start_server

            self.gate = InferenceGate()
            app = create_app(self, self.gate, api_key=self.api_key)
            self.server = await start_server(app, host=self.host, port=self.port)
            self.base_url = self.server.base_url
            _log.info("inference endpoint: %s", self.base_url)
        return self.gate

    async def resolve(self, model_name: str) -> ServedModel:
        from .server import ServedModel

        state, step_text = self._served(model_name)
        if state is None:
            base = next((s for s in self.models.values() if s.base_model == model_name), None)
            if base is None:
                raise KeyError(model_name)
            # The base model under its own hub name (a baseline player, as ART's vLLM serves it).
            return ServedModel(engine=base.engine, adapter=None, name=base.base_model)
        if step_text and not step_text.isdigit():
            raise KeyError(model_name)
        step = int(step_text) if step_text else state.step
        if step == 0:  # a fresh LoRA is the identity: step 0 is the base weights
            return ServedModel(engine=state.engine, adapter=None, name=state.adapter_name(0))
        release = await use_step(state, step)  # KeyError when there is no such checkpoint
        return ServedModel(engine=state.engine, adapter=state.adapter_name(step), name=state.adapter_name(step),
                           release=release)

    def list_models(self) -> list[str]:
        names = []
        for state in self.models.values():
            prefix = "" if self.served_name(state.project, state.model_name) == state.model_name else f"{state.project}/"
            names.append(prefix + state.model_name)
            names.extend(prefix + state.adapter_name(s) for s in sorted({*state.store.steps(), *state.loaded_adapters}))
        names.extend(dict.fromkeys(state.base_model for state in self.models.values()))
        return names

    def served_name(self, project: str, name: str) -> str:
        """`name`, or `project/name` when an earlier registered model of another project has that name.

        Models are keyed by (project, name); the endpoint addresses them by name, so the first model
        registered under a name keeps it and a later one of another project is `project/name`.
        `project/name` is always accepted.
        """
        first = next((s for s in self.models.values() if s.model_name == name), None)
        return name if first is None or first.project == project else f"{project}/{name}"

    def _served(self, model_name: str) -> tuple[ModelState | None, str]:
        qualified, _, step_text = model_name.partition("@")
        project, _, name = qualified.rpartition("/")
        if project:
            return self.models.get((project, name)), step_text
        return next((s for s in self.models.values() if s.model_name == name), None), step_text

    # ---- models -------------------------------------------------------------------------------

    def state(self, model: ModelRef) -> ModelState:
        state = self.models.get((model.project, model.name))
        if state is None:
            raise RuntimeError(f"model {model.name!r} (project {model.project!r}) is not registered with this backend")
        return state

    def store(self, model: ModelRef) -> ModelStore:
        """Where `model`'s records go: a trained model's store, or that of a model registered for logging."""
        key = (model.project, model.name)
        if key in self.logged:
            return self.logged[key]
        return self.state(model).store

    def register_for_logging(self, model: ModelRef) -> None:
        """A model served elsewhere (a baseline, a judge): its rollouts are recorded here, nothing is served."""
        key = (model.project, model.name)
        if key in self.models:
            raise ValueError(f"{model.name!r} (project {model.project!r}) is registered here as a trainable model; "
                             "give the baseline another name")
        if key not in self.logged:
            self.logged[key] = ModelStore(self.path, model.project, model.name)

    def registered(self, model: ModelRef) -> bool:
        return (model.project, model.name) in self.models

    async def register(self, model: TrainableModelRef, on_phase: PhaseCallback | None = None,
                       output: contextlib.AbstractContextManager[object] | None = None) -> dict[str, str]:
        """Load `model` once, however many registers of it run at once; reuse it afterwards.
        `on_phase(name)` is called as each loading phase starts (phases.py). `output` is entered around
        whatever loads (quiet.RegisterOutput: third-party output to the model's log), inside the
        one-load-at-a-time lock, so two registers never take the process's output at once."""
        output = output or contextlib.nullcontext()
        await self.ensure_server()
        key = (model.project, model.name)
        async with self._registering.setdefault(key, asyncio.Lock()):
            state = self.models.get(key)
            if state is not None:
                if state.base_model != model.base_model or state.config != model.backend_config:
                    raise ModelMismatchError(
                        f"model {model.name!r} is already registered with base_model={state.base_model!r} and a "
                        "different config; use a new name, or restart the kernel to change it"
                    )
                if state.engine.dead_reason is not None:
                    async with loading_alone():
                        with output:
                            await self._replace_engine(state)
                return state.choices
            async with loading_alone():
                with output:
                    state = await self._load(model, PhaseClock(on_phase))
            self.models[key] = state
            freeze_heap()  # what register built stays: out of the collector's passes (release.py)
            return state.choices

    async def _replace_engine(self, state: ModelState) -> None:
        """Start a new engine in place of a dead one (for every model it served) and load the latest adapter."""
        async with state.train_lock:
            dead = state.engine
            reason = dead.dead_reason
            if reason is None:  # another register replaced it while we waited
                return
            with contextlib.suppress(CheckpointError):  # logged when it failed; rolled back by settle
                await settle(state, await self.ensure_server())
            _log.warning("engine for %s is dead (%s); starting a new one", state.model_name, reason)
            key = next(k for k, engine in self.engines.items() if engine is dead)
            with contextlib.suppress(Exception):
                await dead.close()
            # Planned from the memory as it was before the trainers loaded, as at register: read now, the
            # resident trainer would be counted twice (the plan budgets it too).
            with planned_memory(self.snapshots.get(key)):
                engine = await _create_engine(state.plan, Path(key[0]), state.config)
            from .plan.choices import pipeline_choice
            from .plan.rates import parameter_count
            from .server.templates import apply_prompt_config

            apply_prompt_config(engine.tokenizer, None, state.config, state.model_name)
            self.engines[key] = engine
            for other in self.models.values():
                if other.engine is dead:
                    other.engine = engine
                    other.loaded_adapters.clear()  # the others load theirs on their next request
            state.choices["engine_restart"] = f"the previous engine died ({reason}); a new one was started"
            state.choices["pipeline"] = pipeline_choice(state.plan, engine.serves_while_training,
                                                        parameter_count(state.base_model, key[0]))
            if state.step > 0:
                await engine.load_adapter(state.adapter_name(state.step), state.store.checkpoint_dir(state.step))
                state.loaded_adapters.add(state.step)

    async def _load(self, model: TrainableModelRef, clock: PhaseClock) -> ModelState:
        from .plan.base_models import resolve_base_model
        from .plan.choices import engine_fallback, pipeline_choice, plan_for
        from .plan.rates import parameter_count

        store = ModelStore(self.path, model.project, model.name)
        store.acquire_writer()  # before anything is read: another writer would make what we read stale
        started: tuple[str, str] | None = None  # the key of an engine this register started
        try:
            await asyncio.to_thread(resume.check_base_model, store, model.base_model)  # before anything loads
            clock.start("base model")
            resolved = await asyncio.to_thread(resolve_base_model, model.base_model)
            plan = plan_for(model.backend_config)
            choices = {"base_model": f"{resolved.path} ({resolved.source}: {resolved.reason})", **plan.reasons}
            for key, why in choices.items():
                _log.info("%s: %s", key, why)
            while True:
                engine_key = (str(resolved.path), plan.engine)
                try:
                    engine, trainer, snapshot = await build(plan, resolved.path, model.backend_config, clock,
                                                            self.engines.get(engine_key), _create_engine, _create_trainer)
                    break
                except Exception as exc:
                    fallback = engine_fallback(plan, model.backend_config, exc)  # None again for the fallback
                    if fallback is None:
                        raise
                    _log.warning("engine: %s", fallback.reasons["engine"])
                    plan, choices["engine"] = fallback, fallback.reasons["engine"]
            if engine_key not in self.engines:  # else shared with the models on it: not this register's to close
                self.engines[engine_key] = engine
                started = engine_key
                if snapshot is not None:
                    self.snapshots[engine_key] = snapshot
            from .server.templates import apply_prompt_config

            choices.update(apply_prompt_config(engine.tokenizer, trainer.tokenizer, model.backend_config, model.name))
            size = await asyncio.to_thread(parameter_count, model.base_model, resolved.path)
            choices["pipeline"] = pipeline_choice(plan, engine.serves_while_training, size)
            state = ModelState(model.name, model.project, model.base_model, model.backend_config, plan, store, engine,
                               trainer, await self._start_from(store, model.base_model, trainer, clock, choices), choices)
            if state.step > 0:
                await engine.load_adapter(state.adapter_name(state.step), store.checkpoint_dir(state.step))
                state.loaded_adapters.add(state.step)
        except BaseException:  # whatever failed, nothing this register took stays taken
            store.release_writer()
            if started is not None:
                self.snapshots.pop(started, None)
                with contextlib.suppress(Exception):
                    await self.engines.pop(started).close()
            raise
        choices["startup"] = clock.finish()
        _log.info("startup: %s", choices["startup"])
        if plan.device == "cuda":
            choices["gpu_memory"] = _gpu_headroom(plan.engine == "vllm")
            _log.info("gpu_memory: %s", choices["gpu_memory"])
        return state

    @staticmethod
    async def _start_from(store: ModelStore, base_model: str, trainer: Trainer, clock: PhaseClock,
                          choices: dict[str, str]) -> int:
        """The step a register starts at: the newest checkpoint, checked and loaded into `trainer`, or
        a new model's fresh LoRA written as checkpoint 0 (so resume always has a start)."""
        step = store.latest_step()
        if step is None:
            clock.start("checkpoint 0")
            await asyncio.to_thread(store.write_checkpoint, 0, trainer.save, {"base_model": base_model})
            return 0
        clock.start(f"resume from step {step}")
        try:
            await asyncio.to_thread(resume.check_finite, store, step)
            await asyncio.to_thread(trainer.load, store.checkpoint_dir(step))
        except Exception as error:
            raise resume.resume_failed(store, step, error) from error
        # Relative to the model's directory: this text reaches remote clients, the server's paths must not
        choices["resume"] = f"resumed at step {step} from checkpoints/{step:04d} (optimizer state included)"
        _log.info("resume: %s", choices["resume"])
        return step

    # ---- what the backend facade forwards -------------------------------------------------------

    async def train(self, model: TrainableModelRef, groups: list[TrajectoryGroup], config: TrainConfig,
                    on_progress: ProgressCallback | None, beside: bool = False) -> TrainResult:
        return await train_step.train(self.state(model), await self.ensure_server(), groups, config, on_progress,
                                      beside)

    async def settle(self, model: TrainableModelRef) -> int:
        state = self.state(model)
        await settle(state, await self.ensure_server())
        return state.step

    async def log(self, model: ModelRef, items: list[TrajectoryGroup | Trajectory], split: str, step: int | None,
                  metrics: dict[str, float] | None) -> dict[str, float]:
        store = self.store(model)
        state = self.models.get((model.project, model.name))
        if step is None:
            step = state.step if state is not None else 0
        if metrics and state is not None and split == "train":
            metrics = unrecorded(metrics, state.train_metrics)  # what the train step reported already
        return await asyncio.to_thread(record_groups, store, model.name, split, step, as_groups(items), metrics)

    async def delete_checkpoints(self, model: TrainableModelRef, steps: Iterable[int] | None,
                                 keep_last: int, best_metric: str | None = None, keep_previous: bool = False) -> list[int]:
        state = self.state(model)
        # The served step's checkpoint may still be written in the background: counted among the newest
        # once it is on disk (keep_last=1 kept the step before it too, as if that were the newest).
        await settle(state, await self.ensure_server())
        existing = state.store.steps()
        if best_metric is not None:  # ART's rule: keep the served step and the best by a history metric
            best = best_step(await asyncio.to_thread(state.store.read_history), best_metric)
            targets = set(existing) - {best}
        elif steps is not None:
            targets = set(steps)
        else:
            targets = set(existing[: max(0, len(existing) - max(keep_last, 1))])
        targets -= {state.step, state.step - 1} if keep_previous else {state.step}
        for step in targets & set(state.loaded_adapters):
            await state.engine.unload_adapter(state.adapter_name(step))
            state.loaded_adapters.discard(step)
        return await asyncio.to_thread(state.store.delete_checkpoints, sorted(targets))

    async def close(self) -> None:
        if self.gate is not None:
            for state in self.models.values():
                try:
                    await settle(state, self.gate)
                except CheckpointError as error:  # already rolled back and logged; closing goes on
                    _log.error("%s", error)
        for engine in self.engines.values():
            await engine.close()
        for state in self.models.values():
            state.store.release_writer()
        self.engines.clear()
        self.models.clear()
        if self.server is not None:
            await self.server.stop()
            self.server = None


_LOADING = threading.Lock()


@contextlib.asynccontextmanager
async def loading_alone() -> AsyncIterator[None]:
    """One model load at a time in this process, across every runtime and thread.

    Loading with transformers swaps process-wide state while it builds a model (weights first made
    on the meta device, then filled in): two loads in threads at once corrupted each other ("Cannot
    copy out of meta tensor"), and every later one. Waiting is done in a thread so the loop serves
    meanwhile; a waiter cancelled before it got the lock hands it back as soon as it gets it.
    """
    acquired = asyncio.get_running_loop().run_in_executor(None, _LOADING.acquire)
    try:
        await asyncio.shield(acquired)
    except asyncio.CancelledError:
        acquired.add_done_callback(lambda _: _LOADING.release())
        raise
    try:
        yield
    finally:
        _LOADING.release()


def finish_checkpoints() -> None:
    """Wait for checkpoints still being finished in the background; runs at interpreter exit.

    The backend loop is a daemon thread: without this, a script that ends right after its last
    `train` would report a checkpoint failure nowhere (the write itself is joined with the thread pool).
    """
    for runtime in list(_RUNTIMES.values()):
        for state in list(runtime.models.values()):
            if state.commit is None or runtime.gate is None:
                continue
            try:
                runtime.loop.run_sync(settle(state, runtime.gate), timeout=600)
            except Exception as error:  # noqa: BLE001 - at exit, the log is all there is
                _log.error("checkpoint of %s at exit: %s", state.model_name, error)


def _gpu_headroom(vllm: bool) -> str:
    """The device's memory after register, within this process's cap when one is set: the headroom register reports."""
    import torch

    from .engines.vllm.args import memory_snapshot
    from .plan.memory import headroom

    free, total, device_total, _ = memory_snapshot()
    capped = total < device_total
    used = torch.cuda.memory_reserved() if capped else total - free
    return headroom(used, total, capped, vllm)


async def _create_engine(plan: Plan, path: Path, config: ModelConfig) -> Engine:
    if plan.engine == "vllm":
        from .engines.vllm.engine import VLLMEngine

        return await VLLMEngine.create(path, config, plan)
    from .engines.hf.engine import HFEngine

    return await HFEngine.create(path, config, plan)


def _create_trainer(plan: Plan, path: Path, config: ModelConfig) -> Trainer:
    if plan.trainer == "unsloth":
        from .trainers.unsloth_trainer import UnslothTrainer

        return UnslothTrainer(path, config, plan)
    from .trainers.peft_trainer import PeftTrainer

    return PeftTrainer(path, config, plan)
