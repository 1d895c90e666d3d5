"""The server side of art_nb's HTTP, in one place: the in-kernel OpenAI endpoint (`art_nb.server`)
and `art-nb serve` (`art_nb.backends.serve`) answer errors, check keys and decide which hosts may
go without a key through these pieces, so the two servers cannot drift apart.

- `ApiError`: raise it in a route; the handlers from `error_handlers()` answer it in OpenAI's error
  shape, `{"error": {"message", "type", "param", "code"}}`, which the `openai` client parses into
  its exceptions and `RemoteBackend` reads the same way.
- `BearerAuth`: ASGI middleware requiring `Authorization: Bearer <key>`, compared in constant time.
- `is_loopback(host)`: the one rule for "only this machine can connect" (127.0.0.0/8, ::1,
  "localhost"); a server bound anywhere else must have a key.

Starlette is imported only when a response is built, so `is_loopback` works on a base install.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Any

from .secrets import Secret

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["ApiError", "BearerAuth", "error_handlers", "is_loopback"]


class ApiError(Exception):
    """An HTTP error with a message that says how to fix the request.

    `type` follows from the status as in OpenAI's API (5xx: "server_error", else
    "invalid_request_error"). `retry` sets `x-should-retry`: OpenAI clients retry 5xx answers
    unless told not to, and retrying a dead engine only delays the error.
    """

    def __init__(
        self, status: int, message: str, code: str | None = None, *, param: str | None = None,
        retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.retry = status, message, code, param, retry

    @property
    def type(self) -> str:
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def response(self) -> JSONResponse:
        from starlette.responses import JSONResponse

        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        headers = None if self.retry is None else {"x-should-retry": "true" if self.retry else "false"}
        return JSONResponse({"error": error}, status_code=self.status, headers=headers)


def error_handlers() -> dict[Any, Any]:
    """Starlette `exception_handlers` that answer every failure as an `ApiError`: raised ones as
    they are, routing errors (404, 405) with the method and path, anything else as a 500 naming
    the exception (Starlette still re-raises it afterwards, so the traceback reaches the log)."""
    from starlette.exceptions import HTTPException

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()

    return {ApiError: api_error, HTTPException: http_error, Exception: unexpected}


class BearerAuth:
    """Require `Authorization: Bearer <key>` on every HTTP request; the key is compared in constant
    time and never appears in an answer. `hint` ends the 401's message (where to find the key)."""

    def __init__(self, app: ASGIApp, key: Secret | str, hint: str = "send 'Authorization: Bearer <key>'") -> None:
        self.app = app
        self._key = key if isinstance(key, Secret) else Secret(key)
        self._hint = hint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, presented = given.partition(b" ")
            if scheme != b"Bearer" or not self._key.matches(presented):
                error = ApiError(401, f"invalid or missing API key: {self._hint}", "invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach a server bound to `host` (no key needed there)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
