"""Where register's time goes: each phase timed, shown live, and kept in `backend.choices(model)`.

Registering a model on a GPU takes minutes (vLLM's compile and CUDA graphs, Unsloth's import and
compile) and used to show nothing until it was over. A user watching a silent cell cannot tell a
slow start from a hang, and we could not tell which phase to make faster. So every phase is named
when it starts (a progress bar, or a log line where no bar is wanted), logged with its seconds when
it ends, and recorded: `choices["startup"]` reads like "base model 0.4 s, trainer (unsloth) 30.2 s,
engine (vllm) 61.0 s (21.5 s of it alongside trainer (unsloth)), checkpoint 0 0.3 s: 92.0 s in all".
Phases may overlap (the vLLM import runs while the trainer builds): each keeps its own seconds, the
overlap is said, and the total is the wall time, not the sum.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

from .quiet import terminal_copy

__all__ = ["PhaseClock", "phase_bar"]

PhaseCallback = Callable[[str], None]
_log = logging.getLogger("art_nb")


class PhaseClock:
    """Times named phases: `start(name)` ends every open phase first; `begin(name)` runs alongside them."""

    def __init__(self, on_phase: PhaseCallback | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self._on_phase = on_phase
        self._clock = clock
        self._began = clock()
        self._open: dict[str, float] = {}  # name -> since
        self._spans: list[tuple[str, float, float]] = []  # (name, since, until), in the order they ended
        self._order: list[str] = []  # names in the order they first started
        self.seconds: dict[str, float] = {}

    def start(self, name: str) -> None:
        """End the open phases and begin `name`: phases one after another."""
        now = self._clock()
        for open_name in list(self._open):
            self._close(open_name, now)
        self._open_phase(name, now)

    def begin(self, name: str) -> None:
        """Begin `name` while the open phases go on; `end(name)` ends it."""
        self._open_phase(name, self._clock())

    def end(self, name: str) -> None:
        if name in self._open:
            self._close(name, self._clock())

    def finish(self) -> str:
        """End the open phases; the summary line for `choices["startup"]`."""
        now = self._clock()
        for open_name in list(self._open):
            self._close(open_name, now)
        total = now - self._began
        parts = ", ".join(self._describe(name) for name in self._order)
        return f"{parts}: {total:.1f} s in all" if parts else f"{total:.1f} s"

    def _open_phase(self, name: str, now: float) -> None:
        if name in self._open:
            raise ValueError(f"phase {name!r} is already running")
        self._open[name] = now
        if name not in self._order:
            self._order.append(name)
        if self._on_phase is not None:
            self._on_phase(name)

    def _close(self, name: str, now: float) -> None:
        since = self._open.pop(name)
        self._spans.append((name, since, now))
        self.seconds[name] = self.seconds.get(name, 0.0) + now - since
        _log.info("register: %s took %.1f s", name, now - since)

    def _describe(self, name: str) -> str:
        """`name` and its seconds, and how many of them ran alongside phases that began before it."""
        first = self._order.index(name)
        shared: dict[str, float] = {}
        for mine in (s for s in self._spans if s[0] == name):
            for other in (s for s in self._spans if self._order.index(s[0]) < first):
                overlap = min(mine[2], other[2]) - max(mine[1], other[1])
                if overlap > 0:
                    shared[other[0]] = shared.get(other[0], 0.0) + overlap
        text = f"{name} {self.seconds[name]:.1f} s"
        if shared:
            text += " (" + ", ".join(f"{sec:.1f} s of it alongside {other}" for other, sec in shared.items()) + ")"
        return text


def phase_bar(phases: int) -> tuple[PhaseCallback, Callable[[], None]]:
    """A progress bar over register's phases, fed from the runtime's thread: (on_phase, close).

    The bar is made in the caller's thread (a notebook shows it under the cell that registers);
    the runtime only calls `on_phase`, which moves it on and names the phase now running. In a
    console it writes to its own copy of the terminal, which register's log does not take (quiet.py).
    """
    from art_nb.utils.progress import progress_bar  # leaves its final state in a saved notebook

    stream, release = terminal_copy(sys.stderr)
    bar = progress_bar(total=phases, desc="register", bar_format="{desc}: {n}/{total} phases [{elapsed}]{postfix}",
                       file=stream)
    lock = threading.Lock()
    seen = [0]

    def on_phase(name: str) -> None:
        with lock:
            if seen[0]:
                if bar.n + 1 >= bar.total:  # a phase more than planned (vLLM failed, the fallback builds): room for it
                    bar.total += 1
                bar.update(1)
            seen[0] += 1
            bar.set_postfix_str(name)

    def close() -> None:
        with lock:
            if seen[0]:  # some phases are skipped (an engine already running): end full all the same
                bar.update(bar.total - bar.n)
                bar.set_postfix_str("done")
            bar.close()
            release()

    return on_phase, close
