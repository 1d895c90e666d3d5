"""The HTTP API of `art-nb serve`: the in-process backend, for a notebook on another machine.

One process owns the GPU: a `LocalBackend` (engine, trainer, checkpoints). This app exposes it
(`art_nb.remote.serve` runs it as a process):

    GET  /api/health                                   version, registered models
    POST /api/models                                   register {name, project, base_model, config}
    GET  /api/models/{name}/step                       the step served now
    POST /api/models/{name}/train                      {groups, config} -> NDJSON stream (see below)
    POST /api/models/{name}/train_sft                  {trajectories, config, dev_config, verbose} -> same
    POST /api/models/{name}/log                        {items, split, step, metrics} -> summary
    GET  /api/models/{name}/checkpoints                steps on disk
    POST /api/models/{name}/checkpoints/delete         {steps | null, keep_last, best_metric | null}
    GET  /api/models/{name}/checkpoints/{step}/files   [{name, size, sha256}]
    GET  /api/models/{name}/checkpoints/{step}/files/{file}
    /v1/models, /v1/chat/completions, /v1/responses,   the OpenAI endpoint, same engine, same gate
    /v1/completions                                    (docs/endpoint.md)

The train stream (`train_sft`'s is the same) is one JSON object per line: `accepted`, then
`event`s (the backend's `log`, `train_started`, `train_finished`, ... for this model) and
`progress`, a `heartbeat` every few seconds, and last a `result` or an `error`. The step runs to
the end even when the client goes away, so a client that lost its connection finds the new step
with `get_step` after re-registering.

Auth: with a token, every route (the OpenAI ones too) needs `Authorization: Bearer <token>`,
compared in constant time (a server bound to anything but loopback always has one; see
`art_nb.remote.serve`). `/api/*` requests must carry the client's version (major.minor equal).

Hardening, shared with the in-kernel endpoint through `art_nb.web` and `art_nb.local.server`: the Host,
Origin and Content-Type checks of `RequestGuard` (a web page cannot reach a loopback server by DNS
rebinding or a cross-site form; on 0.0.0.0 the token is what protects), bodies of at most 32 MB on
/api (8 MB on /v1) refused while they stream, JSON parsed off the event loop with a nesting limit,
the connection limits of `art_nb.local.server.connections`, and route bodies validated at the door
(`_http.RegisterBody` and friends, then each `config`): bad input is a 400 that names the field
and shows no server path. `base_model` must be a Hugging Face id unless the server runs with
`--allow-local-models`: a remote client must not be able to load, or probe for, files on this machine.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from art_nb import events
from art_nb._version import __version__
from art_nb.backend import Backend
from art_nb.config import ModelConfig, TrainConfig
from art_nb.local.server.schema import validation_error
from art_nb.model import TrainableModel
from art_nb.nofollow import StorePathError, open_servable, servable_files
from art_nb.pipelining import rollouts_run_beside
from art_nb.records import UnknownMetricError
from art_nb.secrets import Secret
from art_nb.sft_config import TrainSFTConfig
from art_nb.store import CheckpointError, ModelMismatchError, checkpoint_steps, checkpoints_dir, relative_text
from art_nb.types import ProgressCallback, TrainableModelRef, TrainResult
from art_nb.web import MB, ApiError, BearerAuth, RequestGuard, error_handlers, read_json

from ..wire import (
    VERSION_HEADER,
    DeleteBody,
    LogBody,
    RegisterBody,
    SFTBody,
    TrainBody,
    group_from_wire,
    trajectory_from_wire,
    version_mismatch,
)

__all__ = ["CHAT_MAX_BODY", "TRAIN_MAX_BODY", "ServedBackend", "check_base_model", "create_serve_app"]

HEARTBEAT_S = 5.0  # a train stream's line at least this often: far under every read timeout
TRAIN_MAX_BODY = 32 * MB
CHAT_MAX_BODY = 8 * MB
B = TypeVar("B", bound=BaseModel)
T = TypeVar("T")
_TOKEN_HINT = "send 'Authorization: Bearer <token>' (the token `art-nb serve` printed at start)"
_log = logging.getLogger("art_nb")


class ServedBackend(Backend, Protocol):
    """What the routes ask of the backend beyond `Backend`: where a step's checkpoint files are."""

    def checkpoint_dir(self, model: TrainableModelRef, step: int | None = None) -> Path: ...


class _RequireVersion:
    """On /api/*, the client's version header must agree with ours on major.minor (the wire format
    may change between minor releases); /v1/* is OpenAI's format and needs none."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/api/"):
            client = dict(scope["headers"]).get(VERSION_HEADER.lower().encode(), b"").decode("latin-1")
            problem = (f"send the {VERSION_HEADER} header (RemoteBackend does)" if not client
                       else version_mismatch(client, __version__))
            if problem:
                await ApiError(409, problem, "version_mismatch").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _file_entry(path: Path, within: Path) -> dict[str, Any]:
    digest, size = hashlib.sha256(), 0
    with open_servable(path.parent, path.name, within) as handle:  # never through a link
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    return {"name": path.name, "size": size, "sha256": digest.hexdigest()}


def _line(item: dict[str, Any]) -> bytes:
    return (json.dumps(item, default=str) + "\n").encode()


async def _body(request: Request, schema: type[B]) -> B:
    """The JSON body (`{}` when empty) validated against `schema`: a 400 naming each bad field."""
    body = await read_json(request, empty={})
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _validated(schema: type[B], data: dict[str, Any] | None, field: str = "") -> B:
    """A body's `config` as `schema` (defaults when absent): a 400 naming each bad field (under `field`)."""
    try:
        return schema.model_validate(data or {})
    except ValidationError as exc:
        raise validation_error(exc, field) from None


def _wire_error(field: str, exc: Exception) -> ApiError:
    return ApiError(400, f"{field}: not trajectories or groups as RemoteBackend sends them: {exc}", param=field)


class _Service:
    """The route handlers, over a `ServedBackend`; models are known by name once registered here."""

    def __init__(self, backend: ServedBackend, *, allow_local_models: bool,
                 resolve_model: Callable[[str], object] | None) -> None:
        self.backend = backend
        self.models: dict[str, TrainableModel] = {}
        self.running: set[asyncio.Task[Any]] = set()  # train tasks outlive their requests
        self.train_locks: dict[tuple[str, str], asyncio.Lock] = {}  # one step at a time per model
        self.allow_local_models = allow_local_models
        self.resolve_model = resolve_model

    def _shown(self, model: TrainableModel, error: BaseException) -> str:
        """An error's text as a client sees it: paths relative to the model's directory, never the server's."""
        return relative_text(str(error), self.backend.model_dir(model))

    def model(self, request: Request) -> TrainableModel:
        name = request.path_params["name"]
        model = self.models.get(name)
        if model is None:
            raise ApiError(404, f"model {name!r} is not registered on this server (it may have restarted): "
                                "re-run `await model.register(backend)`", "model_not_registered")
        return model

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"server": "art-nb", "version": __version__, "models": sorted(self.models)})

    async def register(self, request: Request) -> JSONResponse:
        """All the client sent is checked (the config's bounds too) before anything is resolved or loaded;
        409 only for a conflict with what exists (name taken, damaged checkpoint), any other bad value 400."""
        body = await _body(request, RegisterBody)
        config = _validated(ModelConfig, body.config, "config")
        try:
            model = TrainableModel(name=body.name, project=body.project, base_model=body.base_model, config=config)
        except ValidationError as exc:
            raise validation_error(exc) from None
        await check_base_model(body.base_model, self.allow_local_models, self.resolve_model)
        known = self.models.get(model.name)
        if known is not None and known.project != model.project:  # routes address models by name
            raise ApiError(409, f"a model named {model.name!r} is registered here for project {known.project!r}; "
                                "this server addresses models by name: pick another name", "conflict")
        try:
            await self.backend.register(model)
        except ModelMismatchError as exc:  # the name is taken by another base model or config
            raise ApiError(409, self._shown(model, exc), "conflict") from exc
        except CheckpointError as exc:  # the newest checkpoint cannot be resumed; the message says the way back
            raise ApiError(409, self._shown(model, exc), "checkpoint_damaged") from exc
        except ValueError as exc:  # a value the backend cannot use here (the config's own bounds hold already)
            raise ApiError(400, self._shown(model, exc), param="config") from exc
        self.models[model.name] = model
        return JSONResponse({"step": await self.backend.get_step(model), "choices": self.backend.choices(model)})

    async def step(self, request: Request) -> JSONResponse:
        return JSONResponse({"step": await self.backend.get_step(self.model(request))})

    async def train(self, request: Request) -> StreamingResponse:
        model = self.model(request)
        body = await _body(request, TrainBody)
        config = _validated(TrainConfig, body.config)
        try:  # a step's groups can be tens of MB: decoded off the event loop
            groups = await asyncio.to_thread(lambda: [group_from_wire(g) for g in body.groups])
        except (ValidationError, ValueError, TypeError, AttributeError) as exc:
            raise _wire_error("groups", exc) from None
        async def train(on_progress: ProgressCallback) -> TrainResult:
            with rollouts_run_beside(body.beside):  # the client's pipeline gathers meanwhile
                return await self.backend.train(model, groups, config, on_progress=on_progress)

        return self._stream_step(model, "train", {"groups": len(groups)}, train)

    async def train_sft(self, request: Request) -> StreamingResponse:
        """`train_sft` over the same stream as `train` (and in turn with it: one update of a model at a
        time). The schedule's length is checked here, so a mismatch is a 400 before anything is
        recorded or paused, not an error from the trainer's thread."""
        model = self.model(request)
        body = await _body(request, SFTBody)
        config = _validated(TrainSFTConfig, body.config)
        try:
            trajectories = await asyncio.to_thread(lambda: [trajectory_from_wire(t) for t in body.trajectories])
        except (ValidationError, ValueError, TypeError, AttributeError) as exc:
            raise _wire_error("trajectories", exc) from None
        if trajectories:  # an empty call trains nothing (and checks nothing) on LocalBackend either
            try:
                config.schedule(len(trajectories))
            except ValueError as exc:
                raise ApiError(400, str(exc), param="learning_rate") from None  # the message names it
        return self._stream_step(model, "SFT", {"trajectories": len(trajectories)}, lambda on_progress: (
            self.backend.train_sft(model, trajectories, config, body.dev_config, body.verbose,
                                   on_progress=on_progress)))

    def _stream_step(self, model: TrainableModel, what: str, accepted: dict[str, Any],
                     run: Callable[[ProgressCallback], Awaitable[TrainResult]]) -> StreamingResponse:
        """Run one update (`run(on_progress)`) as a task that outlives the request, and stream it as
        NDJSON: `accepted`, this model's events, `progress`, heartbeats, then `result` or `error`."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        def put(item: dict[str, Any]) -> None:  # on_progress and events come from the trainer's thread too
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def forward(event: dict[str, Any]) -> None:
            # "remote" marks a client's echo of a server event (client and server in one process)
            if event.get("model") == model.name and "remote" not in event:
                if isinstance(event.get("checkpoint"), str):  # relative to the model's directory, as everywhere
                    event = {**event, "checkpoint": relative_text(event["checkpoint"], self.backend.model_dir(model))}
                put({"type": "event", "event": event})

        lock = self.train_locks.setdefault((model.project, model.name), asyncio.Lock())

        async def run_in_turn() -> TrainResult:
            # Updates of one model run one after another; "accepted" names the step this one starts
            # from, read once the updates before it are done (two concurrent trains both said 0).
            async with lock:
                put({"type": "accepted", "step": await self.backend.get_step(model), **accepted})
                return await run(lambda p: put({"type": "progress", "progress": p}))

        unsubscribe = events.subscribe(forward)
        task = asyncio.ensure_future(run_in_turn())
        self.running.add(task)

        def finished(done: asyncio.Task[Any]) -> None:
            self.running.discard(done)
            unsubscribe()
            queue.put_nowait(None)

        task.add_done_callback(finished)

        async def stream() -> AsyncIterator[bytes]:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    yield _line({"type": "heartbeat"})
                    continue
                if item is None:
                    break
                yield _line(item)
            error = task.exception() if not task.cancelled() else asyncio.CancelledError(f"{what} was cancelled")
            if error is not None:
                _log.error("%s of %s failed: %s: %s", what, model.name, type(error).__name__, error)
                yield _line({"type": "error", "error": type(error).__name__, "message": self._shown(model, error)})
            else:
                result = task.result()
                yield _line({"type": "result", "step": result.step, "metrics": result.metrics})

        return StreamingResponse(stream(), media_type="application/x-ndjson")

    async def log(self, request: Request) -> JSONResponse:
        model = self.model(request)
        body = await _body(request, LogBody)

        def decode() -> list[Any]:
            return [group_from_wire(i["group"]) if "group" in i else trajectory_from_wire(i["trajectory"])
                    for i in body.items]

        try:
            items = await asyncio.to_thread(decode)
        except (ValidationError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _wire_error("items", exc) from None
        step = await self.backend.get_step(model) if body.step is None else body.step
        summary = await self.backend.log(model, items, split=body.split, step=step, metrics=body.metrics)
        return JSONResponse({"summary": summary, "step": step})

    def _steps(self, model: TrainableModel) -> list[int]:
        return checkpoint_steps(checkpoints_dir(self.backend.model_dir(model)))

    async def checkpoints(self, request: Request) -> JSONResponse:
        model = self.model(request)
        step = await self.backend.wait_for_checkpoint(model)  # the newest step's files are complete
        return JSONResponse({"steps": self._steps(model), "step": step})

    async def delete(self, request: Request) -> JSONResponse:
        model = self.model(request)
        body = await _body(request, DeleteBody)
        try:
            deleted = await self.backend.delete_checkpoints(model, body.steps, keep_last=body.keep_last,
                                                            best_metric=body.best_metric)
        except UnknownMetricError as exc:  # a typo must not delete the best step: nothing was deleted
            raise ApiError(400, str(exc), "unknown_metric", param="best_metric") from None
        return JSONResponse({"deleted": deleted})

    async def _checkpoint(self, request: Request) -> tuple[Path, Path]:
        """The directory of the requested checkpoint, and the model directory it must stay inside."""
        model = self.model(request)
        await self.backend.wait_for_checkpoint(model)
        step = int(request.path_params["step"])
        if step not in self._steps(model):
            raise ApiError(404, f"model {model.name!r} has no checkpoint {step}", "checkpoint_not_found")
        return self.backend.checkpoint_dir(model, step), self.backend.model_dir(model)

    async def files(self, request: Request) -> JSONResponse:
        directory, within = await self._checkpoint(request)

        def entries() -> list[dict[str, Any]]:  # no link, nothing outside the model directory
            return [_file_entry(p, within) for p in servable_files(directory, within)]

        return JSONResponse({"files": await _servable(entries)})

    async def file(self, request: Request) -> Response:
        directory, within = await self._checkpoint(request)
        handle = await _servable(lambda: open_servable(directory, request.path_params["file"], within))
        size = os.fstat(handle.fileno()).st_size

        async def chunks() -> AsyncIterator[bytes]:
            with handle:  # at most the size announced, even if the file grows meanwhile
                left = size
                while left > 0 and (chunk := await asyncio.to_thread(handle.read, min(left, 1 << 20))):
                    left -= len(chunk)
                    yield chunk

        return StreamingResponse(chunks(), media_type="application/octet-stream", headers={"content-length": str(size)})


async def _servable(read: Callable[[], T]) -> T:
    """`read()` off the loop; a file not handed out (a link, a file with other names) is a 404 as if absent."""
    try:
        return await asyncio.to_thread(read)
    except FileNotFoundError as exc:
        raise ApiError(404, f"checkpoint has no file {str(exc)[:200]!r}", "file_not_found") from None
    except StorePathError as exc:
        _log.warning("not served: %s", exc)
        raise ApiError(404, f"not served: {exc}", "file_not_found") from None


def _looks_like_path(name: str) -> bool:
    """A filesystem path rather than a hub id (`name` or `org/name`), judged from the text alone."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name or name[1:3] == ":/"


async def check_base_model(base_model: str, allow_local: bool, resolve: Callable[[str], object] | None) -> None:
    """Refuse, with a 400, a base model a remote client must not or cannot load here.

    Without `allow_local`, paths are refused by their text alone (the same answer whether they
    exist or not: no probing the disk), and an id-shaped name that is also a local folder gets the
    same answer as an id nobody knows. `resolve` (the server's model resolution) finds ids that
    cannot be loaded before the backend tries; its reason goes to the server's log, not the client.
    """
    if not allow_local and _looks_like_path(base_model):
        raise ApiError(400, "base_model looks like a filesystem path; this server loads Hugging Face model ids "
                            "(org/name) for remote clients. To load local directories, start it with "
                            "`art-nb serve --allow-local-models`", "local_model_refused", param="base_model")
    shown = "base_model" if _looks_like_path(base_model) else f"base_model {base_model!r}"
    unloadable = ApiError(400, f"{shown} cannot be loaded here: use a Hugging Face model id this server has cached "
                               "or can download (local directories need `art-nb serve --allow-local-models`); "
                               "the server's log says what was tried", "model_not_found", param="base_model")
    if not allow_local and await asyncio.to_thread(Path(base_model).exists):
        raise unloadable
    if resolve is not None:
        try:
            await asyncio.to_thread(resolve, base_model)
        except Exception as exc:  # noqa: BLE001 - any failure to resolve is the same answer to the client
            _log.warning("register: base model %r cannot be loaded: %s: %s", base_model, type(exc).__name__, exc)
            raise unloadable from None


def create_serve_app(
    backend: ServedBackend, *, token: Secret | None, openai_app: ASGIApp | None = None,
    allowed_origins: Iterable[str] = (), allow_local_models: bool = False,
    resolve_model: Callable[[str], object] | None = None, max_train_body: int = TRAIN_MAX_BODY,
    max_chat_body: int = CHAT_MAX_BODY, body_timeout: float = 120.0,
) -> Starlette:
    """The ASGI app over `backend` (a LocalBackend, or another `ServedBackend`).

    `openai_app` is mounted at the root for /v1/*; `token` None means no auth (loopback only).
    `allowed_origins`: browser origins let in cross-site; `allow_local_models`: let clients name
    local directories as base_model; `resolve_model`: checks a base model can be loaded before
    the backend tries (`art-nb serve` passes `art_nb.local.plan.base_models.resolve_base_model`).
    """
    service = _Service(backend, allow_local_models=allow_local_models, resolve_model=resolve_model)
    routes: list[Any] = [
        Route("/api/health", service.health, methods=["GET"]),
        Route("/api/models", service.register, methods=["POST"]),
        Route("/api/models/{name}/step", service.step, methods=["GET"]),
        Route("/api/models/{name}/train", service.train, methods=["POST"]),
        Route("/api/models/{name}/train_sft", service.train_sft, methods=["POST"]),
        Route("/api/models/{name}/log", service.log, methods=["POST"]),
        Route("/api/models/{name}/checkpoints", service.checkpoints, methods=["GET"]),
        Route("/api/models/{name}/checkpoints/delete", service.delete, methods=["POST"]),
        Route("/api/models/{name}/checkpoints/{step:int}/files", service.files, methods=["GET"]),
        Route("/api/models/{name}/checkpoints/{step:int}/files/{file}", service.file, methods=["GET"]),
    ]
    if openai_app is not None:
        routes.append(Mount("/", app=openai_app))
    # Outermost first: the browser guard, then the token before anything else, so a stranger
    # learns nothing, not even versions.
    guard = Middleware(RequestGuard, allowed_origins=allowed_origins, max_body=max_train_body,
                       max_body_for={"/v1/": max_chat_body}, body_timeout=body_timeout)
    auth = Middleware(BearerAuth, key=token, hint=_TOKEN_HINT)
    app = Starlette(routes=routes, middleware=[guard, auth, Middleware(_RequireVersion)],
                    exception_handlers=error_handlers())
    app.state.service = service
    return app
