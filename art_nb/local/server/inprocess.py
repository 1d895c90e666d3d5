"""The endpoint called without a socket: `model.openai_client()` talks to the app in this process.

Why: a rollout's request and its response cross the same process twice over HTTP (client and server
share the notebook's CPU and its GIL with vLLM's thread). Measured on this project's 2-core box
(`bench/endpoint_per_request.py --transport http`, then `inprocess`), the socket, the two HTTP/1.1
parsers and httpx's connection pool took a third of the CPU a plain request costs the process
(17-42% by call and concurrency): going to the app directly saves that.

What stays the same: the request is the OpenAI client's own (its body, headers and bearer key), the
app is the one the server runs (same checks, same gate; the Host header is the server's address),
and responses stream as they are sent (`stream=True` chunks arrive as the app sends them). A client
that leaves (its task cancelled, a stream closed early) is seen by the app as a disconnect, as over
HTTP. Other clients (any HTTP client, another process) use the socket as before.

The app runs on the server's event loop (the backend's thread); the caller may be on another loop
(the notebook's): the call crosses with `run_coroutine_threadsafe`, the response's parts come back
through a queue on the caller's loop.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.types import ASGIApp, Message

__all__ = ["in_process_http_client"]

_CLIENT_ADDRESS = ("127.0.0.1", 0)  # a loopback caller, as over the socket


def in_process_http_client(app: ASGIApp, loop: asyncio.AbstractEventLoop, server: tuple[str, int], **kwargs: Any) -> Any:
    """An httpx `AsyncClient` of the module the installed openai uses (httpx, or httpx2 from openai 3),
    whose requests run `app` on `loop` without a socket. `kwargs` go to openai's default client (timeout...)."""
    import openai

    httpx = _httpx_of_openai()
    return openai.DefaultAsyncHttpxClient(transport=_transport_class(httpx)(app, loop, server), **kwargs)


def _httpx_of_openai() -> Any:
    """openai < 3 builds on httpx, openai 3 on its fork httpx2: its http_client must be of that module."""
    import openai

    for cls in openai.DefaultAsyncHttpxClient.__mro__:
        root = cls.__module__.split(".")[0]
        if cls.__name__ == "AsyncClient" and root in ("httpx", "httpx2"):
            return importlib.import_module(root)
    return importlib.import_module("httpx")


_CLASSES: dict[str, type] = {}


def _transport_class(httpx: Any) -> type:
    """The transport, subclassing that module's base classes (its client checks the response type)."""
    if httpx.__name__ in _CLASSES:
        return _CLASSES[httpx.__name__]

    class Body(httpx.AsyncByteStream):  # type: ignore[misc,name-defined]
        def __init__(self, parts: AsyncIterator[bytes], leave: Callable[[], None]) -> None:
            self._parts, self._leave = parts, leave

        async def __aiter__(self) -> AsyncIterator[bytes]:
            async for part in self._parts:
                yield part

        async def aclose(self) -> None:
            self._leave()

    class InProcessTransport(httpx.AsyncBaseTransport):  # type: ignore[misc,name-defined]
        def __init__(self, app: ASGIApp, loop: asyncio.AbstractEventLoop, server: tuple[str, int]) -> None:
            self._app, self._loop, self._server = app, loop, server

        async def handle_async_request(self, request: Any) -> Any:
            body = await request.aread()
            call = _Call(self._app, self._loop, asyncio.get_running_loop(), _scope(request, self._server), body)
            timeout = (request.extensions.get("timeout") or {}).get("read")
            try:
                status, headers = await call.started(timeout)
            except asyncio.TimeoutError:
                call.leave()
                raise httpx.ReadTimeout("no response from the in-process endpoint in time", request=request) from None
            except BaseException:
                call.leave()
                raise
            if isinstance(status, BaseException):
                raise httpx.RemoteProtocolError(f"the endpoint failed: {status!r}", request=request) from status
            return httpx.Response(status, headers=headers, stream=Body(call.body(timeout, httpx, request), call.leave),
                                  request=request)

    _CLASSES[httpx.__name__] = InProcessTransport
    return InProcessTransport


def _scope(request: Any, server: tuple[str, int]) -> dict[str, Any]:
    url = request.url
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method, "scheme": url.scheme, "path": url.path,
        "raw_path": url.raw_path.split(b"?", 1)[0], "query_string": url.query, "root_path": "",
        "headers": [(name.lower(), value) for name, value in request.headers.raw],
        "client": _CLIENT_ADDRESS, "server": server, "extensions": {},
    }


class _Call:
    """One request: the app runs on the server's loop; start, body parts and the end come back through
    a queue on the caller's loop."""

    def __init__(self, app: ASGIApp, loop: asyncio.AbstractEventLoop, caller: asyncio.AbstractEventLoop,
                 scope: dict[str, Any], body: bytes) -> None:
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._caller, self._server_loop = caller, loop
        self._left: asyncio.Event | None = None  # made on the server's loop
        self._gone = False
        self._run = asyncio.run_coroutine_threadsafe(self._serve(app, scope, body), loop) if loop is not caller \
            else asyncio.ensure_future(self._serve(app, scope, body))

    def _put(self, item: tuple[str, Any]) -> None:
        if self._server_loop is self._caller:
            self._queue.put_nowait(item)
        elif not self._caller.is_closed():  # a caller whose loop has ended reads nothing more
            try:
                self._caller.call_soon_threadsafe(self._queue.put_nowait, item)
            except RuntimeError:  # closed between the check and the call
                pass

    async def _serve(self, app: ASGIApp, scope: dict[str, Any], body: bytes) -> None:
        self._left = asyncio.Event()
        if self._gone:
            self._left.set()
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            assert self._left is not None
            await self._left.wait()
            return {"type": "http.disconnect"}

        ended = False

        async def send(message: Message) -> None:
            nonlocal ended
            if message["type"] == "http.response.start":
                self._put(("start", (message["status"], message.get("headers", []))))
            elif message["type"] == "http.response.body" and not ended:
                # Each message is a hop to the caller's loop: the last part carries the end with it.
                ended = not message.get("more_body", False)
                self._put(("last" if ended else "part", message.get("body", b"")))

        try:
            await app(scope, receive, send)
        except BaseException as exc:  # reaches the caller as a failed response, not a hung one
            if not ended:
                ended = True
                self._put(("error", exc))
            if not isinstance(exc, Exception):
                raise
        finally:
            if not ended:  # an app that returned without finishing its response
                self._put(("error", RuntimeError("the endpoint ended without finishing its response")))

    async def started(self, timeout: float | None) -> tuple[Any, Any]:
        kind, value = await asyncio.wait_for(self._queue.get(), timeout)
        if kind == "start":
            return value
        return value, None  # "error": the app failed before it started a response

    async def body(self, timeout: float | None, httpx: Any, request: Any) -> AsyncIterator[bytes]:
        while True:
            try:
                kind, value = await asyncio.wait_for(self._queue.get(), timeout)
            except asyncio.TimeoutError:
                self.leave()
                raise httpx.ReadTimeout("the in-process endpoint stopped sending", request=request) from None
            if kind in ("part", "last") and value:
                yield value
            if kind == "error":
                raise httpx.RemoteProtocolError(f"the endpoint failed mid-response: {value!r}", request=request)
            if kind != "part":
                return

    def leave(self) -> None:
        """The caller is gone (cancelled, or closed the response early): the app sees a disconnect."""
        if self._gone:
            return
        self._gone = True

        def disconnect() -> None:
            if self._left is not None:
                self._left.set()

        if self._server_loop is self._caller:
            disconnect()
        elif not self._server_loop.is_closed():
            self._server_loop.call_soon_threadsafe(disconnect)
