"""`art-nb serve` as a process: where the token comes from, and running the app of `serve_app`
(the routes, and everything they check) on a `LocalBackend` until SIGINT/SIGTERM.

The token, the one thing between the GPU and the network or the other accounts of this machine, is
read from `--token-file PATH` or the environment variable `ART_NB_SERVE_TOKEN` (a Colab secret of
that name works too), never from the command line (every local user can read it in
/proc/<pid>/cmdline; the CLI refuses `--token`). Without one, a strong one is generated, printed
once and saved where `RemoteBackend` on this machine finds it (`art_nb.remote.tokens`); `--no-token`
turns auth off, on loopback only (`RequestGuard` still keeps web pages out: DNS rebinding,
cross-site requests). Off loopback a token must have 16 characters at least.
"""

from __future__ import annotations

import asyncio
import os
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
from .tokens import generate_token, load_token, save_token

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


def _resolve_token(host: str, token: str | Secret | None, announce: Callable[[str], None], *,
                   token_file: str | os.PathLike[str] | None = None, no_token: bool = False,
                   port: int = 0) -> Secret | None:
    """The server's token: `token_file`, else `token` (Python callers), else $ART_NB_SERVE_TOKEN, else
    the one saved for `port` by an earlier start, else a new one (source "generated": `serve` saves
    and prints it once bound). None only with `no_token`, which loopback alone may have."""
    secret = read_token_file(token_file, announce) if token_file is not None else None
    secret = secret or find_secret(token, name=TOKEN_ENV, required=False)
    if no_token:
        if not is_loopback(host):
            raise ValueError(f"--no-token is for loopback only: bound to {host}, anyone who can reach this machine "
                             "could download, delete and train; drop --no-token (a token is generated)")
        if secret is not None:
            raise ValueError(f"--no-token contradicts the token from {secret.source}: drop one of them")
        return None
    secret = secret or (load_token(port) if port else None) or generate_token()
    if not is_loopback(host) and len(secret.reveal()) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"the token from {secret.source} is too short for a server reachable from other machines ({host}): "
            f"use at least {MIN_TOKEN_CHARS} characters, e.g. generate one with {GENERATE_TOKEN}")
    return secret


def serve(host: str = "127.0.0.1", port: int = 8000, path: str | os.PathLike[str] = ".art",
          token: str | Secret | None = None, *, token_file: str | os.PathLike[str] | None = None,
          no_token: bool = False, allowed_origins: Iterable[str] = (), allow_local_models: bool = False,
          announce: Callable[[str], None] = print) -> None:
    """Run the server until SIGINT/SIGTERM. The engine and the app share the backend's event loop.

    Raises ValueError (before anything starts) for a token that cannot be read or is too short, or
    `no_token` off loopback.
    """
    secret = _resolve_token(host, token, announce, token_file=token_file, no_token=no_token, port=port)

    from art_nb.local import LocalBackend
    from art_nb.local.plan.base_models import resolve_base_model
    from art_nb.local.server import start_server

    backend: LocalBackend = LocalBackend(path)

    async def start() -> tuple[RunningServer, Starlette]:
        # On the backend's loop, next to the engine and its gate.
        app = create_serve_app(backend, token=secret, openai_app=await backend.openai_app(),
                               allowed_origins=allowed_origins, allow_local_models=allow_local_models,
                               resolve_model=resolve_base_model)
        return await start_server(app, host=host, port=port), app

    server, app = backend.loop.run_sync(start())
    if secret is not None and secret.source == "generated":
        _announce_generated(secret, server.port, announce)
    auth = f"token from {secret.source}" if secret else "no auth (--no-token, loopback only)"
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


def _announce_generated(secret: Secret, port: int, announce: Callable[[str], None]) -> None:
    """Save a generated token for `port` and show it: once, on the operator's terminal, the only place
    it is ever printed."""
    try:
        saved = save_token(secret, port)
        where = f"saved to {saved} (only you can read it), where RemoteBackend on this machine finds it"
    except OSError as exc:
        where = f"not saved ({exc.strerror}): pass it to RemoteBackend yourself"
    announce(f"art-nb serve: no token given; generated one (shown once): {secret.reveal()}\n  {where}; "
             f"another machine passes it as RemoteBackend(..., api_key=...) or $ART_NB_API_KEY; "
             "`--no-token` turns auth off (loopback only)")


async def _drain(backend: LocalBackend, server: RunningServer, service: _Service) -> None:
    if service.running:  # a step that was started finishes and is checkpointed
        await asyncio.gather(*service.running, return_exceptions=True)
    await server.stop()
    await backend.close()
