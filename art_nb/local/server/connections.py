"""How long a connection may stay open, and how many may: the part of slow-client defence that only
the connection, not the ASGI app, can see.

uvicorn's HTTP/1.1 protocol has no timeout while it waits for a request's head (a client that
connects and says nothing, or trickles its headers a byte at a time, holds a file descriptor
forever) and one keep-alive for everybody. With a 1,024-file limit, 1,100 idle sockets from anyone
who can connect locked the token holder out. `GuardedH11Protocol` adds, per `ConnectionLimits`:

- a **head timeout**: the request line and headers must arrive within `header_timeout` seconds of
  the connection opening (or of the first byte of the next request on a kept-alive one);
- **keep-alive by trust**: a connection that showed the key (`web.TRUSTED`, set by `BearerAuth`)
  is kept `keep_alive` seconds, long enough for rollout clients' pooled connections to sit out a
  train step; one whose request was refused at the door (no key, a foreign Host, ...) is closed
  `stranger_keep_alive` seconds after its answer;
- a **connection cap**: over `max_connections`, a new connection evicts the oldest one that is idle
  and has never shown the key, so strangers' sockets cannot crowd out the token holder; when none
  can be evicted, the newcomer is answered 503 and closed at once, before it holds a descriptor.

Body read time and size are the ASGI guard's (`art_nb.web.RequestGuard`): it knows the route.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from art_nb.web import TRUSTED

__all__ = ["ConnectionLimits", "GuardedH11Protocol", "default_max_connections"]

_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s")
_REFUSED_BODY = (b'{"error": {"message": "too many open connections to this server; retry shortly", '
                 b'"type": "server_error", "param": null, "code": "too_many_connections"}}')


def default_max_connections() -> int:
    """Half the process's file-descriptor limit (the engine, the model files and the notebook need
    the rest), between 64 and 4,096."""
    try:
        import resource  # POSIX only
    except ImportError:
        return 512
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(64, min(4096, soft // 2))


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-connection limits; see the module docstring. `max_connections=None`: from the fd limit."""

    max_connections: int | None = None
    header_timeout: float = 10.0
    keep_alive: float = 3600.0
    stranger_keep_alive: float = 1.0
    max_header_bytes: int = 32 * 1024

    def protocol(self) -> Any:
        """The protocol factory for `uvicorn.Config(http=...)`."""
        cap = self.max_connections or default_max_connections()
        return functools.partial(GuardedH11Protocol, limits=self, cap=cap)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the head timeout, keep-alive by trust and the connection cap."""

    def __init__(self, *args: Any, limits: ConnectionLimits, cap: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits, self.cap = limits, cap
        self.trusted = False
        self.opened = 0.0
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self.opened = self.loop.time()
        if len(self.connections) > self.cap and not self._evict_a_stranger():
            self.transport.write(_REFUSED % (len(_REFUSED_BODY), _REFUSED_BODY))
            self.transport.close()
            self.connections.discard(self)
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # A complete head moves the peer out of IDLE; until then the head timer runs (it is armed
        # again here because uvicorn cancels its keep-alive timer on any byte of a new request).
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self._head_timer is None and self.timeout_keep_alive_task is None:
                self._arm_head_timer()
        else:
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        # True: the request showed the key; False: refused at the door; None: an app without our
        # auth (a test's fake server), which keeps the long keep-alive it always had.
        verdict = self.scope.get(TRUSTED) if self.scope is not None else None  # type: ignore[misc]
        self.trusted = self.trusted or verdict is True
        stranger = verdict is False and not self.trusted
        self.timeout_keep_alive = self.limits.stranger_keep_alive if stranger else self.limits.keep_alive
        super().on_response_complete()

    # ---- internals ------------------------------------------------------------------------------

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _evict_a_stranger(self) -> bool:
        """Close the oldest idle connection that never showed the key; False when there is none."""
        strangers = [c for c in self.connections
                     if isinstance(c, GuardedH11Protocol) and c is not self and not c.trusted and c._idle()]
        if not strangers:
            return False
        oldest = min(strangers, key=lambda c: c.opened)
        oldest.transport.close()
        self.connections.discard(oldest)
        return True

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()
