"""The server side of art_nb's HTTP, in one place: the in-kernel OpenAI endpoint (`art_nb.local.server`)
and `art-nb serve` (`art_nb.remote.serve`) answer errors, check keys, guard against browsers and
read bodies through these pieces, so the two servers cannot drift apart.

- `ApiError`: raise it in a route; the handlers from `error_handlers()` answer it in OpenAI's error
  shape, `{"error": {"message", "type", "param", "code"}}`, which the `openai` client parses into
  its exceptions and `RemoteBackend` reads the same way.
- `RequestGuard`: ASGI middleware, outermost, for what a web browser could do to a server on this
  machine (DNS rebinding, cross-site requests) and for body size and read time (see its docstring).
- `BearerAuth`: ASGI middleware requiring `Authorization: Bearer <key>`, compared in constant time.
  It marks a request that passed (`TRUSTED` in the scope; False when refused here or by the
  guard), which the connection policy of `art_nb.local.server.connections` reads: that client's
  connection stays open through a train step, a refused one is closed soon after its answer.
- `read_json(request)`: the body as JSON, parsed off the event loop when large, with a nesting
  limit, and every way it can be malformed answered with a 400 rather than a 500.
- `is_loopback(host)`: the one rule for "only this machine can connect" (127.0.0.0/8, ::1,
  "localhost"); a server bound anywhere else must have a key.

Starlette is imported only when a response is built, so `is_loopback` works on a base install.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import re
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .secrets import Secret

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "BIND_HOST",
    "MAX_JSON_DEPTH",
    "MB",
    "TRUSTED",
    "ApiError",
    "BearerAuth",
    "RequestGuard",
    "error_handlers",
    "is_loopback",
    "parse_json",
    "read_json",
]

MB = 1 << 20
MAX_JSON_DEPTH = 64  # a trajectory on the wire nests ~15 deep, a tool's JSON schema rarely 20
TRUSTED = "art_nb.trusted"  # scope key: True once auth passed, False when refused at the door
BIND_HOST = "art_nb.bind_host"  # scope key: the address the server was bound to (set by start_server)
_GUARDED = "art_nb.guarded"  # scope key: an outer RequestGuard already checked this request
_THREADED_JSON_BYTES = 256 * 1024  # larger bodies are parsed in a worker thread
_LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


class ApiError(Exception):
    """An HTTP error with a message that says how to fix the request.

    `type` follows from the status as in OpenAI's API (5xx: "server_error", else
    "invalid_request_error"). `retry` sets `x-should-retry`: OpenAI clients retry 5xx answers
    unless told not to, and retrying a dead engine only delays the error. `close` ends the
    connection after the answer: the rest of a refused body is not worth reading.
    """

    def __init__(
        self, status: int, message: str, code: str | None = None, *, param: str | None = None,
        retry: bool | None = None, close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.retry = status, message, code, param, retry
        self.close = close

    @property
    def type(self) -> str:
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def response(self) -> JSONResponse:
        from starlette.responses import JSONResponse

        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        headers = {} if self.retry is None else {"x-should-retry": "true" if self.retry else "false"}
        if self.close:
            headers["connection"] = "close"
        return JSONResponse({"error": error}, status_code=self.status, headers=headers or None)


# An absolute path of two parts or more, as an exception message may carry one.
_PATH = re.compile(r"(?<![\w:/])(?:~|/)(?:[^\s/'\"]+/)+[^\s'\",)]*")


def error_handlers() -> dict[Any, Any]:
    """Starlette `exception_handlers` that answer every failure as an `ApiError`: raised ones as
    they are, routing errors (404, 405) with the method and path, anything else as a 500 naming
    the exception with filesystem paths masked (Starlette still re-raises it afterwards, so the
    full traceback reaches the server's log; the client needs the kind of failure, not our layout)."""
    from starlette.exceptions import HTTPException

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        detail = _PATH.sub("<path>", str(exc))
        return ApiError(500, f"internal error: {type(exc).__name__}: {detail}", "server_error").response()

    return {ApiError: api_error, HTTPException: http_error, Exception: unexpected}


class BearerAuth:
    """Require `Authorization: Bearer <key>` on every HTTP request; the key is compared in constant
    time and never appears in an answer. `hint` ends the 401's message (where to find the key).
    With `key=None` (a loopback server without auth) every request passes. Each request is marked
    `TRUSTED` (True or False) in its scope."""

    def __init__(self, app: ASGIApp, key: Secret | str | None,
                 hint: str = "send 'Authorization: Bearer <key>'") -> None:
        self.app = app
        self._key = key if key is None or isinstance(key, Secret) else Secret(key)
        self._hint = hint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self._key is not None:
                given = dict(scope["headers"]).get(b"authorization", b"")
                scheme, _, presented = given.partition(b" ")
                if scheme != b"Bearer" or not self._key.matches(presented):
                    scope[TRUSTED] = False
                    error = ApiError(401, f"invalid or missing API key: {self._hint}", "invalid_api_key")
                    await error.response()(scope, receive, send)
                    return
            scope[TRUSTED] = True
        await self.app(scope, receive, send)


@functools.lru_cache(maxsize=64)  # asked for every request's bound address: parse it once
def is_loopback(host: str) -> bool:
    """Whether only this machine can reach a server bound to `host` (no key needed there)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class RequestGuard:
    """What a web page must not be able to do to a server on this machine, and limits on bodies.

    In order, before auth and routing:

    1. **Host.** A page on evil.example can rebind its name to 127.0.0.1 and then talk to a loopback
       server as a same-origin site. Its requests still say `Host: evil.example`, so a server bound
       to loopback answers only Host names it is known by (localhost, 127.0.0.1, [::1], the bound
       address). Any port goes with them: an SSH tunnel (`ssh -L 9000:localhost:8000`) sends its
       own local port, and a browser cannot put a loopback name in Host for another site. A server
       bound to 0.0.0.0 or a public address cannot know every name clients use for it: there the
       key (always required off loopback) is the protection.
    2. **Origin.** A browser marks cross-site requests (`Origin`, `Sec-Fetch-Site`); they are refused
       unless their origin is in `allowed_origins` (say a JupyterLab on another port), which also
       get CORS answers, preflights included.
    3. **JSON only.** A POST must say `Content-Type: application/json` (415 otherwise): a page can
       send `text/plain` cross-site without a preflight, never `application/json`.
    4. **Body.** At most `max_body` bytes (`max_body_for` maps path prefixes to their own limits),
       enforced while the body streams in: a declared length over the limit is refused before a
       byte of it is read, a stream is cut when it passes the limit (413). The whole body must
       arrive within `body_timeout` seconds of the request's head (408): a client cannot hold a
       request open by trickling its body.

    Nested apps (the OpenAI app mounted in `art-nb serve`) are checked once, by the outermost guard.
    """

    def __init__(self, app: ASGIApp, *, allowed_origins: Iterable[str] = (), max_body: int = 8 * MB,
                 max_body_for: Mapping[str, int] | None = None, body_timeout: float = 120.0) -> None:
        self.app = app
        self.allowed_origins = frozenset(o.rstrip("/") for o in allowed_origins)
        self.max_body = max_body
        self.max_body_for = dict(max_body_for or {})
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get(_GUARDED):
            await self.app(scope, receive, send)
            return
        scope[_GUARDED] = True
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        origin = headers.get("origin")
        allowed = origin is not None and origin.rstrip("/") in self.allowed_origins
        problem = _host_problem(scope, headers.get("host")) or (None if allowed else _origin_problem(scope, headers))
        if problem is None and allowed and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await _preflight(origin or "")(scope, receive, send)
            return
        if problem is None and scope["method"] == "POST":
            problem = _json_problem(headers.get("content-type"))
        limit = self._limit(scope["path"])
        if problem is None and _declared_length(headers) > limit:
            problem = _too_large(limit)
        if problem is not None:
            scope[TRUSTED] = False
            await problem.response()(scope, receive, send)
            return
        if allowed:
            send = _with_cors(send, origin or "")
        await self.app(scope, _bounded(receive, limit, self.body_timeout), send)

    def _limit(self, path: str) -> int:
        prefixes = [p for p in self.max_body_for if path.startswith(p)]
        return self.max_body_for[max(prefixes, key=len)] if prefixes else self.max_body


def _host_problem(scope: Scope, host: str | None) -> ApiError | None:
    server = scope.get("server") or ("", None)
    bound = str(scope.get(BIND_HOST) or server[0] or "")
    if host is None or not is_loopback(bound):  # no Host (HTTP/1.0: no browser), or off loopback: the key
        return None
    if _host_name(host) in _LOCAL_NAMES | {bound.strip("[]").lower()}:
        return None
    own_port = server[1] or 80  # an ASGI test transport leaves the default port out
    return ApiError(
        403, f"this server answers only to its own address (Host {host[:100]!r} is not it): connect to "
             f"http://127.0.0.1:{own_port} or http://localhost:{own_port}. A web page reaching it under another "
             "name (DNS rebinding) is refused on purpose", "host_not_allowed", close=True)


def _host_name(host: str) -> str:
    """The name in a Host header: 'localhost:8000' -> 'localhost', '[::1]:8000' -> '::1'."""
    if host.startswith("["):
        return host[1 : host.find("]")].lower() if "]" in host else host.lower()
    return (host.rpartition(":")[0] if host.count(":") == 1 else host).lower()


def _origin_problem(scope: Scope, headers: dict[str, str]) -> ApiError | None:
    origin, site = headers.get("origin"), headers.get("sec-fetch-site")
    own = f"{scope.get('scheme', 'http')}://{headers.get('host', '')}".lower()
    if (origin is None or origin.lower() == own) and site not in ("cross-site", "same-site"):
        return None
    return ApiError(
        403, f"cross-origin browser requests are refused (Origin {str(origin)[:100]!r}); to allow a page such as a "
             "JupyterLab on another port, start the server with its origin in allowed_origins "
             "(`art-nb serve --allowed-origin http://host:port`)", "cross_origin", close=True)


def _json_problem(content_type: str | None) -> ApiError | None:
    if content_type is not None and content_type.split(";")[0].strip().lower() == "application/json":
        return None
    return ApiError(415, f"POST bodies must be JSON sent with 'Content-Type: application/json' (got "
                         f"{str(content_type)[:100]!r})", "unsupported_media_type", close=True)


def _declared_length(headers: dict[str, str]) -> int:
    try:
        return int(headers.get("content-length", "0"))
    except ValueError:
        return 0  # the HTTP parser refuses a malformed length before we see it


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over this route's limit of {limit / MB:g} MB: send less at once "
                         "(e.g. fewer groups per train call)", "body_too_large", close=True)


def _bounded(receive: Receive, limit: int, timeout: float) -> Receive:
    """`receive`, raising 413 once more than `limit` body bytes arrived and 408 once the body took
    longer than `timeout` seconds; after the body, messages (a disconnect) pass untouched."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    received, done = 0, False

    async def bounded() -> Message:
        nonlocal received, done
        if done:
            return await receive()
        try:
            message = await _receive_by(receive, deadline)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {timeout:g} s", "body_timeout",
                           close=True) from None
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise _too_large(limit)
            done = not message.get("more_body", False)
        else:
            done = True
        return message

    return bounded


async def _receive_by(receive: Receive, deadline: float) -> Message:
    """`receive()`, or asyncio.TimeoutError at loop time `deadline`. On 3.11+ without the task
    `wait_for` wraps every call in (most of this guard's cost per request, on the event loop)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout_at(deadline):
            return await receive()
    return await asyncio.wait_for(receive(), max(deadline - asyncio.get_running_loop().time(), 0.0))


def _preflight(origin: str) -> Any:
    from starlette.responses import Response

    return Response(status_code=200, headers={
        "access-control-allow-origin": origin, "vary": "Origin", "access-control-max-age": "600",
        "access-control-allow-methods": "GET, POST",
        "access-control-allow-headers": "authorization, content-type, x-art-nb-version",
    })


def _with_cors(send: Send, origin: str) -> Send:
    async def cors(message: Message) -> None:
        if message["type"] == "http.response.start":
            extra = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return cors


async def read_json(request: Request, *, empty: Any = None) -> Any:
    """The request body as JSON (`empty` when there is none); a large body is parsed in a worker
    thread, so a 30 MB train request does not stall every other client. See `parse_json`."""
    body = await request.body()
    if not body and empty is not None:
        return empty
    if len(body) > _THREADED_JSON_BYTES:
        return await asyncio.to_thread(parse_json, body)
    return parse_json(body)


def parse_json(body: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """JSON, or a 400 saying what is wrong: not JSON, nested more than `max_depth` deep (Python's
    parser would raise RecursionError past ~1,000, and deep values break whatever walks them
    later), or a number too long for Python to convert (over 4,300 digits: ValueError)."""
    try:
        value = json.loads(body)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except ValueError as exc:  # int("1" * 5000): Python limits integer digits
        raise ApiError(400, f"a number in the request body has too many digits ({exc}); send it as a string") from None
    if _deeper_than(value, max_depth):
        raise _too_deep(max_depth)
    return value


def _too_deep(limit: int) -> ApiError:
    return ApiError(400, f"the request body is nested too deeply: at most {limit} levels of objects and arrays")


def _deeper_than(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False
