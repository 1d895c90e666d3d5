"""`ServerlessBackend`: train and serve on the hosted W&B Training API, as OpenPipe ART's client does.

The protocol (base URL `https://api.training.wandb.ai/v1`, bearer auth with the W&B API key):

    POST   /preview/models                          {entity, project, name, base_model, return_existing}
    POST   /preview/models/{id}/log                 {model_id, trajectory_groups, split}
    GET    /preview/models/{id}/checkpoints         ?order=&limit=&after= -> {data: [{id, step, metrics}], has_more}
    DELETE /preview/models/{id}/checkpoints         {steps}
    POST   /preview/training-jobs                   {model_id, trajectory_groups, experimental_config} -> {id}
    GET    /preview/training-jobs/{id}/events       ?after=<event id>  -> {data: [{id, type, data}], has_more}
    POST   /chat/completions                        model "wandb-artifact:///{entity}/{project}/{name}:step{N}"

Event types: `training_started` ({num_sequences}), `gradient_step` (metrics), `training_ended`,
`training_failed` ({error_message}). Checkpoint files (the LoRA) live in W&B Artifacts as
`{entity}/{project}/{name}:step{N}`, type "lora"; they travel through an `ArtifactStore`.

Robustness: transient failures (connection refused, 429, 5xx) are retried with bounded exponential
backoff and jitter, waiting what `Retry-After` asks; job creation sends one `Idempotency-Key` on
every attempt. The job id is saved under the model's local directory before polling, so after a
kernel restart `get_step`/`train` resume on that job instead of starting another.

The key comes from `api_key`, a Colab secret or `WANDB_API_KEY` and is never printed: not in a
repr, a log line, an event, or an error message (server messages are scrubbed of it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from .. import events
from ..config import TrainConfig
from ..secrets import Secret, find_secret
from ..store import ModelStore, check_name
from ..trajectory import Trajectory, TrajectoryGroup
from ._http import LoopClients, RetryPolicy, request_with_retries
from .base import InferenceEndpoint, ProgressCallback, TrainResult

if TYPE_CHECKING:
    from ..model import Model, TrainableModel

__all__ = [
    "ServerlessBackend", "ServerlessError", "TrainingJobFailed", "ArtifactRef", "ArtifactStore",
    "WandbArtifacts", "handoff", "DEFAULT_BASE_URL", "API_KEY_ENV",
]

DEFAULT_BASE_URL = "https://api.training.wandb.ai/v1"
API_KEY_ENV = "WANDB_API_KEY"
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
_STATE_FILE = "serverless.json"
_log = logging.getLogger("art_nb")


class ServerlessError(RuntimeError):
    """The W&B Training API refused a request, or could not be reached after retrying."""


class TrainingJobFailed(ServerlessError):
    """A training job ended with `training_failed`; the message is the service's."""


# --- checkpoint files ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ArtifactRef:
    """One checkpoint's artifact: `{entity}/{project}/{name}:step{step}` of type "lora"."""

    entity: str
    project: str
    name: str
    step: int

    @property
    def path(self) -> str:
        return f"{self.entity}/{self.project}/{self.name}:step{self.step}"

    @property
    def uri(self) -> str:
        return f"wandb-artifact:///{self.path}"


class ArtifactStore(Protocol):
    async def download(self, ref: ArtifactRef, directory: Path, key: Secret) -> None:
        """Fill the empty `directory` with the artifact's files."""
        ...

    async def upload(self, ref: ArtifactRef, directory: Path, key: Secret, run_id: str | None) -> None:
        """Store `directory`'s files as `ref` (alias `step{N}`), logged to the model's run."""
        ...


class WandbArtifacts:
    """Checkpoint files through W&B Artifacts with the `wandb` SDK (`pip install wandb`).

    Not exercised by the tests here (no network): they use a local store with the same interface.
    """

    @staticmethod
    def _sdk() -> Any:
        try:
            import wandb  # type: ignore[import-not-found]
        except ImportError as exc:
            raise ImportError("moving serverless checkpoints needs the W&B SDK: pip install wandb") from exc
        return wandb

    async def download(self, ref: ArtifactRef, directory: Path, key: Secret) -> None:
        def run() -> None:
            wandb = self._sdk()
            wandb.Api(api_key=key.reveal()).artifact(ref.path, type="lora").download(root=str(directory))

        await _scrubbed(asyncio.to_thread(run), key, f"download of {ref.path}")

    async def upload(self, ref: ArtifactRef, directory: Path, key: Secret, run_id: str | None) -> None:
        def run() -> None:
            wandb = self._sdk()
            settings = wandb.Settings(api_key=key.reveal(), silent=True, console="off")
            wb_run = wandb.init(entity=ref.entity, project=ref.project, id=run_id, resume="allow" if run_id else None,
                                job_type="art-nb-handoff", settings=settings)
            try:
                artifact = wandb.Artifact(ref.name, type="lora", metadata={"step": ref.step, "source": "art_nb"})
                artifact.add_dir(str(directory))
                wb_run.log_artifact(artifact, aliases=[f"step{ref.step}"]).wait()
            finally:
                wb_run.finish()

        await _scrubbed(asyncio.to_thread(run), key, f"upload of {ref.path}")


async def _scrubbed(work: Any, key: Secret, what: str) -> None:
    try:
        await work
    except ImportError:
        raise
    except Exception as exc:  # noqa: BLE001 - an SDK error could quote the key: re-raise scrubbed
        raise ServerlessError(f"{what} failed: {key.redact(f'{type(exc).__name__}: {exc}')}") from None


def _model_dir(root: Path, model: Model) -> Path:
    """The model's directory in the store layout (art_nb.store), without opening the store."""
    return root / check_name("project", model.project) / "models" / check_name("name", model.name)


# --- the backend --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Remote:
    id: str
    entity: str
    project: str
    name: str
    run_id: str | None


def _art_group(group: TrajectoryGroup) -> dict[str, Any]:
    """A group in ART's JSON shape (exceptions as {type, message, traceback})."""
    data = group.model_dump(mode="json", include={"trajectories", "metadata"})
    data["exceptions"] = [{"type": "Exception", "message": e, "traceback": ""} for e in group.exceptions]
    return data


def _experimental_config(config: TrainConfig) -> dict[str, Any]:
    """TrainConfig as the service's RL knobs (what it has no knob for stays local)."""
    return {
        "learning_rate": config.learning_rate,
        "loss_fn": config.loss,
        "ppo": config.loss == "ppo",
        "epsilon": config.epsilon,
        "epsilon_high": config.epsilon_high,
        "scale_rewards": config.scale_rewards,
        "logprob_calculation_chunk_size": config.logprob_chunk_tokens,
    }


class ServerlessBackend:
    """Train on the hosted W&B Training API; serve through its OpenAI-compatible endpoint.

    `path` holds what stays local: logs, the id of a running job (to resume after a restart),
    and pulled checkpoints. `artifacts` moves LoRA files (default: W&B Artifacts via the SDK).
    """

    def __init__(self, api_key: str | Secret | None = None, *, base_url: str | None = None,
                 entity: str | None = None, path: str | os.PathLike[str] = ".art",
                 artifacts: ArtifactStore | None = None, retry: RetryPolicy | None = None,
                 poll_interval: float = 1.0, log_remote: bool = True, timeout: float = 60.0) -> None:
        self._key = find_secret(api_key, name=API_KEY_ENV, purpose="the W&B Training API")
        assert self._key is not None
        self.base_url = (base_url or DEFAULT_BASE_URL).rstrip("/")
        self.entity, self.path = entity, Path(path).expanduser().resolve()
        self.artifacts: ArtifactStore = artifacts or WandbArtifacts()
        self.retry = retry or RetryPolicy()
        self.poll_interval, self.log_remote, self.timeout = poll_interval, log_remote, timeout
        self._clients = LoopClients(lambda: httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout, headers={"Authorization": f"Bearer {self._key.reveal()}"}))
        self._models: dict[str, _Remote] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def __repr__(self) -> str:
        return f"ServerlessBackend(base_url={self.base_url!r}, key from {self._key.source})"

    # ---- HTTP ---------------------------------------------------------------------------------

    async def _api(self, method: str, route: str, what: str, *, idempotency_key: str | None = None,
                   **kwargs: Any) -> Any:
        def on_retry(attempt: int, delay: float, reason: str) -> None:
            _log.warning("W&B Training API: %s on %s %s; retry %d/%d in %.1f s",
                         reason, method, route, attempt, self.retry.attempts - 1, delay)

        try:
            response = await request_with_retries(self._clients.get(), method, route, policy=self.retry,
                                                  idempotency_key=idempotency_key, on_retry=on_retry, **kwargs)
        except httpx.TransportError as exc:
            raise ServerlessError(f"{what}: could not reach {self.base_url} after retrying: "
                                  f"{self._key.redact(f'{type(exc).__name__}: {exc}')}") from None
        if response.is_success:
            return response.json() if response.content else None
        try:
            message = str(response.json().get("error", {}).get("message") or response.text)
        except (json.JSONDecodeError, AttributeError):
            message = response.text
        message = self._key.redact(message[:1000])
        if response.status_code in (401, 403):
            raise ServerlessError(f"{what}: the W&B Training API rejected the key from {self._key.source} "
                                  f"(HTTP {response.status_code}): {message}")
        raise ServerlessError(f"{what} failed: HTTP {response.status_code} from {self.base_url}: {message}")

    def _remote(self, model: Model) -> _Remote:
        remote = self._models.get(model.name)
        if remote is None:
            raise RuntimeError(f"model {model.name!r} is not registered: run `await model.register(backend)`")
        return remote

    # ---- local state (what survives a kernel restart) ----------------------------------------

    def _state_path(self, model: Model) -> Path:
        return _model_dir(self.path, model) / _STATE_FILE

    def _read_state(self, model: Model) -> dict[str, Any]:
        path = self._state_path(model)
        return json.loads(path.read_text()) if path.exists() else {}

    def _write_state(self, model: Model, state: dict[str, Any]) -> None:
        path = self._state_path(model)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(path)

    # ---- the Backend protocol ----------------------------------------------------------------

    async def register(self, model: Model) -> None:
        if not model.trainable:
            raise TypeError("ServerlessBackend trains TrainableModels; for another endpoint use "
                            "Model(inference_base_url=...)")
        body = {"entity": self.entity, "project": model.project, "name": model.name,
                "base_model": model.base_model, "return_existing": True}  # type: ignore[attr-defined]
        reply = await self._api("POST", "/preview/models", f"register {model.name!r}", json=body)
        remote = _Remote(str(reply["id"]), str(reply["entity"]), str(reply.get("project", model.project)),
                         str(reply.get("name", model.name)), reply.get("run_id"))
        self._models[model.name] = remote
        self._locks.setdefault(model.name, asyncio.Lock())
        state = self._read_state(model)
        state["model_id"] = remote.id
        self._write_state(model, state)
        if state.get("pending_job"):
            _log.info("training job %s of %s from an earlier session is still followed: get_step/train wait for it",
                      state["pending_job"]["id"], model.name)

    def inference_endpoint(self, model: Model) -> InferenceEndpoint:
        return InferenceEndpoint(base_url=self.base_url, api_key=self._key.reveal())

    def inference_model_name(self, model: Model, step: int | None = None) -> str:
        remote = self._remote(model)
        base = f"wandb-artifact:///{remote.entity}/{remote.project}/{remote.name}"
        return base if step is None else f"{base}:step{step}"

    async def list_checkpoints(self, model: Model) -> list[int]:
        """Steps with a checkpoint on the service, ascending."""
        remote, steps, after = self._remote(model), [], None
        while True:
            params = {"order": "asc", "limit": 100, **({"after": after} if after else {})}
            page = await self._api("GET", f"/preview/models/{remote.id}/checkpoints", "list checkpoints", params=params)
            steps.extend(int(c["step"]) for c in page.get("data", []))
            if not page.get("has_more") or not page.get("data"):
                return sorted(steps)
            after = page["data"][-1]["id"]

    async def _latest_step(self, model: Model) -> int:
        remote = self._remote(model)
        page = await self._api("GET", f"/preview/models/{remote.id}/checkpoints", "get_step",
                               params={"order": "desc", "limit": 1})
        data = page.get("data") or []
        return int(data[0]["step"]) if data else 0

    async def get_step(self, model: TrainableModel) -> int:
        self._remote(model)
        async with self._locks[model.name]:
            await self._finish_pending(model)
        return await self._latest_step(model)

    async def train(self, model: TrainableModel, groups: Iterable[TrajectoryGroup], config: TrainConfig | None = None,
                    *, on_progress: ProgressCallback | None = None) -> TrainResult:
        from ..records import summarize, trajectory_record

        groups = list(groups)
        if any(not isinstance(g, TrajectoryGroup) or g.pending for g in groups):
            raise TypeError("train takes gathered TrajectoryGroups (await gather_trajectory_groups(...) first)")
        config = config or TrainConfig()
        remote = self._remote(model)
        async with self._locks[model.name]:
            await self._finish_pending(model)
            step = await self._latest_step(model)
            store = ModelStore(self.path, model.project, model.name)  # nothing lost: rollouts on disk first
            records = [trajectory_record(t, group=i) for i, g in enumerate(groups) for t in g.trajectories]
            await asyncio.to_thread(store.append_trajectories, "train", step, records)
            rollouts = summarize(groups)
            await asyncio.to_thread(store.append_history, {
                "step": step, "split": "train", "time": time.time(), **{f"train/{k}": v for k, v in rollouts.items()}})
            events.emit("log", model=model.name, step=step, split="train", metrics=rollouts)
            key = uuid.uuid4().hex  # one key for every attempt: a lost response never makes a second job
            body = {"model_id": remote.id, "trajectory_groups": [_art_group(g) for g in groups],
                    "experimental_config": _experimental_config(config)}
            job = await self._api("POST", "/preview/training-jobs", f"train {model.name!r}", json=body,
                                  idempotency_key=key)
            pending = {"id": str(job["id"]), "idempotency_key": key, "from_step": step, "created": time.time()}
            self._write_state(model, {**self._read_state(model), "pending_job": pending})
            return await self._follow(model, pending, on_progress)

    async def _finish_pending(self, model: TrainableModel) -> TrainResult | None:
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

    async def _follow(self, model: TrainableModel, pending: dict[str, Any],
                      on_progress: ProgressCallback | None) -> TrainResult:
        job_id, after, total, done = pending["id"], None, None, 0
        steps: list[dict[str, float]] = []
        events.emit("train_started", model=model.name, step=pending["from_step"], job=job_id)
        while True:
            params = {"after": after} if after else {}
            page = await self._api("GET", f"/preview/training-jobs/{job_id}/events", f"progress of job {job_id}",
                                   params=params)
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

    async def _finished(self, model: TrainableModel, steps: list[dict[str, float]]) -> TrainResult:
        keys = {k for s in steps for k in s}
        metrics = {k: statistics.fmean(s[k] for s in steps if k in s) for k in sorted(keys)}
        metrics["gradient_steps"] = float(len(steps))
        step = await self._latest_step(model)
        events.emit("train_finished", model=model.name, step=step, metrics=metrics)
        return TrainResult(step=step, metrics=metrics)

    async def log(self, model: Model, trajectories: Iterable[TrajectoryGroup | Trajectory], split: str = "val",
                  step: int | None = None, metrics: dict[str, float] | None = None) -> dict[str, float]:
        from ..records import summarize, trajectory_record

        groups = [t if isinstance(t, TrajectoryGroup) else TrajectoryGroup([t]) for t in trajectories]
        step = await self._latest_step(model) if step is None else step
        store = ModelStore(self.path, model.project, model.name)
        records = [trajectory_record(t, group=i) for i, g in enumerate(groups) for t in g.trajectories]
        await asyncio.to_thread(store.append_trajectories, split, step, records)
        summary = {**summarize(groups), **(metrics or {})}
        await asyncio.to_thread(store.append_history, {
            "step": step, "split": split, "time": time.time(), **{f"{split}/{k}": v for k, v in summary.items()}})
        if self.log_remote:
            remote = self._remote(model)
            await self._api("POST", f"/preview/models/{remote.id}/log", "log", json={
                "model_id": remote.id, "trajectory_groups": [_art_group(g) for g in groups], "split": split})
        events.emit("log", model=model.name, step=step, split=split, metrics=summary)
        return summary

    async def delete_checkpoints(self, model: TrainableModel, steps: Iterable[int] | None = None,
                                 keep_last: int = 1) -> list[int]:
        existing = await self.list_checkpoints(model)
        targets = set(steps) if steps is not None else set(existing[: max(0, len(existing) - max(keep_last, 1))])
        targets = sorted((targets & set(existing)) - {existing[-1]}) if existing else []  # the latest is served
        if targets:
            remote = self._remote(model)
            await self._api("DELETE", f"/preview/models/{remote.id}/checkpoints", "delete checkpoints",
                            json={"steps": targets})
        return targets

    # ---- checkpoints across the boundary ------------------------------------------------------

    def artifact(self, model: Model, step: int) -> ArtifactRef:
        remote = self._remote(model)
        return ArtifactRef(remote.entity, remote.project, remote.name, step)

    async def pull_checkpoint(self, model: TrainableModel, step: int | None = None) -> Path:
        """Copy a checkpoint's LoRA to `{path}/{project}/models/{name}/checkpoints/{step:04d}`, where a
        `LocalBackend(path)` resumes from it (without optimizer state) for local inference or export."""
        step = await self.get_step(model) if step is None else step
        store = ModelStore(self.path, model.project, model.name)
        staging = Path(tempfile.mkdtemp(prefix=".pull-", dir=store.dir))
        try:
            await self.artifacts.download(self.artifact(model, step), staging, self._key)
            if not (staging / "adapter_model.safetensors").exists():
                raise ServerlessError(f"{self.artifact(model, step).path} has no adapter_model.safetensors")

            def write(directory: Path) -> None:
                for file in staging.iterdir():
                    if file.is_file() and file.name != "meta.json":
                        shutil.copy2(file, directory / file.name)

            meta = {"base_model": model.base_model, "pulled_from": self.artifact(model, step).uri}
            return await asyncio.to_thread(store.write_checkpoint, step, write, meta)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    async def push_checkpoint(self, model: TrainableModel, directory: Path, step: int) -> ArtifactRef:
        """Upload a local LoRA (adapter files only) as the model's checkpoint `step`."""
        missing = [f for f in ADAPTER_FILES if not (directory / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{directory} lacks {', '.join(missing)}: not a LoRA checkpoint")
        ref = self.artifact(model, step)
        with tempfile.TemporaryDirectory(prefix="art-nb-push-") as staging:
            for name in ADAPTER_FILES:  # optimizer state and logs stay on this machine
                shutil.copy2(directory / name, Path(staging) / name)
            await self.artifacts.upload(ref, Path(staging), self._key, self._remote(model).run_id)
        return ref

    async def close(self) -> None:
        await self._clients.close()


_STEP = re.compile(r"^\d{4,}$")


async def handoff(model: TrainableModel, backend: ServerlessBackend, *,
                  local_path: str | os.PathLike[str] | None = None, step: int | None = None) -> int:
    """Continue training `model` on `backend` from its latest local LoRA (or `step`); returns that step.

    The local checkpoint comes from the backend the model is registered with (a LocalBackend), else
    from `local_path` (default ".art"). Only `adapter_model.safetensors` and `adapter_config.json`
    are uploaded. Afterwards the model is registered with `backend`: `model.train(...)` goes on there.
    """
    current = getattr(model, "_backend", None)
    if local_path is None and current is not None and hasattr(current, "checkpoint_dir"):
        checkpoints = Path(current.checkpoint_dir(model, 0)).parent
    else:
        checkpoints = _model_dir(Path(local_path or ".art").expanduser().resolve(), model) / "checkpoints"
    local_steps = sorted(int(p.name) for p in checkpoints.glob("*") if _STEP.match(p.name) and p.is_dir()) \
        if checkpoints.is_dir() else []
    if step is None:
        if not local_steps:
            raise FileNotFoundError(f"no local checkpoint of {model.name!r} under {checkpoints}")
        step = local_steps[-1]
    elif step not in local_steps:
        raise FileNotFoundError(f"no local checkpoint {step} of {model.name!r} under {checkpoints}")
    await backend.register(model)
    remote_steps = await backend.list_checkpoints(model)
    if remote_steps and remote_steps[-1] >= step:
        raise ServerlessError(
            f"{model.name!r} already has checkpoint {remote_steps[-1]} on the service (local: {step}); hand off "
            "under a new model name, or pull the service's checkpoint instead")
    ref = await backend.push_checkpoint(model, checkpoints / f"{step:04d}", step)
    _log.info("handed off %s step %d as %s", model.name, step, ref.uri)
    await model.register(backend)
    return step
