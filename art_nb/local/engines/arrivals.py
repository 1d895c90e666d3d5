"""Requests on their way to an engine: taken in by the endpoint, not yet handed to the engine.

An engine that gathers the requests of a burst into one step (engines/vllm/thread.py) waits while any
are on their way. Time between two requests reaching the engine says little: the endpoint takes in a
rollout group's requests one after another, and hands them over in a clump once it has rendered them,
with pauses of 10-20 ms in between on a 2-core machine. The endpoint knows how many it holds.

One count per process: the endpoint and its engines share it (a request bound for another engine only
makes a gathering one wait, at most its cap).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar

__all__ = ["ARRIVALS", "Arrivals", "arrived"]


class Arrivals:
    """How many requests are on their way; `coming()` counts one until it arrives or ends."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return self._count

    @contextlib.contextmanager
    def coming(self) -> Iterator[Callable[[], None]]:
        """Count a request until `arrived()` is called in its context (or the block ends)."""
        with self._lock:
            self._count += 1
        done = False

        def arrive() -> None:
            nonlocal done
            if not done:
                done = True
                with self._lock:
                    self._count -= 1

        token = _ARRIVE.set(arrive)
        try:
            yield arrive
        finally:
            _ARRIVE.reset(token)
            arrive()


ARRIVALS = Arrivals()
_ARRIVE: ContextVar[Callable[[], None] | None] = ContextVar("art_nb_arrive", default=None)


def arrived() -> None:
    """The request of this context reaches its engine now (the endpoint calls it just before submitting)."""
    arrive = _ARRIVE.get()
    if arrive is not None:
        arrive()
