"""Where register's time goes: each phase timed, shown live, and kept in `backend.choices(model)`.

Registering a model on a GPU takes minutes (vLLM's compile and CUDA graphs, Unsloth's import and
compile) and used to show nothing until it was over. A user watching a silent cell cannot tell a
slow start from a hang, and we could not tell which phase to make faster. So every phase is named
when it starts (a progress bar, or a log line where no bar is wanted) and its seconds are recorded:
`choices["startup"]` reads like "base model 0.4 s, engine (vllm) 95.1 s, trainer (unsloth) 61.0 s,
checkpoint 0 0.3 s: 157.0 s in all".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["PhaseClock", "phase_bar"]

PhaseCallback = Callable[[str], None]


class PhaseClock:
    """Times named phases one after another; `start(name)` ends the phase before it."""

    def __init__(self, on_phase: PhaseCallback | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self._on_phase = on_phase
        self._clock = clock
        self._began = clock()
        self._current: tuple[str, float] | None = None
        self.seconds: dict[str, float] = {}

    def start(self, name: str) -> None:
        now = self._clock()
        self._close_current(now)
        self._current = (name, now)
        if self._on_phase is not None:
            self._on_phase(name)

    def finish(self) -> str:
        """End the last phase; the summary line for `choices["startup"]`."""
        now = self._clock()
        self._close_current(now)
        total = now - self._began
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items())
        return f"{parts}: {total:.1f} s in all" if parts else f"{total:.1f} s"

    def _close_current(self, now: float) -> None:
        if self._current is not None:
            name, since = self._current
            self.seconds[name] = self.seconds.get(name, 0.0) + now - since
            self._current = None


def phase_bar(phases: int) -> tuple[PhaseCallback, Callable[[], None]]:
    """A progress bar over register's phases, fed from the runtime's thread: (on_phase, close).

    The bar is made in the caller's thread (a notebook shows it under the cell that registers);
    the runtime only calls `on_phase`, which moves it on and names the phase now running.
    """
    from ...utils.progress import progress_bar  # leaves its final state in a saved notebook

    bar = progress_bar(total=phases, desc="register", bar_format="{desc}: {n}/{total} phases [{elapsed}]{postfix}")
    lock = threading.Lock()
    seen = [0]

    def on_phase(name: str) -> None:
        with lock:
            if seen[0]:
                bar.update(1)
            seen[0] += 1
            bar.set_postfix_str(name)

    def close() -> None:
        with lock:
            if seen[0]:  # some phases are skipped (an engine already running): end full all the same
                bar.update(bar.total - bar.n)
                bar.set_postfix_str("done")
            bar.close()

    return on_phase, close
