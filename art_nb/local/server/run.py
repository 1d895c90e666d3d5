"""Serving an ASGI app with uvicorn as a task on the running event loop, inside a notebook kernel.

The server shares the loop of whoever starts it (the backend's), so the app's handlers and the
engine they call need no thread hand-offs; it leaves signal handlers and logging configuration
alone, because in a kernel those belong to the user. Connections follow `ConnectionLimits` (head
timeout, keep-alive by trust, a cap; see `connections`), and each request's scope carries the
address the server was bound to, which `art_nb.web.RequestGuard` checks Host headers against.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from art_nb.web import BIND_HOST

from .connections import ConnectionLimits

__all__ = ["RunningServer", "start_server"]


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signal handlers alone: in a notebook kernel, Ctrl-C/interrupt
    belongs to the user's cell, not to the endpoint."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


class RunningServer:
    """A server started by `start_server`. `base_url` ends in /v1, ready for `AsyncOpenAI(base_url=...)`."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None], host: str, port: int, app: ASGIApp) -> None:
        self._server, self._task = server, task
        self.port = port
        self.base_url = f"http://{host}:{port}/v1"
        self._app, self._loop, self._address = app, task.get_loop(), (host, port)

    def in_process_http_client(self, **kwargs: Any) -> Any:
        """An httpx client for openai that calls this server's app without a socket (inprocess.py says why)."""
        from .inprocess import in_process_http_client

        return in_process_http_client(self._app, self._loop, self._address, **kwargs)

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, let open requests finish (up to `timeout` s), then close. Idempotent."""
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            await self._task


def _bound_to(app: ASGIApp, host: str) -> ASGIApp:
    async def bound(scope: Scope, receive: Receive, send: Send) -> None:
        scope[BIND_HOST] = host
        await app(scope, receive, send)

    return bound


async def start_server(
    app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *, startup_timeout: float = 10.0,
    limits: ConnectionLimits | None = None,
) -> RunningServer:
    """Serve `app` with uvicorn as a task on the running event loop; return once it accepts connections.

    `port=0` picks a free port: the socket is bound here, so the port is known before uvicorn runs
    and no other process can take it in between. `limits` default: `ConnectionLimits()`.
    """
    limits = limits or ConnectionLimits()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio only sets TCP_NODELAY on sockets whose proto says TCP, and without
    # it every small response waits ~40 ms for Nagle + delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    # log_config=None: do not reconfigure the user's logging; lifespan off: the app has none.
    bound = _bound_to(app, host)
    config = uvicorn.Config(
        bound, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=5,
        # Keep-alive is set per connection by the protocol: long for clients that showed the key
        # (rollout clients sit idle on pooled connections while a step trains; closing them under
        # the clients would fail their next request), short for everyone else.
        http=limits.protocol(), timeout_keep_alive=int(limits.keep_alive),
        h11_max_incomplete_event_size=limits.max_header_bytes,
        # No proxy in front: X-Forwarded-* from any local process must not rewrite client or scheme.
        proxy_headers=False,
    )
    server = _QuietServer(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # raises what stopped it
            raise RuntimeError("the server exited during startup")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"the server did not start within {startup_timeout} s")
        await asyncio.sleep(0.01)
    return RunningServer(server, task, host, port, bound)
