"""`art-nb serve` as a process: where the token comes from, and running the app of `serve_app`
(the routes, and everything they check) on a `LocalBackend` until SIGINT/SIGTERM.

The token, the one thing between the network and the GPU when the server is not bound to loopback,
is read from `--token-file PATH` or the environment variable `ART_NB_SERVE_TOKEN` (a Colab secret of
that name works too). `--token VALUE` still works, but every local user can read a command line in
the process list, so the CLI warns. Off loopback a token must have 16 characters at least; without
one, a strong one is generated and printed once. On loopback no token is needed: only this machine
can connect, and `RequestGuard` keeps web pages out (DNS rebinding, cross-site requests).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import stat
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from art_nb._version import __version__
from art_nb.secrets import Secret, find_secret
from art_nb.web import is_loopback

from .serve_app import ServedBackend, create_serve_app

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from art_nb.local import LocalBackend
    from art_nb.local.server import RunningServer

    from .serve_app import _Service

__all__ = ["MIN_TOKEN_CHARS", "TOKEN_ENV", "ServedBackend", "create_serve_app", "is_loopback", "serve"]

TOKEN_ENV = "ART_NB_SERVE_TOKEN"
MIN_TOKEN_CHARS = 16  # off loopback: guessing must be hopeless
GENERATE_TOKEN = 'python -c "import secrets; print(secrets.token_urlsafe(32))"'


def read_token_file(path: str | os.PathLike[str], warn: Callable[[str], None] | None = None) -> Secret:
    """The token in `path` (surrounding whitespace stripped); `warn` hears when others may read it."""
    try:
        text = Path(path).read_text()
        mode = Path(path).stat().st_mode
    except OSError as exc:
        raise ValueError(f"cannot read the token file {str(path)!r}: {exc.strerror}") from None
    if not text.strip():
        raise ValueError(f"the token file {str(path)!r} is empty: write the token into it, e.g. with "
                         f"{GENERATE_TOKEN} > {path}")
    if warn is not None and mode & (stat.S_IRWXG | stat.S_IRWXO):
        warn(f"art-nb serve: other users may read the token file {path}; restrict it with `chmod 600 {path}`")
    return Secret(text.strip(), f"token file {path}")


def _resolve_token(host: str, token: str | None, announce: Callable[[str], None], *,
                   token_file: str | os.PathLike[str] | None = None) -> Secret | None:
    """The server's token: `token_file`, else `token`, else $ART_NB_SERVE_TOKEN; generated off loopback."""
    secret = read_token_file(token_file, announce) if token_file is not None else None
    secret = secret or find_secret(token, name=TOKEN_ENV, required=False)
    if secret is None and not is_loopback(host):
        value = secrets.token_urlsafe(32)
        secret = Secret(value, "generated")
        # Shown once, on the operator's terminal: the only place it is ever printed.
        announce(f"art-nb serve: no token given; generated one (shown once): {value}")
    if secret is not None and not is_loopback(host) and len(secret.reveal()) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"the token from {secret.source} is too short for a server reachable from other machines ({host}): "
            f"use at least {MIN_TOKEN_CHARS} characters, e.g. generate one with {GENERATE_TOKEN}")
    return secret


def serve(host: str = "127.0.0.1", port: int = 8000, path: str | os.PathLike[str] = ".art",
          token: str | None = None, *, token_file: str | os.PathLike[str] | None = None,
          allowed_origins: Iterable[str] = (), allow_local_models: bool = False,
          announce: Callable[[str], None] = print) -> None:
    """Run the server until SIGINT/SIGTERM. The engine and the app share the backend's event loop.

    Raises ValueError (before anything starts) for a token that cannot be read or is too short.
    """
    from art_nb.local import LocalBackend
    from art_nb.local.plan.base_models import resolve_base_model
    from art_nb.local.server import start_server

    secret = _resolve_token(host, token, announce, token_file=token_file)
    backend: LocalBackend = LocalBackend(path)

    async def start() -> tuple[RunningServer, Starlette]:
        # On the backend's loop, next to the engine and its gate.
        app = create_serve_app(backend, token=secret, openai_app=await backend.openai_app(),
                               allowed_origins=allowed_origins, allow_local_models=allow_local_models,
                               resolve_model=resolve_base_model)
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
