"""Which log records and warnings go to a log file for a while, and which still show: `Diversion`.

Libraries configure their own logging: vLLM gives "vllm" a handler on the stdout it was imported
with, transformers and torch give theirs one on stderr, and all three stop propagation, so setting
the root logger up catches none of them. A `Diversion` stands in for the handlers that show
records (stream handlers on a stream: not files, not torch's lazy trace file) of every logger it
`chooses` (the root's too, and `logging.lastResort`, which prints what nothing handled) and for
`warnings.showwarning` (the documented hook): what it takes is written to the sink, everything
else reaches the handlers it stood in for, as it would have; other handlers (a user's log file)
get every record as before. Levels are left alone: the log holds what would have been shown. Nothing is patched; `uninstall` puts each piece
back unless something replaced it meanwhile, and a stand-in something kept a reference to passes
everything on from then on.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Protocol, TextIO

__all__ = ["Diversion", "Sink"]

_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
_DIVERTED = "_art_nb_diverted"  # set on a record once it is in the log, so no ancestor's stand-in writes it again


class Sink(Protocol):
    def write(self, text: str) -> bool:
        """Append `text`; False once the sink is closed (the writer then shows it as before)."""


class Diversion:
    """Records of loggers `chosen(name)`, below level `below` (all when None), and warnings raised from
    files `warnings_from(filename)` (but never those of a category in `always_shown`) go to `sink` between
    `install()` and `uninstall()`. `fallback` takes
    `logging.lastResort`'s place for records not taken (default: lastResort itself)."""

    def __init__(self, sink: Sink, chosen: Callable[[str], bool], *, warnings_from: Callable[[str], bool],
                 below: int | None = None, fallback: logging.Handler | None = None,
                 always_shown: tuple[type[Warning], ...] = ()) -> None:
        self.sink = sink
        self.chosen = chosen
        self.below = below
        self.over = False
        self._warnings_from = warnings_from
        self._always_shown = always_shown
        self._fallback = fallback
        self._swapped: list[tuple[logging.Logger, list[logging.Handler], list[logging.Handler]]] = []
        self._last_resort: logging.Handler | None = None
        self._shown_warning: Callable[..., None] | None = None

    def takes(self, record: logging.LogRecord) -> bool:
        return not self.over and self.chosen(record.name) and (self.below is None or record.levelno < self.below)

    def install(self) -> Diversion:
        existing = list(logging.root.manager.loggerDict.items())  # placeholders are no loggers yet: left as they are
        loggers = [logging.root] + [lg for name, lg in existing if isinstance(lg, logging.Logger) and self.chosen(name)]
        for logger in loggers:
            handlers = list(logger.handlers)
            shown = [h for h in handlers if _shows(h)]
            if shown:
                ours = [h for h in handlers if h not in shown] + [_StandIn(self, shown)]
                logger.handlers = ours
                self._swapped.append((logger, handlers, ours))
        self._last_resort = logging.lastResort
        kept = [h for h in (self._fallback or self._last_resort,) if h is not None]
        logging.lastResort = _StandIn(self, kept, level=logging.WARNING)
        self._shown_warning = warnings.showwarning
        warnings.showwarning = self._show_warning
        return self

    def uninstall(self) -> None:
        self.over = True
        for logger, handlers, ours in self._swapped:
            if logger.handlers == ours:  # else something replaced them since: theirs stay
                logger.handlers = handlers
        self._swapped.clear()
        if isinstance(logging.lastResort, _StandIn) and logging.lastResort.diversion is self:
            logging.lastResort = self._last_resort
        if warnings.showwarning == self._show_warning:
            warnings.showwarning = self._shown_warning  # type: ignore[assignment]

    def _show_warning(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
                      file: TextIO | None = None, line: str | None = None) -> None:
        """warnings.showwarning meanwhile (pytest and IPython may have put their own there before)."""
        if not (file is None and not self.over and not issubclass(category, self._always_shown)
                and self._warnings_from(filename)
                and self.sink.write(warnings.formatwarning(message, category, filename, lineno, line))):
            assert self._shown_warning is not None
            self._shown_warning(message, category, filename, lineno, file, line)


class _StandIn(logging.Handler):
    """A logger's handlers (or lastResort) while a diversion is on: a record it takes goes to the sink,
    any other to the handlers stood in for, each at its own level."""

    def __init__(self, diversion: Diversion, kept: list[logging.Handler], level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.diversion = diversion
        self.kept = kept
        self.setFormatter(_FORMAT)

    def handle(self, record: logging.LogRecord) -> bool:  # type: ignore[override]
        if vars(record).get(_DIVERTED):  # written below already; it propagated up to here
            return True
        showing = [handler for handler in self.kept if record.levelno >= handler.level]
        if not showing:
            return True
        if self.diversion.takes(record) and self.diversion.sink.write(self.format(record) + "\n"):
            setattr(record, _DIVERTED, True)
            return True
        for handler in showing:
            handler.handle(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        self.handle(record)


def _shows(handler: logging.Handler) -> bool:
    """A handler that writes to a stream (a console's, a notebook's): not a file, not one with none yet."""
    return (isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            and handler.stream is not None)
