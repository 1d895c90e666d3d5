"""`InferenceGate`: the backend's pause/resume for inference, so a train step has the accelerator
to itself.

The OpenAI app wraps each request's engine work in `serving()`; the backend calls `pause()` before
a step and `resume()` after. Requests that arrive while paused wait (they never fail), and
`pause()` returns once the requests already inside the engine have drained. Use from one event
loop (the backend's).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["InferenceGate"]


class InferenceGate:
    """Pause/resume for inference: while paused, new requests wait inside `serving()` until `resume()`."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def wait_serving(self) -> None:
        """Return when the gate is open."""
        # Loop: a pause() between set() and this waiter running must keep it waiting.
        while not self._open.is_set():
            await self._open.wait()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        await self.wait_serving()
        self._in_flight += 1  # no await since the check above, so a pause cannot slip in between
        self._drained.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()

    async def pause(self) -> None:
        """Stop admitting requests and wait until those in flight have finished."""
        self._open.clear()
        await self._drained.wait()

    def resume(self) -> None:
        self._open.set()
