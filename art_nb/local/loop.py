"""A private event loop in a daemon thread: where the engine, server and trainer live.

Why not the caller's loop: `asyncio.run` in a script makes a new loop per call and closes it
afterwards, which would kill an engine and server that should outlive the call; a notebook's loop
only runs while a cell awaits. Living on our own loop, the engine keeps serving across cells and
across `asyncio.run` calls, and user code crosses over with one `await`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["BackgroundLoop"]

T = TypeVar("T")


class BackgroundLoop:
    def __init__(self, name: str = "art_nb-backend") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def is_current(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the background loop from any loop.

        Cancelling the caller (an interrupted cell) cancels the work there too, and returns only
        once that work has settled: when the caller sees its `CancelledError`, the backend is in a
        consistent state (a train step abandoned or finished, never half-way), so the next cell
        finds it ready.
        """
        if self.is_current():
            return await coro
        outcome: concurrent.futures.Future[T] = concurrent.futures.Future()
        started: concurrent.futures.Future[asyncio.Task[T]] = concurrent.futures.Future()

        def start() -> None:
            task = self.loop.create_task(coro)
            task.add_done_callback(lambda done: _copy_outcome(done, outcome))
            started.set_result(task)

        self.loop.call_soon_threadsafe(start)
        waiter = asyncio.wrap_future(outcome)
        try:
            return await asyncio.shield(waiter)
        except asyncio.CancelledError:
            task = await asyncio.wrap_future(started)
            self.loop.call_soon_threadsafe(task.cancel)
            with contextlib.suppress(Exception, asyncio.CancelledError):  # only waiting for it to settle
                await waiter
            raise

    def stop(self) -> None:
        """End the loop and its thread (after the backend closed): a closed backend leaves no threads,
        and the default executor's threads, each with its own malloc arena, go with them. Called on the
        loop itself (`art-nb serve` closing while it drains, the process about to end), it does nothing:
        a thread cannot join itself, and stopping here would strand the caller waiting on it."""
        if self.is_current() or not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.loop.shutdown_default_executor(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        if not self._thread.is_alive():
            self.loop.close()

    def run_sync(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Blocking variant for synchronous callers (CLI, atexit)."""
        if self.is_current():
            raise RuntimeError("run_sync called from the backend loop itself")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


def _copy_outcome(task: asyncio.Task[T], outcome: concurrent.futures.Future[T]) -> None:
    if task.cancelled():
        outcome.cancel()
    elif task.exception() is not None:
        outcome.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        outcome.set_result(task.result())
