"""Register's third-party output goes to the model's log file, not to the cell that registers.

On a GPU, vLLM, Unsloth, transformers and torch wrote ~170 lines around art_nb's phase bar in the
register cell of a saved notebook: vLLM's INFO lines, Unsloth's banner, deprecation warnings, a C++
warning, CUDA-graph bars whose cursor moves show as `[A`. `RegisterOutput` sends all of it to
`logs/register.log` in the model's directory (store.py) for the duration of one register and puts
everything back after, on an error or an interrupt too; a failed register's exception then carries
the log's last lines. `LocalBackend(verbose=True)` changes nothing. What goes there, and how:

- `logging` records of every logger but art_nb's, and every warning but art_nb's own (divert.py: `ArtNbWarning`); art_nb's
  log records (an engine fallback) and warnings (an ART knob it ignores) still show.
- writes to `sys.stdout`/`sys.stderr`: Unsloth's prints, tqdm bars, and the handlers made while
  register runs (vLLM's, when vLLM is first imported then), which keep the stream they were given:
  it writes to the cell's stream again once register is over.
- file descriptors 1 and 2, pointed at the log (dup2): C++ warnings (torch's c10d), Triton, child
  processes. ipykernel (6+) reads descriptors 1 and 2 through a pipe into the cell, so without this
  a notebook still shows them. The phase bar writes to its own copy of a console's descriptor
  (`terminal_copy`), so a console still shows it.
- progress bars drawn as notebook widgets, which no stream redirect catches: transformers' and the
  hub's are turned off through their own switches, vLLM's through `use_tqdm_on_load`
  (utils/progress.py). A library with no such switch would still show its bar.

This is process-wide: while a model loads, other threads' output goes to the log too. Loads are one
at a time in a process (runtime.loading_alone) and the runtime enters this inside that lock, so two
registers never overlap here. After register and until the next train step ends (`end_first_rollout`),
the first-use notices of the libraries in THIRD_PARTY (vLLM's deprecation at the first request, a
Triton JIT notice at the first logprobs) still go to the log: their log records below ERROR and the
warnings raised from their code. The user's own prints, logs and warnings in rollout code show then.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

from art_nb.config import ArtNbWarning
from art_nb.nofollow import open_regular, real_dirs
from art_nb.utils.progress import set_library_bars

from .divert import Diversion

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["THIRD_PARTY", "RegisterOutput", "end_first_rollout", "terminal_copy"]

# Packages whose logs and warnings after register are first-use notices (the first rollout's window).
THIRD_PARTY = frozenset({
    "accelerate", "bitsandbytes", "datasets", "flash_attn", "flashinfer", "gguf", "huggingface_hub", "peft",
    "safetensors", "tokenizers", "torch", "torchao", "transformers", "triton", "trl", "unsloth", "unsloth_zoo",
    "vllm", "xformers",
})
_TAIL_LINES = 25
_TAIL_BYTES = 256 * 1024
_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_log = logging.getLogger("art_nb")

_lock = threading.Lock()
_window: tuple[Diversion, _Sink] | None = None


def end_first_rollout() -> None:
    """Third-party notices show again, as before register (a train step has ended, or the backend closed)."""
    global _window
    with _lock:
        window, _window = _window, None
    if window is not None:
        window[0].uninstall()
        window[1].close()


def terminal_copy(stream: TextIO) -> tuple[TextIO, Callable[[], None]]:
    """`stream`, or, where it writes to descriptor 1 or 2 (a console), a stream on a copy of that
    descriptor, which still reaches the terminal while register points 1 and 2 at its log. Also the
    function that closes that copy."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # ipykernel's and pytest's streams: no descriptor 1 or 2
        return stream, lambda: None
    if fd not in (1, 2):
        return stream, lambda: None
    stream.flush()
    copy = open(os.dup(fd), "w", encoding=stream.encoding or "utf-8", errors="replace")  # noqa: SIM115
    return copy, copy.close


class RegisterOutput:
    """`with RegisterOutput(path, title):` third-party output goes to `path` (appended) until the block ends.

    On success the first rollout's window opens (see the module's docstring); on a failure or an
    interrupt the exception gets a note with the log's last lines. `verbose=True`: nothing changes.
    """

    def __init__(self, path: Path, root: Path, title: str, *, verbose: bool = False) -> None:
        self.path = path
        self.root = root  # the store's --path: the log is created below it, never through a link
        self.title = title
        self.verbose = verbose
        self._sink: _Sink | None = None
        self._undo: contextlib.ExitStack | None = None

    def mark(self, text: str) -> None:
        """A line of art_nb's own in the log (which phase began), so its lines can be placed."""
        if self._sink is not None:
            self._sink.write(f"--- {text}\n")

    def __enter__(self) -> Self:
        end_first_rollout()
        if self.verbose:
            return self
        _flush_all()
        try:
            sink = _Sink(self.path, self.root, f"\n=== register {self.title}: process {os.getpid()}, "
                                    f"{time.strftime('%Y-%m-%d %H:%M:%S')} ===\n")
        except OSError as error:
            _log.warning("register: third-party output stays here: cannot write %s (%s)", self.path, error)
            return self
        try:
            with contextlib.ExitStack() as undo:
                undo.callback(_progress_bars_off())
                undo.callback(set_library_bars, set_library_bars(False))
                shown, close_shown = terminal_copy(sys.stderr)
                undo.callback(close_shown)
                fallback = logging.StreamHandler(shown)  # lastResort's place for art_nb's own warnings
                fallback.setLevel(logging.WARNING)
                everything = Diversion(sink, lambda name: not _ours(name), fallback=fallback, warnings_from=_anywhere,
                                       always_shown=(ArtNbWarning,))
                undo.callback(everything.install().uninstall)
                undo.callback(_divert_streams(sink))
                undo.callback(_redirect_descriptors(sink.fd))
                self._undo = undo.pop_all()
        except BaseException:
            sink.close()
            raise
        self._sink = sink
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        global _window
        if self._undo is None or self._sink is None:
            return
        sink, undo, self._sink, self._undo = self._sink, self._undo, None, None
        try:
            undo.close()
        finally:
            if error is None:  # the log stays open for the first rollout's window
                window = Diversion(sink, _third_party, below=logging.ERROR, warnings_from=_in_third_party,
                                   always_shown=(ArtNbWarning,))
                with _lock:
                    _window = window.install(), sink
            else:
                sink.close()
        if error is None or isinstance(error, (SystemExit, GeneratorExit)):
            return
        with contextlib.suppress(OSError):
            tail = sink.tail(_TAIL_LINES)
            if tail:
                _add_note(error, f"third-party output of this register, its last lines ({sink.path} has all of it):\n"
                          + "\n".join(f"    {line}" for line in tail.splitlines()))


class _Sink:
    """The log file, appended to from any thread; once closed, `write` says so and writers fall back."""

    def __init__(self, path: Path, root: Path, header: str) -> None:
        root.mkdir(parents=True, exist_ok=True)  # as the store makes it; below it, no link is followed
        real_dirs(root, *path.parent.relative_to(root).parts)
        self.path = path
        self.fd: int | None = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, str(path.relative_to(root)))
        self._lock = threading.Lock()
        self.write(header)
        self._start = os.fstat(self.fd).st_size  # where this register's lines begin

    def write(self, text: str) -> bool:
        data = text.encode("utf-8", "replace")
        with self._lock:
            if self.fd is None:
                return False
            while data:
                data = data[os.write(self.fd, data):]
        return True

    def close(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def tail(self, lines: int) -> str:
        """This register's last `lines` lines, as a terminal would have left them (bars at their last state)."""
        with open(self.path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(self._start, size - _TAIL_BYTES))
            text = handle.read().decode("utf-8", "replace")
        kept = [_ESCAPES.sub("", line).rsplit("\r", 1)[-1].rstrip() for line in text.split("\n")]
        return "\n".join([line for line in kept if line][-lines:])


class _Stream(io.TextIOBase):
    """sys.stdout or sys.stderr during register: writes go to the log; once it is closed (register
    over) to the stream it stood in for, which a handler made during register may still hold."""

    def __init__(self, sink: _Sink, original: TextIO) -> None:
        self._sink = sink
        self.original = original
        self.active = True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return not self.active and self.original.isatty()

    def write(self, text: str) -> int:
        if self.active and self._sink.write(text):
            return len(text)
        return self.original.write(text)

    def flush(self) -> None:
        if not self.active:
            self.original.flush()

    def fileno(self) -> int:
        fd = self._sink.fd if self.active else None
        return self.original.fileno() if fd is None else fd


def _divert_streams(sink: _Sink) -> Callable[[], None]:
    """sys.stdout and sys.stderr write to the log; the function that puts them back."""
    saved = sys.stdout, sys.stderr
    ours = _Stream(sink, _unwrapped(saved[0])), _Stream(sink, _unwrapped(saved[1]))
    sys.stdout, sys.stderr = ours

    def restore() -> None:
        for stream in ours:
            stream.active = False  # whoever holds it (a handler made meanwhile) reaches the original again
        if sys.stdout is ours[0]:
            sys.stdout = saved[0]
        if sys.stderr is ours[1]:
            sys.stderr = saved[1]

    return restore


def _redirect_descriptors(fd: int) -> Callable[[], None]:
    """Descriptors 1 and 2 point at `fd`; the function that points them back (flushing C's buffers first)."""
    saved: list[tuple[int, int]] = []

    def restore() -> None:
        _flush_all()
        for target, copy in saved:
            os.dup2(copy, target)
            os.close(copy)

    try:
        for target in (1, 2):
            try:
                copy = os.dup(target)
            except OSError:  # not open in this process (a daemon): nothing to redirect
                continue
            saved.append((target, copy))
            os.dup2(fd, target)
    except BaseException:
        restore()
        raise
    return restore


def _progress_bars_off() -> Callable[[], None]:
    """transformers' and the hub's bars off (in a notebook they are widgets, which no stream redirect
    catches); the function that puts them back as they were."""
    try:
        import huggingface_hub.utils as hub
    except ImportError:
        return lambda: None
    transformers_before = sys.modules.get("transformers") is not None
    tf = _transformers_logging()
    hub_was_on = not hub.are_progress_bars_disabled()
    tf_was_on = tf.is_progress_bar_enabled() if tf is not None else hub_was_on
    if tf is not None:
        tf.disable_progress_bar()
    hub.disable_progress_bars()

    def restore() -> None:
        # transformers imported during register took the hub's switch (off) for its own: on again if it was on
        now = _transformers_logging()
        if now is not None and (tf_was_on if transformers_before else hub_was_on):
            now.enable_progress_bar()  # the hub's too
        elif hub_was_on:
            hub.enable_progress_bars()

    return restore


def _transformers_logging() -> Any:
    if sys.modules.get("transformers") is None:
        return None
    import transformers.utils.logging as tf_logging

    return tf_logging


def _ours(name: str) -> bool:
    return name == "art_nb" or name.startswith("art_nb.")


def _third_party(name: str) -> bool:
    return name.split(".", 1)[0] in THIRD_PARTY


def _anywhere(filename: str) -> bool:
    return True


def _in_third_party(filename: str) -> bool:
    for name in THIRD_PARTY:
        # third-party: a package's folders (a plain module, or one not imported, has none)
        for folder in getattr(sys.modules.get(name), "__path__", None) or ():
            if filename.startswith(os.path.join(folder, "")):
                return True
    return False


def _unwrapped(stream: TextIO) -> TextIO:
    """A stream left over from an earlier register is only a way to reach the one it stood in for."""
    while isinstance(stream, _Stream) and not stream.active:
        stream = stream.original
    return stream


def _flush_all() -> None:
    """Python's and C's buffered output written now, to wherever descriptors 1 and 2 point at the moment."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)


def _add_note(error: BaseException, note: str) -> None:
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:  # Python 3.10: no exception notes
        _log.error("%s", note)
