"""A quiet register on the real tiny model: the cell shows the phase bar and the choices, the log the rest.

A build phase is made to talk as Unsloth and vLLM do on a GPU (print, vLLM's logger with its own
handler, transformers' logger, a warning, a write to descriptor 2, all from the build's thread), on
top of what the real build prints on CPU (transformers' "Loading weights" bars).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

import pytest

import art_nb as art
from art_nb.local import runtime
from art_nb.local.engines.hf.engine import HFEngine
from art_nb.local.plan.base_models import TINY_MODEL

pytestmark = pytest.mark.slow

NOISE = ("UNSLOTH-BANNER", "VLLM-WARNING", "TRANSFORMERS-WARNING", "UNSLOTH-IMPORT-ORDER", "C-LEVEL-LINE")


@pytest.fixture
def noisy_build(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """vLLM's logger as vLLM configures it at import (a handler on stdout, no propagation), and a trainer
    build that emits what Unsloth and vLLM emit while a model registers; then fails if told to."""
    from transformers.utils import logging as transformers_logging

    class StdoutHandler(logging.StreamHandler):  # type: ignore[type-arg]
        @property
        def stream(self):  # the test's stdout, whichever capture pytest has in place when it logs
            return sys.stdout

        @stream.setter
        def stream(self, value) -> None:
            pass

    vllm = logging.getLogger("vllm")
    monkeypatch.setattr(vllm, "handlers", [StdoutHandler()])
    monkeypatch.setattr(vllm, "propagate", False)
    real = runtime._create_trainer
    told = {"fail": False}

    def create_trainer(plan, path, config):
        print("UNSLOTH-BANNER")
        vllm.getChild("config").warning("VLLM-WARNING")
        transformers_logging.get_logger("transformers.modeling_utils").warning("TRANSFORMERS-WARNING")
        warnings.warn("UNSLOTH-IMPORT-ORDER", UserWarning, stacklevel=1)
        os.write(2, b"[W c10d] C-LEVEL-LINE\n")
        if told["fail"]:
            for i in range(40):
                print(f"LINE {i}")
            raise RuntimeError("the trainer could not be built")
        return real(plan, path, config)

    monkeypatch.setattr(runtime, "_create_trainer", create_trainer)
    return told


def make_model(name: str) -> art.TrainableModel:
    return art.TrainableModel(name=name, project="it", base_model=TINY_MODEL, config=art.ModelConfig(max_seq_len=256))


def log_of(path: Path, model: art.TrainableModel) -> Path:
    return path / model.project / "models" / model.name / "logs" / "register.log"


async def test_the_cell_shows_the_bar_and_the_choices_and_the_log_holds_the_rest(tmp_path, capfd, noisy_build,
                                                                                   monkeypatch) -> None:
    backend = art.LocalBackend(path=tmp_path)
    model = make_model("quiet")
    stdout, stderr, showwarning = sys.stdout, sys.stderr, warnings.showwarning
    vllm_handlers = list(logging.getLogger("vllm").handlers)
    try:
        await model.register(backend)
        for what, why in backend.choices(model).items():  # the notebook's summary of choices
            print(f"{what}: {why}")
        cell = capfd.readouterr()
        log = log_of(tmp_path, model)
        assert cell.out.count(str(log)) == 1  # the path, printed once
        assert "register: 4/4 phases" in cell.err and "startup: base model" in cell.out
        for noise in (*NOISE, "Loading weights"):  # the real build's transformers bars too
            assert noise not in cell.out + cell.err, noise
        written = log.read_text()
        for noise in NOISE:
            assert noise in written, noise
        assert "--- trainer (peft)" in written  # which phase it came from
        assert (sys.stdout, sys.stderr) == (stdout, stderr)
        print("PRINTED-AFTER")
        os.write(2, b"FD-AFTER\n")
        assert capfd.readouterr() == ("PRINTED-AFTER\n", "FD-AFTER\n")

        generate = HFEngine.generate

        async def noticing_generate(self, request):  # a first-use notice, as vLLM logs at its first request
            logging.getLogger("vllm.input_processor").warning("FIRST-ROLLOUT-NOTICE")
            return await generate(self, request)

        monkeypatch.setattr(HFEngine, "generate", noticing_generate)
        reply = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert reply.choices[0].message is not None
        cell = capfd.readouterr()
        assert "FIRST-ROLLOUT-NOTICE" not in cell.out + cell.err
        assert "FIRST-ROLLOUT-NOTICE" in log.read_text()
    finally:
        await backend.close()  # ends the first rollout's window, as a train step does
    assert logging.getLogger("vllm").handlers == vllm_handlers and warnings.showwarning == showwarning
    logging.getLogger("vllm").warning("SHOWN-AGAIN")
    assert "SHOWN-AGAIN" in capfd.readouterr().out


async def test_a_failed_register_names_the_log_and_shows_its_last_lines(tmp_path, capfd, noisy_build) -> None:
    noisy_build["fail"] = True
    backend = art.LocalBackend(path=tmp_path)
    model = make_model("fails")
    stdout = sys.stdout
    try:
        with pytest.raises(RuntimeError, match="could not be built") as caught:
            await model.register(backend)
    finally:
        await backend.close()
    note = "\n".join(caught.value.__notes__)
    assert str(log_of(tmp_path, model)) in note
    assert "LINE 39" in note and "LINE 0\n" not in note  # its last lines, not all of them
    cell = capfd.readouterr()
    assert "LINE 39" not in cell.out and "register:" in cell.err  # the bar was closed; the noise stayed in the log
    assert sys.stdout is stdout
    print("PRINTED-AFTER")
    assert capfd.readouterr().out == "PRINTED-AFTER\n"


async def test_verbose_shows_everything_where_it_was_printed(tmp_path, capfd, noisy_build, recwarn) -> None:
    backend = art.LocalBackend(path=tmp_path, verbose=True)
    model = make_model("verbose")
    try:
        await model.register(backend)
    finally:
        await backend.close()
    cell = capfd.readouterr()
    assert "UNSLOTH-BANNER" in cell.out and "VLLM-WARNING" in cell.out and "C-LEVEL-LINE" in cell.err
    assert "UNSLOTH-IMPORT-ORDER" in [str(w.message) for w in recwarn]
    assert "register.log" not in cell.out and not log_of(tmp_path, model).exists()
