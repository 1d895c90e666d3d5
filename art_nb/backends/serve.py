"""`art-nb serve`: the in-process backend behind an HTTP API, for a notebook on another machine.

One process owns the GPU: a `LocalBackend` (engine, trainer, checkpoints). This app exposes it:

    GET  /api/health                                   version, registered models
    POST /api/models                                   register {name, project, base_model, config}
    GET  /api/models/{name}/step                       the step served now
    POST /api/models/{name}/train                      {groups, config} -> NDJSON stream (see below)
    POST /api/models/{name}/log                        {items, split, step, metrics} -> summary
    GET  /api/models/{name}/checkpoints                steps on disk
    POST /api/models/{name}/checkpoints/delete         {steps | null, keep_last}
    GET  /api/models/{name}/checkpoints/{step}/files   [{name, size, sha256}]
    GET  /api/models/{name}/checkpoints/{step}/files/{file}
    /v1/models, /v1/chat/completions                   the OpenAI endpoint, same engine, same gate

The train stream is one JSON object per line: `accepted`, then `event`s (the backend's `log`,
`train_started`, `train_finished`, ... for this model) and `progress`, a `heartbeat` every few
seconds, and last a `result` or an `error`. The step runs to the end even when the client goes
away, so a client that lost its connection finds the new step with `get_step` after re-registering.

Auth: with a token, every route (the OpenAI ones too) needs `Authorization: Bearer <token>`,
compared in constant time; a server bound to anything but loopback always has one (generated and
printed once when not given). `/api/*` requests must carry the client's version (major.minor equal).
Errors, auth and the loopback rule are the in-kernel endpoint's own (`art_nb.web`), so both answer
in one shape.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import signal
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import events
from .._version import __version__
from ..config import ModelConfig, TrainConfig
from ..model import TrainableModel
from ..secrets import Secret, find_secret
from ..store import checkpoint_steps
from ..types import TrainableModelRef
from ..web import ApiError, BearerAuth, error_handlers, is_loopback
from ._http import VERSION_HEADER, group_from_wire, trajectory_from_wire, version_mismatch
from .base import Backend

if TYPE_CHECKING:
    from ..server import RunningServer
    from .local import LocalBackend

__all__ = ["TOKEN_ENV", "ServedBackend", "create_serve_app", "is_loopback", "serve"]

TOKEN_ENV = "ART_NB_SERVE_TOKEN"
HEARTBEAT_S = 5.0
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


def _file_entry(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return {"name": path.name, "size": path.stat().st_size, "sha256": digest.hexdigest()}


def _line(item: dict[str, Any]) -> bytes:
    return (json.dumps(item, default=str) + "\n").encode()


class _Service:
    """The route handlers, over a `ServedBackend`; models are known by name once registered here."""

    def __init__(self, backend: ServedBackend) -> None:
        self.backend = backend
        self.models: dict[str, TrainableModel] = {}
        self.running: set[asyncio.Task[Any]] = set()  # train tasks outlive their requests

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
        body = await _json(request)
        try:
            model = TrainableModel(name=body.get("name"), project=body.get("project", "default"),
                                   base_model=body.get("base_model"),
                                   config=ModelConfig.model_validate(body.get("config") or {}))
        except ValidationError as exc:
            raise ApiError(400, f"invalid model: {exc}") from exc
        try:
            await self.backend.register(model)
        except ValueError as exc:  # same name, different base model or config
            raise ApiError(409, str(exc), "conflict") from exc
        self.models[model.name] = model
        return JSONResponse({"step": await self.backend.get_step(model), "choices": self.backend.choices(model)})

    async def step(self, request: Request) -> JSONResponse:
        return JSONResponse({"step": await self.backend.get_step(self.model(request))})

    async def train(self, request: Request) -> StreamingResponse:
        model = self.model(request)
        body = await _json(request)
        try:
            groups = [group_from_wire(g) for g in body.get("groups") or []]
            config = TrainConfig.model_validate(body.get("config") or {})
        except (ValidationError, ValueError, TypeError) as exc:
            raise ApiError(400, f"invalid train request: {exc}") from exc
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        def put(item: dict[str, Any]) -> None:  # on_progress and events come from the trainer's thread too
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def forward(event: dict[str, Any]) -> None:
            # "remote" marks a client's echo of a server event (client and server in one process)
            if event.get("model") == model.name and "remote" not in event:
                put({"type": "event", "event": event})

        start_step = await self.backend.get_step(model)
        unsubscribe = events.subscribe(forward)
        task = asyncio.ensure_future(
            self.backend.train(model, groups, config, on_progress=lambda p: put({"type": "progress", "progress": p})))
        self.running.add(task)

        def finished(done: asyncio.Task[Any]) -> None:
            self.running.discard(done)
            unsubscribe()
            queue.put_nowait(None)

        task.add_done_callback(finished)

        async def stream() -> AsyncIterator[bytes]:
            yield _line({"type": "accepted", "step": start_step, "groups": len(groups)})
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    yield _line({"type": "heartbeat"})
                    continue
                if item is None:
                    break
                yield _line(item)
            error = task.exception() if not task.cancelled() else asyncio.CancelledError("train was cancelled")
            if error is not None:
                _log.error("train of %s failed: %s: %s", model.name, type(error).__name__, error)
                yield _line({"type": "error", "error": type(error).__name__, "message": str(error)})
            else:
                result = task.result()
                yield _line({"type": "result", "step": result.step, "metrics": result.metrics})

        return StreamingResponse(stream(), media_type="application/x-ndjson")

    async def log(self, request: Request) -> JSONResponse:
        model = self.model(request)
        body = await _json(request)
        try:
            items = [group_from_wire(i["group"]) if "group" in i else trajectory_from_wire(i["trajectory"])
                     for i in body.get("items") or []]
        except (ValidationError, ValueError, KeyError, TypeError) as exc:
            raise ApiError(400, f"invalid log request: {exc}") from exc
        step = body.get("step")
        step = await self.backend.get_step(model) if step is None else int(step)
        summary = await self.backend.log(model, items, split=body.get("split", "val"), step=step,
                                         metrics=body.get("metrics"))
        return JSONResponse({"summary": summary, "step": step})

    def _steps(self, model: TrainableModel) -> list[int]:
        return checkpoint_steps(self.backend.model_dir(model) / "checkpoints")

    async def checkpoints(self, request: Request) -> JSONResponse:
        model = self.model(request)
        step = await self.backend.wait_for_checkpoint(model)  # the newest step's files are complete
        return JSONResponse({"steps": self._steps(model), "step": step})

    async def delete(self, request: Request) -> JSONResponse:
        model = self.model(request)
        body = await _json(request)
        steps = body.get("steps")
        deleted = await self.backend.delete_checkpoints(model, steps, keep_last=int(body.get("keep_last", 1)))
        return JSONResponse({"deleted": deleted})

    async def _checkpoint(self, request: Request) -> Path:
        model = self.model(request)
        await self.backend.wait_for_checkpoint(model)
        step = int(request.path_params["step"])
        if step not in self._steps(model):
            raise ApiError(404, f"model {model.name!r} has no checkpoint {step}", "checkpoint_not_found")
        return self.backend.checkpoint_dir(model, step)

    async def files(self, request: Request) -> JSONResponse:
        directory = await self._checkpoint(request)
        paths = sorted(p for p in directory.iterdir() if p.is_file())
        return JSONResponse({"files": await asyncio.to_thread(lambda: [_file_entry(p) for p in paths])})

    async def file(self, request: Request) -> Response:
        directory = await self._checkpoint(request)
        name = request.path_params["file"]
        # Only names listed in the directory: nothing outside it can be asked for.
        if name not in {p.name for p in directory.iterdir() if p.is_file()}:
            raise ApiError(404, f"checkpoint has no file {name!r}", "file_not_found")
        return FileResponse(directory / name, media_type="application/octet-stream")


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def create_serve_app(backend: ServedBackend, *, token: Secret | None, openai_app: ASGIApp | None = None) -> Starlette:
    """The ASGI app over `backend` (a LocalBackend, or another `ServedBackend`).

    `openai_app` is mounted at the root for /v1/*; `token` None means no auth (loopback only).
    """
    service = _Service(backend)
    routes: list[Any] = [
        Route("/api/health", service.health, methods=["GET"]),
        Route("/api/models", service.register, methods=["POST"]),
        Route("/api/models/{name}/step", service.step, methods=["GET"]),
        Route("/api/models/{name}/train", service.train, methods=["POST"]),
        Route("/api/models/{name}/log", service.log, methods=["POST"]),
        Route("/api/models/{name}/checkpoints", service.checkpoints, methods=["GET"]),
        Route("/api/models/{name}/checkpoints/delete", service.delete, methods=["POST"]),
        Route("/api/models/{name}/checkpoints/{step:int}/files", service.files, methods=["GET"]),
        Route("/api/models/{name}/checkpoints/{step:int}/files/{file}", service.file, methods=["GET"]),
    ]
    if openai_app is not None:
        routes.append(Mount("/", app=openai_app))
    # Outermost first: the token before anything else, so a stranger learns nothing, not even versions.
    auth = [Middleware(BearerAuth, key=token, hint=_TOKEN_HINT)] if token is not None else []
    app = Starlette(routes=routes, middleware=[*auth, Middleware(_RequireVersion)],
                    exception_handlers=error_handlers())
    app.state.service = service
    return app


def _resolve_token(host: str, token: str | None, announce: Callable[[str], None]) -> Secret | None:
    secret = find_secret(token, name=TOKEN_ENV, required=False)
    if secret is None and not is_loopback(host):
        value = secrets.token_urlsafe(32)
        secret = Secret(value, "generated")
        # Shown once, on the operator's terminal: the only place it is ever printed.
        announce(f"art-nb serve: no token given; generated one (shown once): {value}")
    return secret


def serve(host: str = "127.0.0.1", port: int = 8000, path: str | os.PathLike[str] = ".art",
          token: str | None = None, *, announce: Callable[[str], None] = print) -> None:
    """Run the server until SIGINT/SIGTERM. The engine and the app share the backend's event loop."""
    from ..server import start_server
    from .local import LocalBackend

    secret = _resolve_token(host, token, announce)
    backend: LocalBackend = LocalBackend(path)

    async def start() -> tuple[RunningServer, Starlette]:
        # On the backend's loop, next to the engine and its gate.
        app = create_serve_app(backend, token=secret, openai_app=await backend.openai_app())
        return await start_server(app, host=host, port=port), app

    server, app = backend.loop.run_sync(start())
    auth = f"token from {secret.source}" if secret else "no auth (loopback only)"
    announce(f"art-nb serve {__version__}: listening on http://{host}:{server.port} "
             f"(OpenAI endpoint at /v1; checkpoints under {backend.path}; {auth})")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        announce("art-nb serve: stopping (a step in progress is finished first)")
        backend.loop.run_sync(_drain(backend, server, app.state.service), timeout=3600)


async def _drain(backend: LocalBackend, server: RunningServer, service: _Service) -> None:
    if service.running:  # a step that was started finishes and is checkpointed
        await asyncio.gather(*service.running, return_exceptions=True)
    await server.stop()
    await backend.close()
