"""`RemoteBackend`: the `Backend` protocol over HTTP, against `art-nb serve` on a GPU machine.

The notebook keeps its code: `await model.register(RemoteBackend("http://gpu-box:8000", api_key=...))`
and rollouts talk to the server's OpenAI endpoint (`/v1`), `train` sends the gathered groups (and
`train_sft` the demonstrations) and streams the server's progress back into `art_nb.events` (so the
dashboard moves) and `on_progress`.

Failures say what to do. A refused connection or a stream cut mid-step raises `RemoteBackendError`
naming the server and the way back: re-run `await model.register(backend)` (a restarted server
resumes from its last checkpoint) and continue from `await model.get_step()`. `train` is never
retried automatically (it is not idempotent), nor is `train_sft`; reads are, briefly.

The token comes from `api_key`, a Colab secret or the environment variable `ART_NB_API_KEY`, else, for
a server on this machine (a loopback URL), the file `art-nb serve` saved its generated token in
(`art_nb.remote.tokens`); it is never shown (see `art_nb.secrets`).

What comes back is not trusted further than it must be: a downloaded file stops at the size the
listing gave, a stream line at `MAX_STREAM_LINE`, and a download never replaces a checkpoint of
this machine or writes into a model directory another process is writing (its writer lock).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

import httpx

from art_nb import events
from art_nb._version import __version__
from art_nb.backend import sft_inputs, train_inputs
from art_nb.config import TrainConfig
from art_nb.pipelining import rollouts_beside
from art_nb.records import UnknownMetricError
from art_nb.secrets import Secret, find_secret
from art_nb.sft_config import TrainSFTConfig
from art_nb.store import ADAPTER_FILES, META_FILE, TRAINER_STATE, ModelStore, model_dir
from art_nb.trajectories import Trajectory, TrajectoryGroup
from art_nb.types import InferenceEndpoint, ModelRef, ProgressCallback, TrainableModelRef, TrainResult, inference_name
from art_nb.web import MB

from ..wire import (
    VERSION_HEADER,
    LineTooLongError,
    LoopClients,
    RetryPolicy,
    bounded_lines,
    group_to_wire,
    request_with_retries,
    trajectory_to_wire,
    version_mismatch,
)
from .tokens import loopback_token

__all__ = ["API_KEY_ENV", "MAX_STREAM_LINE", "RemoteBackend", "RemoteBackendError", "RemoteTrainingError"]

API_KEY_ENV = "ART_NB_API_KEY"
MAX_STREAM_LINE = 8 * MB  # a train stream's line (events, metrics) is a few KB; an endless one must not fill memory
_SHOWN_CHARS = 1000  # of a server's error message, after the key is masked


def _client_version() -> str:
    """This package's version, as sent to the server (a function, so a test can play another version)."""
    return __version__


class RemoteBackendError(RuntimeError):
    """The server could not be reached, refused the request, or the connection was lost."""


class RemoteTrainingError(RemoteBackendError):
    """The step failed on the server; `error_type` is the server-side exception's class name."""

    def __init__(self, message: str, error_type: str) -> None:
        super().__init__(message)
        self.error_type = error_type


class RemoteBackend:
    """Serve and train on an `art-nb serve` server. `path` is where downloaded checkpoints go."""

    def __init__(self, base_url: str, api_key: str | Secret | None = None, *, path: str | os.PathLike[str] = ".art",
                 timeout: float = 60.0, read_timeout: float = 120.0, retry: RetryPolicy | None = None) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.path = Path(path).expanduser().resolve()
        self.timeout = timeout  # connect/write/pool, and reads of ordinary requests
        self.read_timeout = read_timeout  # silence tolerated on a stream (the server beats every 5 s)
        self.retry = retry or RetryPolicy(attempts=4, base_delay=0.5, max_delay=5.0)
        self._key = find_secret(api_key, name=API_KEY_ENV, required=False) or loopback_token(self.base_url)
        self._clients = LoopClients(self._new_client)
        self._choices: dict[str, dict[str, str]] = {}

    def __repr__(self) -> str:
        return f"RemoteBackend({self.base_url!r}, auth={'token' if self._key else 'none'})"

    # ---- HTTP ---------------------------------------------------------------------------------

    def _new_client(self) -> httpx.AsyncClient:
        headers = {VERSION_HEADER: _client_version()}
        if self._key is not None:
            headers["Authorization"] = f"Bearer {self._key.reveal()}"
        return httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=self.timeout)

    def _client(self) -> httpx.AsyncClient:
        return self._clients.get()

    def _redact(self, text: str, limit: int = _SHOWN_CHARS) -> str:
        """`text` with the key and any long piece of it masked, then cut to `limit` characters.

        Masking comes first: a cut through the key would leave a piece that no longer matches the
        whole key (the probe saw 30 of 40 characters). Only the head that can reach the cut is
        scanned, so a huge error body costs no more than a short one.
        """
        if self._key is None:
            return text[:limit]
        head = text[: limit + len(self._key.reveal())]
        return self._key.redact(head)[:limit]

    def _lost(self, exc: Exception, what: str) -> RemoteBackendError:
        detail = self._redact(f"{type(exc).__name__}: {exc}")
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            return RemoteBackendError(
                f"cannot reach the art-nb server at {self.base_url} ({what}): {detail}. Is `art-nb serve` running "
                "there? If it restarted, re-run `await model.register(backend)`")
        return RemoteBackendError(
            f"lost connection to {self.base_url} during {what}: {detail}; the server may have restarted — re-run "
            "`await model.register(backend)` and continue from `await model.get_step()`")

    def _check(self, response: httpx.Response, what: str) -> Any:
        if response.is_success:
            return response.json()
        try:
            error = response.json().get("error", {})
            message, code = str(error.get("message", "")), error.get("code")
        except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
            message, code = response.text, None
        message = self._redact(message)
        if response.status_code == 401:
            raise RemoteBackendError(
                f"the server at {self.base_url} rejected the token (HTTP 401) during {what}: pass the token "
                f"`art-nb serve` printed as RemoteBackend(..., api_key=...) or set {API_KEY_ENV}")
        if code in ("version_mismatch", "model_not_registered"):
            raise RemoteBackendError(message)
        if code == "unknown_metric":  # the type a local delete_checkpoints raises, so callers handle both alike
            raise UnknownMetricError(message)
        raise RemoteBackendError(f"{what} failed on {self.base_url}: HTTP {response.status_code}: {message}")

    async def _call(self, method: str, route: str, what: str, **kwargs: Any) -> Any:
        try:
            response = await request_with_retries(self._client(), method, route, policy=self.retry, **kwargs)
        except httpx.TransportError as exc:
            raise self._lost(exc, what) from None
        return self._check(response, what)

    # ---- the Backend protocol ----------------------------------------------------------------

    async def register(self, model: ModelRef) -> None:
        if not model.trainable:
            raise TypeError("RemoteBackend serves TrainableModels; for another endpoint use "
                            "Model(inference_base_url=...)")
        health = await self._call("GET", "/api/health", "the version handshake")
        problem = version_mismatch(_client_version(), str(health.get("version", "?")))
        if problem:
            raise RemoteBackendError(problem)
        trainable: TrainableModelRef = model  # type: ignore[assignment]
        body = {"name": trainable.name, "project": trainable.project, "base_model": trainable.base_model,
                "config": trainable.backend_config.model_dump(mode="json")}
        # Loading a model can take minutes on the server: no read timeout for this one.
        reply = await self._call("POST", "/api/models", f"register {model.name!r}", json=body,
                                 timeout=httpx.Timeout(self.timeout, read=None))
        self._choices[model.name] = dict(reply.get("choices") or {})

    def choices(self, model: ModelRef) -> dict[str, str]:
        """What the server chose automatically for `model` (engine, trainer, resume...) and why."""
        return dict(self._choices.get(model.name, {}))

    def in_process_http_client(self, model: ModelRef) -> None:
        """None: this backend's endpoint is not in this process; clients reach it over HTTP."""
        return None

    def inference_endpoint(self, model: ModelRef) -> InferenceEndpoint:
        return InferenceEndpoint(base_url=f"{self.base_url}/v1",
                                 api_key=self._key.reveal() if self._key is not None else "none")

    def inference_model_name(self, model: ModelRef, step: int | None = None) -> str:
        return inference_name(model.name, step)

    async def get_step(self, model: TrainableModelRef) -> int:
        return int((await self._call("GET", f"/api/models/{model.name}/step", "get_step"))["step"])

    async def train(self, model: TrainableModelRef, groups: Iterable[TrajectoryGroup],
                    config: TrainConfig | None = None, *, on_progress: ProgressCallback | None = None,
                    **kwargs: Any) -> TrainResult:
        """One step on the server. ART's `backend.train(model, groups, learning_rate=..., ...)` works
        unchanged (art_nb.porting maps its arguments onto TrainConfig)."""
        checked, chosen = train_inputs(groups, config, kwargs, "RemoteBackend.train")  # before anything is sent
        body = {"groups": [group_to_wire(g) for g in checked], "config": chosen.model_dump(mode="json"),
                "beside": rollouts_beside()}  # a pipeline's rollouts run meanwhile: the server keeps serving them
        return await self._stream_step(model, "train", body, on_progress)

    async def train_sft(self, model: TrainableModelRef, trajectories: Iterable[Trajectory],
                        config: TrainSFTConfig | None = None, _config: Mapping[str, Any] | None = None,
                        verbose: bool = False, *, on_progress: ProgressCallback | None = None) -> TrainResult:
        """Supervised fine-tuning on the server (ART's `train_sft`), as `LocalBackend.train_sft` does it
        there: one optimizer step per batch, one checkpoint for the call, progress per batch. Input
        is checked here first, so a mistake fails before anything is sent, as it would locally."""
        items, chosen = sft_inputs(trajectories, config)
        body = {"trajectories": [trajectory_to_wire(t) for t in items], "config": chosen.model_dump(mode="json"),
                "dev_config": None if _config is None else dict(_config), "verbose": verbose}
        return await self._stream_step(model, "train_sft", body, on_progress)

    async def _stream_step(self, model: TrainableModelRef, route: str, body: dict[str, Any],
                           on_progress: ProgressCallback | None) -> TrainResult:
        """POST one update to `route` and follow its NDJSON stream (events, progress) to the result."""
        what = f"{route} of {model.name!r}"
        timeout = httpx.Timeout(self.timeout, read=self.read_timeout)
        result: TrainResult | None = None
        try:
            async with self._client().stream("POST", f"/api/models/{model.name}/{route}", json=body,
                                             timeout=timeout) as response:
                if not response.is_success:
                    await response.aread()
                    self._check(response, what)
                async for line in bounded_lines(response.aiter_bytes(), MAX_STREAM_LINE):
                    result = self._on_stream_item(model, self._stream_item(line, what), on_progress) or result
        except httpx.TransportError as exc:
            raise self._lost(exc, what) from None
        except LineTooLongError as exc:  # httpx's aiter_lines buffered a line without end (+423 MB)
            raise RemoteBackendError(
                f"the {what} stream from {self.base_url} sent {exc} without ending it; stopped reading (an art-nb "
                "server's lines are a few KB). The step may go on there: `await model.get_step()` tells") from None
        if result is None:
            raise RemoteBackendError(
                f"the {route} stream from {self.base_url} ended without a result: the server may have stopped "
                "mid-step; re-run `await model.register(backend)` and continue from `await model.get_step()`")
        return result

    def _stream_item(self, line: bytes, what: str) -> dict[str, Any]:
        try:
            item = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            item = None
        if not isinstance(item, dict):
            raise RemoteBackendError(f"the {what} stream from {self.base_url} sent a line that is not a JSON "
                                     f"object: {self._redact(line[:200].decode(errors='replace'), 200)!r}")
        return item

    def _on_stream_item(self, model: TrainableModelRef, item: dict[str, Any],
                        on_progress: ProgressCallback | None) -> TrainResult | None:
        kind = item.get("type")
        if kind == "event":
            event = dict(item["event"])
            fields = {k: v for k, v in event.items() if k not in ("type", "time")}
            events.emit(str(event.get("type")), **{**fields, "remote": self.base_url})
        elif kind == "progress":
            progress = dict(item.get("progress") or {})
            events.emit("train_progress", model=model.name, remote=self.base_url, **progress)
            if on_progress is not None:
                on_progress(progress)
        elif kind == "error":
            raise RemoteTrainingError(
                f"training {model.name!r} failed on {self.base_url}: {item.get('error')}: "
                f"{self._redact(str(item.get('message')))}", str(item.get("error")))
        elif kind == "result":
            return TrainResult(step=int(item["step"]), metrics=dict(item.get("metrics") or {}))
        return None

    async def log(self, model: ModelRef, trajectories: Iterable[TrajectoryGroup | Trajectory], split: str = "val",
                  step: int | None = None, metrics: dict[str, float] | None = None) -> dict[str, float]:
        items = [{"group": group_to_wire(t)} if isinstance(t, TrajectoryGroup)
                 else {"trajectory": trajectory_to_wire(t)} for t in trajectories]
        reply = await self._call("POST", f"/api/models/{model.name}/log", f"log of {model.name!r}",
                                 json={"items": items, "split": split, "step": step, "metrics": metrics})
        summary = dict(reply["summary"])
        # The server's own event stays on the server; the dashboard here needs one too.
        events.emit("log", model=model.name, step=reply.get("step", step), split=split, metrics=summary,
                    remote=self.base_url)
        return summary

    async def delete_checkpoints(self, model: TrainableModelRef, steps: Iterable[int] | None = None,
                                 keep_last: int = 1, *, best_metric: str | None = None) -> list[int]:
        body = {"steps": None if steps is None else list(steps), "keep_last": keep_last, "best_metric": best_metric}
        reply = await self._call("POST", f"/api/models/{model.name}/checkpoints/delete", "delete_checkpoints",
                                 json=body)
        return [int(s) for s in reply["deleted"]]

    async def wait_for_checkpoint(self, model: TrainableModelRef) -> int:
        """The served step, once the server has finished writing its checkpoint (it answers when it has)."""
        return int((await self._checkpoints(model))["step"])

    def model_dir(self, model: ModelRef) -> Path:
        """Where this client keeps the model's files (downloaded checkpoints), in the store's layout."""
        return model_dir(self.path, model.project, model.name)

    async def list_checkpoints(self, model: TrainableModelRef) -> list[int]:
        """Steps with a checkpoint on the server, ascending."""
        return [int(s) for s in (await self._checkpoints(model))["steps"]]

    async def _checkpoints(self, model: TrainableModelRef) -> dict[str, Any]:
        return await self._call("GET", f"/api/models/{model.name}/checkpoints", "list of checkpoints")

    async def download_checkpoint(self, model: TrainableModelRef, step: int | None = None,
                                  dest: str | os.PathLike[str] | None = None, *,
                                  include_optimizer: bool = False) -> Path:
        """Copy a checkpoint's LoRA adapter (and optionally optimizer state) to this machine.

        Default destination: `{path}/{project}/models/{name}/checkpoints/{step:04d}`, the layout a
        `LocalBackend(path)` resumes from. Files are checked against the server's sha256 and
        appear all at once (written to a temporary directory, then renamed). Nothing here is
        replaced: a step this machine has already (or an existing `dest`) is a `FileExistsError`
        before anything is downloaded, and the default place is written as its model directory's
        one writer (`StoreLockedError` while a LocalBackend or another download holds it). A file
        is read up to the size the listing gave and no further.
        """
        step = await self.get_step(model) if step is None else step
        route = f"/api/models/{model.name}/checkpoints/{step}/files"
        listing = (await self._call("GET", route, f"download of step {step}"))["files"]
        wanted = {*ADAPTER_FILES, META_FILE, *((TRAINER_STATE,) if include_optimizer else ())}
        chosen = [self._listed(f, step) for f in listing if isinstance(f, dict) and f.get("name") in wanted]
        missing = sorted(set(ADAPTER_FILES) - {f["name"] for f in chosen})
        if missing:
            raise RemoteBackendError(f"checkpoint {step} of {model.name!r} on {self.base_url} lacks {missing}: "
                                     "it is not a complete adapter; download another step")
        store = None if dest is not None else ModelStore(self.path, model.project, model.name)
        if store is not None:
            store.acquire_writer()  # released below; no one else writes checkpoints there meanwhile
        try:
            self._refuse_existing(model, step, dest)
            staging = Path(tempfile.mkdtemp(prefix=".download-", dir=self._staging_root(model, dest)))
            try:
                for entry in chosen:
                    await self._download_file(f"{route}/{entry['name']}", staging / entry["name"], entry)
                return await asyncio.to_thread(self._place, model, step, staging, dest, store)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        finally:
            if store is not None:
                store.release_writer()

    def _listed(self, entry: dict[str, Any], step: int) -> dict[str, Any]:
        """A listing entry as the download relies on it: a size in bytes and a sha256."""
        size, digest = entry.get("size"), entry.get("sha256")
        if type(size) is not int or size < 0 or not isinstance(digest, str) or len(digest) != 64:
            raise RemoteBackendError(f"the listing of checkpoint {step} from {self.base_url} gives {entry['name']!r} "
                                     "no valid size and sha256: not an art-nb server's answer")
        return entry

    def _refuse_existing(self, model: TrainableModelRef, step: int, dest: str | os.PathLike[str] | None) -> None:
        if dest is not None:
            final = Path(dest).expanduser().resolve()
            if os.path.lexists(final):
                raise FileExistsError(f"{final} exists; choose another destination or remove it")
            return
        final = self.model_dir(model) / "checkpoints" / f"{step:04d}"
        if os.path.lexists(final):
            raise FileExistsError(
                f"checkpoint {step:04d} of {model.name!r} is already on this machine ({final}); a download never "
                "replaces one: pass dest=... to put the server's copy elsewhere, or delete this one first")

    def _staging_root(self, model: TrainableModelRef, dest: str | os.PathLike[str] | None) -> Path:
        root = Path(dest).expanduser().resolve().parent if dest is not None else self.path
        root.mkdir(parents=True, exist_ok=True)
        return root

    async def _download_file(self, route: str, target: Path, entry: dict[str, Any]) -> None:
        digest, received, name = hashlib.sha256(), 0, entry["name"]
        try:
            async with self._client().stream("GET", route) as response:
                if not response.is_success:
                    await response.aread()
                    self._check(response, f"download of {name}")
                with open(target, "wb") as handle:
                    async for chunk in response.aiter_bytes():
                        received += len(chunk)
                        if received > entry["size"]:
                            raise RemoteBackendError(
                                f"{name}: {self.base_url} sent more than the {entry['size']:,} bytes its listing "
                                "gave; stopped reading, nothing was kept. Retry; if it persists, the server's "
                                "checkpoint is changing or it is not an art-nb server")
                        handle.write(chunk)
                        digest.update(chunk)
        except httpx.TransportError as exc:
            raise self._lost(exc, f"download of {name}") from None
        if received != entry["size"] or digest.hexdigest() != entry["sha256"]:
            raise RemoteBackendError(f"{name} arrived corrupted ({received:,} of {entry['size']:,} bytes, sha256 "
                                     f"{'differs from' if received == entry['size'] else 'unchecked against'} the "
                                     "server's); retry")

    def _place(self, model: TrainableModelRef, step: int, staging: Path, dest: str | os.PathLike[str] | None,
               store: ModelStore | None) -> Path:
        self._refuse_existing(model, step, dest)
        if store is None:
            final = Path(str(dest)).expanduser().resolve()
            staging.rename(final)
            return final
        meta_path = staging / META_FILE
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        meta.pop("step", None)
        meta.pop("time", None)

        def write(directory: Path) -> None:
            for file in staging.iterdir():
                if file.name != META_FILE:
                    shutil.copy2(file, directory / file.name)

        return store.write_checkpoint(step, write, {**meta, "downloaded_from": self.base_url})

    def __call__(self) -> RemoteBackend:
        """The backend itself: ART code reaches it as `model.backend()`, art_nb code as `model.backend`."""
        return self

    async def close(self) -> None:
        """Close this event loop's HTTP client (the server keeps running)."""
        await self._clients.close()
