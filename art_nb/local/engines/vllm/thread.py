"""The vLLM thread: the one caller vLLM ever sees, and the owner of the step loop.

vLLM's in-process `LLMEngine` is synchronous and not thread-safe, so every call into it (build,
add_request, step, abort, LoRA, sleep/wake, shutdown) runs on this one thread, in submission order.
The thread steps the engine itself for as long as requests are unfinished: an asyncio driver that
awaited each `step()` across threads cost ~0.4 ms of gap per step on an H200, 5-10% of a CUDA-graph
decode step of a 3B model at batch 8; looping here costs ~0.004 ms.

- Calls are queued (`call`, `add`, `abort`) and run between two steps, in submission order, so a
  request that arrives mid-batch joins the running batch at the next step.
- Finished outputs go back in one `call_soon_threadsafe` per event loop per step (each waiter
  belongs to the loop that asked; the backend's loop and a benchmark's may both be asking).
- With nothing unfinished the thread blocks on its queue: no spin, no polling.
- Requests join as they come, not gathered into one step: a step that admits requests runs its prefill
  outside the decode CUDA graphs (53-132 ms for a 3B model on an H200 against 3-12 ms for a decode step),
  yet holding a burst's adds until it was complete took every wave in with one such step and gained no
  wall time, in the endpoint's waves or in a pipelined GRPO step (bench/results/h200/README.md).
- A `when_idle` call (sleep) waits, with everything queued after it, until no request is unfinished.
- `step()` raising leaves vLLM in an unknown state: `died(exc)` is told, every waiter fails with
  `dead()`'s error, and no step runs again. Requests queued later fail the same way.

The GIL: the endpoint, the notebook's client and this thread share one interpreter. A decode step
with CUDA graphs is a few ms of GPU work between short Python stretches, and every torch call that
waits for the GPU releases the GIL; taking it back, this thread waits until the holder is asked to
drop it, which CPython does after `sys.getswitchinterval()` (5 ms by default). Under a burst of
requests that wait is longer than the step itself (on the H200, 3B, batch 256: the endpoint ran at
0.53x plain vLLM). So while a vLLM thread steps, the interval is at most `SWITCH_INTERVAL_S`
(ART_NB_SWITCH_INTERVAL_MS overrides; 0 leaves Python's), restored when no thread steps. Not while it
idles: then the endpoint's and the client's threads take in a burst, and forced hand-overs every 0.5 ms
between those two made 64 requests take 380 ms to reach the engine instead of 240 ms (2-core CPU).

The GPU: the thread issues vLLM's work on the device's default stream, or on one of its own where
ART_NB_VLLM_STREAM asks (stream.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .stream import EngineStream

__all__ = ["VLLMThread"]

_log = logging.getLogger("art_nb")
_T = TypeVar("_T")

_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


@dataclass
class _Call:
    fn: Callable[[], Any]
    done: Future[Any] | None = None  # None: nobody waits (an abort); a failure is logged
    when_idle: bool = False


@dataclass
class _Add:
    request_id: str
    add: Callable[[], Any]
    waiter: _Waiter


@dataclass
class _Abort:
    request_id: str
    abort: Callable[[list[str]], Any]


_STOP = object()

SWITCH_INTERVAL_S = 0.0005  # a toy model of a step (3 ms GPU + 0.4 ms Python) with two busy threads: 12.2 ms at 5 ms, 5.2 ms here
_SWITCH_ENV = "ART_NB_SWITCH_INTERVAL_MS"
_switch_lock = threading.Lock()
_switch_users = 0
_switch_before: float | None = None


def _wanted_switch_interval() -> float:
    """The interval while vLLM decodes (seconds; 0: Python's own)."""
    raw = os.environ.get(_SWITCH_ENV, "").strip()
    return float(raw) / 1000 if raw else SWITCH_INTERVAL_S


def _claim_switch_interval() -> None:
    """Shorten the interpreter's GIL switch interval while any vLLM thread steps (see the module docstring)."""
    global _switch_users, _switch_before
    wanted = _wanted_switch_interval()
    with _switch_lock:
        _switch_users += 1
        if _switch_users == 1 and 0 < wanted < sys.getswitchinterval():
            _switch_before = sys.getswitchinterval()
            sys.setswitchinterval(wanted)


def _release_switch_interval() -> None:
    global _switch_users, _switch_before
    with _switch_lock:
        _switch_users -= 1
        if _switch_users == 0 and _switch_before is not None:
            sys.setswitchinterval(_switch_before)
            _switch_before = None


@dataclass
class _Outcomes:
    """What one pass owes each event loop: (future, result, error) triples, sent in one hop per loop."""

    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any, BaseException | None]]] = field(
        default_factory=dict)

    def add(self, waiter: _Waiter, result: Any = None, error: BaseException | None = None) -> None:
        loop, future = waiter
        self.by_loop.setdefault(loop, []).append((future, result, error))

    def send(self) -> None:
        for loop, batch in self.by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle, batch)
            except RuntimeError:  # that loop is closed: nobody is left to wait there
                pass
        self.by_loop.clear()


def _settle(batch: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for future, result, error in batch:
        if future.done():  # cancelled meanwhile: the abort is already queued
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


class VLLMThread:
    """One daemon thread running vLLM calls in order and stepping the engine while requests are open.

    Started at once, so the engine can be built on it; `attach` gives it the engine's `step` and
    the engine's view of its own death before the first request.
    """

    def __init__(self) -> None:
        self._engine_step: Callable[[], list[Any]] | None = None
        self._dead: Callable[[], BaseException | None] = lambda: None
        self._died: Callable[[BaseException], None] = lambda exc: None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._held: deque[Any] = deque()  # taken off the queue, not yet run (behind a when_idle call)
        self._waiters: dict[str, _Waiter] = {}  # request id -> its waiter; touched on this thread only
        self._lock = threading.Lock()  # submission vs. the thread's exit: nothing is queued after it
        self._stopped = False
        self._step_failed = False
        self.stream = EngineStream()  # a bad ART_NB_VLLM_STREAM is refused here, before the thread starts
        self._thread = threading.Thread(target=self._run, name="art_nb-vllm", daemon=True)
        self._thread.start()

    def attach(self, step: Callable[[], list[Any]], dead: Callable[[], BaseException | None],
               died: Callable[[BaseException], None]) -> None:
        """`step()` runs one engine step; `dead()` is the error to fail waiters with once the engine is
        dead or closed (None while it serves); `died(exc)` is told when `step()` raised."""
        self._dead, self._died, self._engine_step = dead, died, step

    def reasons(self) -> list[str]:
        """What the thread changes for vLLM's sake, to show among the engine's choices."""
        wanted = _wanted_switch_interval()
        switch = (f"Python's GIL switch interval {wanted * 1000:g} ms while vLLM decodes, so its thread gets the GIL "
                  "back soon after each GPU wait, and Python's own while it idles (thread.py)"
                  if 0 < wanted < (_switch_before or sys.getswitchinterval())
                  else "Python's GIL switch interval left as it is (thread.py)")
        return [switch] if self.stream.reason is None else [self.stream.reason, switch]

    # ---- submission (any thread) -----------------------------------------------------------------

    def call(self, fn: Callable[..., _T], *args: Any, when_idle: bool = False, **kwargs: Any) -> asyncio.Future[_T]:
        """Run `fn` on the vLLM thread after everything submitted before it; `when_idle`: once nothing is unfinished.

        Queued now, not at the first await: the order of calls is the order they were made in."""
        done: Future[_T] = Future()
        self._put(_Call(lambda: fn(*args, **kwargs), done, when_idle))
        return asyncio.wrap_future(done)

    def add(self, request_id: str, add: Callable[[], Any], future: asyncio.Future[Any]) -> None:
        """Run `add()` (vLLM's add_request) in order; `future` gets the request's finished output or the error."""
        self._put(_Add(request_id, add, (future.get_loop(), future)))

    def abort(self, request_id: str, abort: Callable[[list[str]], Any]) -> None:
        """Abort `request_id` unless it finished already; nobody waits for it."""
        self._put(_Abort(request_id, abort), quiet=True)

    def stop(self) -> None:
        """Let the thread exit after what is queued (waiters left then fail with `dead()`'s error)."""
        self._put(_STOP, quiet=True)

    def join(self) -> None:
        self._thread.join()

    def _put(self, item: Any, quiet: bool = False) -> None:
        with self._lock:
            if not self._stopped:
                self._queue.put(item)
                return
        if quiet:
            return
        error = self._dead() or RuntimeError("the vLLM thread has stopped")
        if isinstance(item, _Call) and item.done is not None:
            item.done.set_exception(error)
        elif isinstance(item, _Add):
            outcomes = _Outcomes()
            outcomes.add(item.waiter, error=error)
            outcomes.send()

    # ---- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        outcomes = _Outcomes()
        stepping = False  # holds a claim on the short switch interval
        try:
            with self.stream.issuing():  # vLLM's kernels on its own stream where one is asked (stream.py)
                while True:
                    if not self._waiters:  # nothing to step
                        if stepping:
                            _release_switch_interval()
                            stepping = False
                        if not self._held:  # sleep until something is asked
                            self._held.append(self._queue.get())
                    while not self._queue.empty():  # whatever was asked during the last step, in order
                        self._held.append(self._queue.get_nowait())
                    if self._run_held(outcomes):
                        break
                    if self._waiters and not stepping:
                        _claim_switch_interval()
                        stepping = True
                    self._step(outcomes)
                    outcomes.send()
        finally:
            if stepping:
                _release_switch_interval()
            with self._lock:
                self._stopped = True
            error = self._dead() or RuntimeError("the vLLM thread has stopped")
            self._fail_all(outcomes, error)
            while self._held or not self._queue.empty():
                item = self._held.popleft() if self._held else self._queue.get_nowait()
                if isinstance(item, _Add):
                    outcomes.add(item.waiter, error=error)
                elif isinstance(item, _Call) and item.done is not None and item.done.set_running_or_notify_cancel():
                    item.done.set_exception(error)
            outcomes.send()

    def _run_held(self, outcomes: _Outcomes) -> bool:
        """Run the held items in order; True once the stop item is reached."""
        while self._held:
            item = self._held[0]
            if isinstance(item, _Call) and item.when_idle and self._waiters and self._can_step():
                return False  # it and everything after it wait for the running requests
            self._held.popleft()
            if item is _STOP:
                return True
            if isinstance(item, _Call):
                with self.stream.crossing():
                    _run_call(item)
            elif isinstance(item, _Add):
                self._add(item, outcomes)
            elif isinstance(item, _Abort) and self._waiters.pop(item.request_id, None) is not None \
                    and self._can_step():
                _run_call(_Call(lambda item=item: item.abort([item.request_id])))
        return False

    def _add(self, item: _Add, outcomes: _Outcomes) -> None:
        error = self._dead()
        if error is None:
            try:
                item.add()
            except Exception as exc:  # noqa: BLE001 - rejected: the caller maps vLLM's error to ours
                error = exc
        if error is None:
            self._waiters[item.request_id] = item.waiter
        else:
            outcomes.add(item.waiter, error=error)

    def _can_step(self) -> bool:
        return self._engine_step is not None and not self._step_failed and self._dead() is None

    def _step(self, outcomes: _Outcomes) -> None:
        """One step of the engine, if anything waits; finished outputs to their waiters."""
        if not self._waiters:
            return
        if not self._can_step():
            self._fail_all(outcomes, self._dead() or RuntimeError("vLLM stopped"))
            return
        assert self._engine_step is not None
        try:
            outputs = self._engine_step()
        except Exception as exc:  # noqa: BLE001 - vLLM is in an unknown state: fail everyone, step no more
            self._step_failed = True
            self._died(exc)
            self._fail_all(outcomes, self._dead() or exc)
            return
        for output in outputs:
            if output.finished:
                waiter = self._waiters.pop(output.request_id, None)
                if waiter is not None:
                    outcomes.add(waiter, output)

    def _fail_all(self, outcomes: _Outcomes, error: BaseException) -> None:
        for waiter in self._waiters.values():
            outcomes.add(waiter, error=error)
        self._waiters.clear()


def _run_call(item: _Call) -> None:
    if item.done is not None and not item.done.set_running_or_notify_cancel():
        return  # its caller was cancelled before it ran (as an executor skips a cancelled work item)
    try:
        result = item.fn()
    except BaseException as exc:  # handed to the caller, who decides; the thread itself goes on
        if item.done is None:
            _log.warning("vLLM call failed: %s: %s", type(exc).__name__, exc)
        else:
            item.done.set_exception(exc)
        if not isinstance(exc, Exception):
            raise
        return
    if item.done is not None:
        item.done.set_result(result)
