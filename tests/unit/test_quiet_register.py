"""A quiet register (local/quiet.py, local/divert.py): third-party output to the log, everything put back.

Without a model: each test emits what vLLM, Unsloth, transformers and torch emit (a logger with its own
handler, print, tqdm-style writes to stderr, warnings, a write to file descriptor 2) inside
`RegisterOutput` and checks where it went, and that nothing is left changed afterwards.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

import pytest

from art_nb.local import quiet
from art_nb.local.divert import Diversion
from art_nb.utils.progress import library_bars


@pytest.fixture
def vllm_logger(monkeypatch: pytest.MonkeyPatch) -> logging.Logger:
    """"vllm" as vLLM configures it at import: its own handler on the stdout of that moment (`sys.stdout`
    when the test runs), no propagation."""

    class StdoutHandler(logging.StreamHandler):  # type: ignore[type-arg]
        @property
        def stream(self):  # the test's stdout, whichever capture pytest has in place when it logs
            return sys.stdout

        @stream.setter
        def stream(self, value) -> None:
            pass

    logger = logging.getLogger("vllm")
    monkeypatch.setattr(logger, "handlers", [StdoutHandler()])
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logger, "level", logging.INFO)
    return logger


@pytest.fixture(autouse=True)
def no_window_left() -> None:
    yield
    quiet.end_first_rollout()


def output(tmp_path: Path, verbose: bool = False) -> quiet.RegisterOutput:
    return quiet.RegisterOutput(tmp_path / "p" / "models" / "m" / "logs" / "register.log", tmp_path, "p/m",
                                verbose=verbose)


def emit_like_a_register() -> None:
    logging.getLogger("vllm.config").info("VLLM-INFO")
    logging.getLogger("peft.tuners").warning("PEFT-WARNING")  # no handler of its own: logging.lastResort
    print("UNSLOTH-BANNER")
    sys.stderr.write("\rCapturing CUDA graphs:  50%\x1b[A")
    warnings.warn("UNSLOTH-IMPORT-ORDER", UserWarning, stacklevel=1)
    os.write(2, b"[W c10d] C-LEVEL-LINE\n")
    logging.getLogger("art_nb").warning("ART-NB-WARNING")  # ours: still shown


def test_third_party_output_goes_to_the_log_and_art_nbs_warnings_still_show(tmp_path, capfd, vllm_logger,
                                                                           monkeypatch) -> None:
    monkeypatch.setattr(logging.root, "handlers", [])  # as in a notebook (pytest's call phase has its own there)
    handlers, stdout, stderr, showwarning, last_resort = (list(vllm_logger.handlers), sys.stdout, sys.stderr,
                                                          warnings.showwarning, logging.lastResort)
    with output(tmp_path) as out:
        assert not library_bars()  # vLLM asked to draw no bars (notebook widgets no stream catches)
        out.mark("engine (vllm)")
        emit_like_a_register()
    assert library_bars()
    shown = capfd.readouterr()
    for line in ("VLLM-INFO", "PEFT-WARNING", "UNSLOTH-BANNER", "CUDA graphs", "UNSLOTH-IMPORT-ORDER", "C-LEVEL"):
        assert line not in shown.out + shown.err
    assert "ART-NB-WARNING" in shown.err
    log = out.path.read_text()
    for line in ("=== register p/m", "--- engine (vllm)", "VLLM-INFO", "PEFT-WARNING", "UNSLOTH-BANNER",
                 "Capturing CUDA graphs", "UNSLOTH-IMPORT-ORDER", "C-LEVEL-LINE"):
        assert line in log, line
    assert (sys.stdout, sys.stderr) == (stdout, stderr)
    print("PRINTED-AFTER")
    os.write(2, b"FD-AFTER\n")
    assert capfd.readouterr() == ("PRINTED-AFTER\n", "FD-AFTER\n")
    quiet.end_first_rollout()
    assert (vllm_logger.handlers, warnings.showwarning, logging.lastResort) == (handlers, showwarning, last_resort)


def test_a_failure_carries_the_logs_last_lines_and_everything_is_put_back(tmp_path, capfd, vllm_logger) -> None:
    handlers, stdout = list(vllm_logger.handlers), sys.stdout
    with pytest.raises(KeyboardInterrupt) as caught, output(tmp_path):
        for i in range(40):
            print(f"LINE {i}")
        logging.getLogger("vllm.worker").error("CUDA out of memory")
        raise KeyboardInterrupt  # an interrupted cell is put back as well as a failure
    note = "\n".join(caught.value.__notes__)
    assert str(tmp_path / "p" / "models" / "m" / "logs" / "register.log") in note
    assert "LINE 39" in note and "CUDA out of memory" in note and "LINE 5\n" not in note  # only the last lines
    assert sys.stdout is stdout and vllm_logger.handlers == handlers  # no first-rollout window after a failure
    print("AFTER")
    assert capfd.readouterr().out == "AFTER\n"


def test_verbose_changes_nothing(tmp_path, capfd, vllm_logger, recwarn) -> None:
    with output(tmp_path, verbose=True) as out:
        emit_like_a_register()
    shown = capfd.readouterr()
    assert [str(w.message) for w in recwarn] == ["UNSLOTH-IMPORT-ORDER"]  # shown as warnings are (here: recorded)
    assert "VLLM-INFO" in shown.out and "UNSLOTH-BANNER" in shown.out and "C-LEVEL-LINE" in shown.err
    assert not out.path.exists()


def test_the_first_rollouts_notices_go_to_the_log_until_the_window_ends(tmp_path, capfd, vllm_logger,
                                                                       recwarn) -> None:
    import huggingface_hub

    with output(tmp_path) as out:
        pass
    user = logging.getLogger("my_rollout")
    user.addHandler(logging.StreamHandler(sys.stderr))
    try:
        logging.getLogger("vllm.input_processor").warning("RAW-PROMPTS-DEPRECATED")
        logging.getLogger("vllm.engine").error("ENGINE-ERROR")  # errors still show
        user.warning("USER-LOG")
        print("USER-PRINT")
        hub_file = os.path.join(huggingface_hub.__path__[0], "file_download.py")
        warnings.warn_explicit("HUB-NOTICE", UserWarning, hub_file, 1)
        warnings.warn_explicit("USER-WARNING", UserWarning, "rollout.py", 1)
        shown = capfd.readouterr()
        assert [str(w.message) for w in recwarn] == ["USER-WARNING"]  # shown as warnings are (here: recorded)
        assert "RAW-PROMPTS-DEPRECATED" not in shown.out + shown.err
        assert "ENGINE-ERROR" in shown.out and "USER-LOG" in shown.err and "USER-PRINT" in shown.out
        log = out.path.read_text()
        assert "RAW-PROMPTS-DEPRECATED" in log and "HUB-NOTICE" in log and "USER" not in log
        quiet.end_first_rollout()  # a train step ended
        logging.getLogger("vllm.input_processor").warning("LATER-NOTICE")
        assert "LATER-NOTICE" in capfd.readouterr().out
    finally:
        user.handlers.clear()


def test_a_propagating_logger_with_its_own_handler_is_written_once(monkeypatch) -> None:
    written: list[str] = []

    class Sink:
        def write(self, text: str) -> bool:
            written.append(text)
            return True

    hub = logging.getLogger("huggingface_hub")  # a handler of its own and propagation, as the hub has
    monkeypatch.setattr(hub, "handlers", [logging.StreamHandler(sys.stderr)])
    monkeypatch.setattr(logging.root, "handlers", [logging.StreamHandler(sys.stderr)])  # a user's basicConfig
    diversion = Diversion(Sink(), lambda name: name.startswith("huggingface_hub"), warnings_from=lambda f: False)
    diversion.install()
    try:
        hub.warning("ONCE")
    finally:
        diversion.uninstall()
    assert len(written) == 1 and "ONCE" in written[0]


def test_the_tail_shows_bars_at_their_last_state(tmp_path) -> None:
    with pytest.raises(RuntimeError) as caught, output(tmp_path):
        sys.stderr.write("\rLoading:  10%\rLoading:  90%\rLoading: 100%\x1b[A\n")
        raise RuntimeError("failed")
    assert "    Loading: 100%" in caught.value.__notes__[0].splitlines()


def test_a_console_bar_keeps_its_terminal_while_descriptor_2_goes_to_the_log(tmp_path, capfd, monkeypatch) -> None:
    console = open(2, "w", closefd=False)  # noqa: SIM115 - sys.stderr as a console has it: a stream on descriptor 2
    monkeypatch.setattr(sys, "stderr", console)
    bar, release = quiet.terminal_copy(sys.stderr)  # what phases.phase_bar writes to
    assert bar is not console
    with output(tmp_path) as out:
        bar.write("register: 1/4 phases")
        bar.flush()
        console.write("C-LIBRARY-NOISE")  # a write through descriptor 2, as C code's is
        console.flush()
    release()
    assert capfd.readouterr().err == "register: 1/4 phases"
    assert "C-LIBRARY-NOISE" in out.path.read_text()
    with open(tmp_path / "f", "w") as other:  # a stream on another descriptor is used as it is
        assert quiet.terminal_copy(other)[0] is other


def test_only_what_a_stream_handler_would_show_is_taken_and_file_handlers_keep_their_records(tmp_path, monkeypatch):
    written: list[str] = []

    class Sink:
        def write(self, text: str) -> bool:
            written.append(text)
            return True

    class LazyTrace(logging.StreamHandler):  # type: ignore[type-arg]
        """As torch's trace handler: a stream only once a trace directory is set, which here it is not."""

        def __init__(self) -> None:
            super().__init__()
            self.stream = None

        def emit(self, record: logging.LogRecord) -> None:
            pass

    torch_logger = logging.getLogger("torch")
    trace = logging.getLogger("torch.__trace")
    file_log = logging.FileHandler(tmp_path / "user.log")
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.WARNING)
    monkeypatch.setattr(torch_logger, "handlers", [console, file_log])
    monkeypatch.setattr(torch_logger, "level", logging.INFO)
    monkeypatch.setattr(torch_logger, "propagate", False)  # as torch has it
    monkeypatch.setattr(trace, "handlers", [LazyTrace()])
    monkeypatch.setattr(trace, "level", logging.DEBUG)
    monkeypatch.setattr(trace, "propagate", False)
    diversion = Diversion(Sink(), lambda name: name.startswith("torch"), warnings_from=lambda f: False).install()
    try:
        torch_logger.info("INFO-NOT-SHOWN")  # the console handler is at WARNING: not shown, so not taken
        torch_logger.warning("WARNING-SHOWN")
        trace.debug("TRACE-RECORD")  # dropped by its lazy handler, as before
    finally:
        diversion.uninstall()
        file_log.close()
    assert len(written) == 1 and "WARNING-SHOWN" in written[0]
    assert (tmp_path / "user.log").read_text() == "INFO-NOT-SHOWN\nWARNING-SHOWN\n"  # the file log has both
    assert torch_logger.handlers == [console, file_log]


def test_art_nbs_own_warnings_show_while_the_rest_goes_to_the_log(tmp_path) -> None:
    """An ART knob art_nb ignores is reported to the user even when the report happens inside register."""
    import warnings

    from art_nb.config import ArtNbWarning
    from art_nb.local.divert import Diversion

    class Log:
        def __init__(self) -> None:
            self.text = ""

        def write(self, text: str) -> bool:
            self.text += text
            return True

    log = Log()
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        diversion = Diversion(log, lambda name: True, warnings_from=lambda filename: True,
                              always_shown=(ArtNbWarning,)).install()
        try:
            warnings.warn("a library's deprecation", DeprecationWarning)
            warnings.warn("TrainableModel: accepted but not used by art_nb: x", ArtNbWarning)
        finally:
            diversion.uninstall()
    assert [str(w.message) for w in shown] == ["TrainableModel: accepted but not used by art_nb: x"]
    assert "a library's deprecation" in log.text and "accepted but not used" not in log.text
