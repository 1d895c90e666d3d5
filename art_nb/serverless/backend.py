"""`ServerlessBackend`: train and serve on the hosted W&B Training API, as OpenPipe ART's client does.

Training is a job on the service: `train` records the rollouts locally first (nothing is lost if the
job fails), submits them, and follows the job's events to its end. The job id is saved under the
model's local directory before polling, so after a kernel restart `get_step`/`train` resume on that
job instead of starting another. Inference goes to the service's OpenAI-compatible endpoint.

`path` holds what stays local, in the store's layout: history and trajectories (what the dashboard
reads), the pending job, and checkpoints pulled back. The key comes from `api_key`, a Colab secret
or `WANDB_API_KEY` and is never printed: not in a repr, a log line, an event, or an error message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

from art_nb import events, store
from art_nb.backend import Backend, train_inputs
from art_nb.config import TrainConfig
from art_nb.records import as_groups, best_step, record_groups
from art_nb.secrets import Secret, find_secret
from art_nb.store import (
    ADAPTER_FILES,
    META_FILE,
    SERVERLESS_JOB_FILE,
    ModelStore,
    checkpoint_path,
    checkpoint_steps,
    checkpoints_dir,
)
from art_nb.trajectories import Trajectory, TrajectoryGroup
from art_nb.types import (
    InferenceEndpoint,
    ModelRef,
    ProgressCallback,
    ServerlessTrainResult,
    TrainableModelRef,
    TrainResult,
)
from art_nb.wire import RetryPolicy

from .api import API_KEY_ENV, DEFAULT_BASE_URL, RemoteModel, ServerlessError, ServiceClient, TrainingJobFailed
from .artifacts import ArtifactRef, ArtifactStore, WandbArtifacts

__all__ = ["HandedOffModel", "ServerlessBackend"]

_log = logging.getLogger("art_nb")


class HandedOffModel(TrainableModelRef, Protocol):
    """A model handle that can be re-attached to a backend (`art_nb.TrainableModel` is one)."""

    async def register(self, backend: Backend) -> None: ...


@dataclass(frozen=True)
class _Registered:
    remote: RemoteModel
    store: ModelStore


class ServerlessBackend:
    """Train on the hosted W&B Training API; serve through its OpenAI-compatible endpoint.

    `path` holds what stays local: logs, the id of a running job (to resume after a restart),
    and pulled checkpoints. `artifacts` moves LoRA files (default: W&B Artifacts via the SDK).
    """

    def __init__(self, api_key: str | Secret | None = None, *, base_url: str | None = None,
                 entity: str | None = None, path: str | os.PathLike[str] = ".art",
                 artifacts: ArtifactStore | None = None, retry: RetryPolicy | None = None,
                 poll_interval: float = 1.0, log_remote: bool = True, timeout: float = 60.0) -> None:
        key = find_secret(api_key, name=API_KEY_ENV, purpose="the W&B Training API")
        assert key is not None  # required=True raises instead of returning None
        self._key = key
        self.base_url = (base_url or DEFAULT_BASE_URL).rstrip("/")
        self.entity, self.path = entity, Path(path).expanduser().resolve()
        self.artifacts: ArtifactStore = artifacts or WandbArtifacts()
        self.retry = retry or RetryPolicy()
        self.poll_interval, self.log_remote, self.timeout = poll_interval, log_remote, timeout
        self._api = ServiceClient(key, self.base_url, self.retry, timeout)
        self._models: dict[tuple[str, str], _Registered] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}  # one job at a time per model

    def __repr__(self) -> str:
        return f"ServerlessBackend(base_url={self.base_url!r}, key from {self._key.source})"

    def _registered(self, model: ModelRef) -> _Registered:
        registered = self._models.get((model.project, model.name))
        if registered is None:
            raise RuntimeError(f"model {model.name!r} is not registered: run `await model.register(backend)`")
        return registered

    # ---- local state (what survives a kernel restart) ----------------------------------------

    def _state_path(self, model: ModelRef) -> Path:
        return self.model_dir(model) / SERVERLESS_JOB_FILE  # a restarted kernel follows the job, starts none

    def _read_state(self, model: ModelRef) -> dict[str, Any]:
        path = self._state_path(model)
        return json.loads(path.read_text()) if path.exists() else {}

    def _write_state(self, model: ModelRef, state: dict[str, Any]) -> None:
        path = self._state_path(model)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(path)

    # ---- the Backend protocol ----------------------------------------------------------------

    async def register(self, model: ModelRef) -> None:
        if not model.trainable:
            raise TypeError("ServerlessBackend trains TrainableModels; for another endpoint use "
                            "Model(inference_base_url=...)")
        base_model = cast(TrainableModelRef, model).base_model
        remote = await self._api.create_model(self.entity, model.project, model.name, base_model)
        local = await asyncio.to_thread(ModelStore, self.path, model.project, model.name)
        self._models[(model.project, model.name)] = _Registered(remote, local)
        self._locks.setdefault((model.project, model.name), asyncio.Lock())
        state = self._read_state(model)
        state["model_id"] = remote.id
        self._write_state(model, state)
        if state.get("pending_job"):
            _log.info("training job %s of %s from an earlier session is still followed: get_step/train wait for it",
                      state["pending_job"]["id"], model.name)

    def choices(self, model: ModelRef) -> dict[str, str]:
        """Nothing is chosen on this machine: the service picks its engine and trainer."""
        return {}

    def in_process_http_client(self, model: ModelRef) -> None:
        """None: this backend's endpoint is not in this process; clients reach it over HTTP."""
        return None

    def inference_endpoint(self, model: ModelRef) -> InferenceEndpoint:
        return InferenceEndpoint(base_url=self.base_url, api_key=self._key.reveal())

    def inference_model_name(self, model: ModelRef, step: int | None = None) -> str:
        remote = self._registered(model).remote
        latest = f"wandb-artifact:///{remote.entity}/{remote.project}/{remote.name}"
        return latest if step is None else self.artifact(model, step).uri

    async def list_checkpoints(self, model: ModelRef) -> list[int]:
        """Steps with a checkpoint on the service, ascending."""
        return await self._api.checkpoint_steps(self._registered(model).remote.id)

    async def get_step(self, model: TrainableModelRef) -> int:
        remote = self._registered(model).remote
        async with self._locks[(model.project, model.name)]:
            await self._finish_pending(model)
        return await self._api.latest_step(remote.id)

    async def train(self, model: TrainableModelRef, groups: Iterable[TrajectoryGroup],
                    config: TrainConfig | None = None, *, on_progress: ProgressCallback | None = None,
                    **kwargs: Any) -> TrainResult:
        """One step as a hosted training job. ART's `backend.train(model, groups, learning_rate=..., ...)`
        works unchanged (art_nb.porting maps its arguments onto TrainConfig)."""
        checked, chosen = train_inputs(groups, config, kwargs, "ServerlessBackend.train")  # before anything is written
        registered = self._registered(model)
        async with self._locks[(model.project, model.name)]:
            await self._finish_pending(model)
            step = await self._api.latest_step(registered.remote.id)
            # The rollouts are on disk before the job is submitted: a failed job loses nothing.
            await asyncio.to_thread(record_groups, registered.store, model.name, "train", step, checked)
            key = uuid.uuid4().hex  # one key for every attempt: a lost response never makes a second job
            job_id = await self._api.create_job(registered.remote.id, checked, chosen, key,
                                                f"train {model.name!r}")
            pending = {"id": job_id, "idempotency_key": key, "from_step": step, "created": time.time()}
            self._write_state(model, {**self._read_state(model), "pending_job": pending})
            return await self._follow(model, pending, on_progress)

    async def _finish_pending(self, model: TrainableModelRef) -> TrainResult | None:
        """Follow a job left by an earlier session (kernel restart) to its end."""
        pending = self._read_state(model).get("pending_job")
        if not pending:
            return None
        _log.info("resuming training job %s of %s (started before a restart)", pending["id"], model.name)
        try:
            return await self._follow(model, pending, None)
        except TrainingJobFailed as exc:
            _log.warning("%s; continuing from the last checkpoint", exc)
            return None

    async def _follow(self, model: TrainableModelRef, pending: dict[str, Any],
                      on_progress: ProgressCallback | None) -> TrainResult:
        job_id, after, total, done = pending["id"], None, None, 0
        steps: list[dict[str, float]] = []
        events.emit("train_started", model=model.name, step=pending["from_step"], job=job_id)
        while True:
            page = await self._api.job_events(job_id, after)
            for event in page.get("data") or []:
                after, kind, data = event["id"], event["type"], dict(event.get("data") or {})
                if kind == "training_started":
                    total = data.get("num_sequences")
                elif kind == "gradient_step":
                    done += 1
                    steps.append({k: float(v) for k, v in data.items() if isinstance(v, (int, float))})
                    progress = {"phase": "train", "done": done, "total": total, **steps[-1]}
                    events.emit("train_progress", model=model.name, job=job_id, **progress)
                    if on_progress is not None:
                        on_progress(progress)
                elif kind in ("training_ended", "training_failed"):
                    state = self._read_state(model)
                    state.pop("pending_job", None)
                    self._write_state(model, state)
                    if kind == "training_failed":
                        message = self._key.redact(str(data.get("error_message") or "no message"))
                        raise TrainingJobFailed(f"training job {job_id} of {model.name!r} failed on the service: "
                                                f"{message}")
                    return await self._finished(model, steps)
            if not page.get("has_more"):
                await asyncio.sleep(self.poll_interval)

    async def _finished(self, model: TrainableModelRef, steps: list[dict[str, float]]) -> ServerlessTrainResult:
        keys = {k for s in steps for k in s}
        metrics = {k: statistics.fmean(s[k] for s in steps if k in s) for k in sorted(keys)}
        metrics["gradient_steps"] = float(len(steps))
        step = await self._api.latest_step(self._registered(model).remote.id)
        events.emit("train_finished", model=model.name, step=step, metrics=metrics)
        return ServerlessTrainResult(step=step, metrics=metrics, artifact_name=self.artifact(model, step).path)

    async def train_sft(self, model: TrainableModelRef, trajectories: Iterable[Trajectory],
                        config: Any = None, _config: Any = None, verbose: bool = False, *,
                        on_progress: ProgressCallback | None = None) -> TrainResult:
        """ART's supervised fine-tuning: not available through this backend (the error says what to do)."""
        raise NotImplementedError(
            "ServerlessBackend.train_sft: art_nb's client of the hosted training API submits RL jobs only; "
            "warm-start with SFT on a LocalBackend, then continue hosted with `await model.handoff(backend)`")

    async def log(self, model: ModelRef, trajectories: Iterable[TrajectoryGroup | Trajectory], split: str = "val",
                  step: int | None = None, metrics: dict[str, float] | None = None) -> dict[str, float]:
        """Record locally (what the dashboard reads) and, with `log_remote`, on the service too."""
        groups = as_groups(list(trajectories))
        registered = self._registered(model)
        step = await self._api.latest_step(registered.remote.id) if step is None else step
        summary = await asyncio.to_thread(record_groups, registered.store, model.name, split, step, groups, metrics)
        if self.log_remote:
            await self._api.log(registered.remote.id, groups, split)
        return summary

    async def wait_for_checkpoint(self, model: TrainableModelRef) -> int:
        """The service's checkpoint is complete when its job ends: this waits for a pending job only."""
        return await self.get_step(model)

    def model_dir(self, model: ModelRef) -> Path:
        return store.model_dir(self.path, model.project, model.name)

    async def delete_checkpoints(self, model: TrainableModelRef, steps: Iterable[int] | None = None,
                                 keep_last: int = 1, *, best_metric: str | None = None) -> list[int]:
        existing = await self.list_checkpoints(model)
        targets = set(steps) if steps is not None else set(existing[: max(0, len(existing) - max(keep_last, 1))])
        if best_metric is not None:  # ART's rule: keep the latest and the best by a metric this machine logged
            history = await asyncio.to_thread(store.read_jsonl, self.model_dir(model) / store.HISTORY_FILE)
            targets = set(existing) - {best_step(history, best_metric)}
        chosen = sorted((targets & set(existing)) - {existing[-1]}) if existing else []  # the latest is served
        if chosen:
            await self._api.delete_checkpoints(self._registered(model).remote.id, chosen)
        return chosen

    def __call__(self) -> ServerlessBackend:
        """The backend itself: ART code reaches it as `model.backend()`, art_nb code as `model.backend`."""
        return self

    async def close(self) -> None:
        await self._api.close()

    # ---- checkpoints across the boundary ------------------------------------------------------

    def artifact(self, model: ModelRef, step: int) -> ArtifactRef:
        remote = self._registered(model).remote
        return ArtifactRef(remote.entity, remote.project, remote.name, step)

    async def pull_checkpoint(self, model: TrainableModelRef, step: int | None = None) -> Path:
        """Copy a checkpoint's LoRA to `{path}/{project}/models/{name}/checkpoints/{step:04d}`, where a
        `LocalBackend(path)` resumes from it (without optimizer state) for local inference or export."""
        step = await self.get_step(model) if step is None else step
        local = self._registered(model).store
        ref = self.artifact(model, step)
        staging = Path(tempfile.mkdtemp(prefix=".pull-", dir=local.dir))
        try:
            await self.artifacts.download(ref, staging, self._key)
            missing = [f for f in ADAPTER_FILES if not (staging / f).is_file()]
            if missing:
                raise ServerlessError(f"{ref.path} has no {', '.join(missing)}: not a LoRA checkpoint")

            def write(directory: Path) -> None:
                for file in staging.iterdir():
                    if file.is_file() and file.name != META_FILE:
                        shutil.copy2(file, directory / file.name)

            meta = {"base_model": model.base_model, "pulled_from": ref.uri}
            return await asyncio.to_thread(local.write_checkpoint, step, write, meta)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    async def push_checkpoint(self, model: TrainableModelRef, directory: Path, step: int) -> ArtifactRef:
        """Upload a local LoRA (adapter files only) as the model's checkpoint `step`."""
        missing = [f for f in ADAPTER_FILES if not (directory / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{directory} lacks {', '.join(missing)}: not a LoRA checkpoint")
        ref = self.artifact(model, step)
        with tempfile.TemporaryDirectory(prefix="art-nb-push-") as staging:
            for name in ADAPTER_FILES:  # optimizer state and logs stay on this machine
                shutil.copy2(directory / name, Path(staging) / name)
            await self.artifacts.upload(ref, Path(staging), self._key, self._registered(model).remote.run_id)
        return ref

    async def handoff(self, model: HandedOffModel, *, source: Backend | None = None,
                      local_path: str | os.PathLike[str] | None = None, step: int | None = None) -> int:
        """Continue training `model` here from its latest local LoRA (or `step`); returns that step.

        The checkpoint comes from `local_path` (the `path` of the LocalBackend that trained it) when
        given, else from `source` (the backend the model is registered with), else from ".art". Only
        the adapter's two files are uploaded. Afterwards the model is registered here, so
        `model.train(...)` goes on on the service. `TrainableModel.handoff(backend)` calls this.
        """
        if local_path is None and source is not None:
            await source.wait_for_checkpoint(model)  # a checkpoint still being written is not uploaded
            checkpoints = checkpoints_dir(source.model_dir(model))
        else:
            checkpoints = checkpoints_dir(store.model_dir(local_path or ".art", model.project, model.name))
        local_steps = await asyncio.to_thread(checkpoint_steps, checkpoints)
        if step is None:
            if not local_steps:
                raise FileNotFoundError(f"no local checkpoint of {model.name!r} under {checkpoints}: train it "
                                        "first, or pass local_path= (the LocalBackend's path)")
            step = local_steps[-1]
        elif step not in local_steps:
            raise FileNotFoundError(f"no local checkpoint {step} of {model.name!r} under {checkpoints} "
                                    f"(there: {local_steps or 'none'})")
        await self.register(model)
        remote_steps = await self.list_checkpoints(model)
        if remote_steps and remote_steps[-1] >= step:
            raise ServerlessError(
                f"{model.name!r} already has checkpoint {remote_steps[-1]} on the service (local: {step}); hand off "
                "under a new model name, or pull the service's checkpoint instead")
        ref = await self.push_checkpoint(model, checkpoint_path(checkpoints, step), step)
        _log.info("handed off %s step %d as %s", model.name, step, ref.uri)
        await model.register(self)
        return step
