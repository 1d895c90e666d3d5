"""The register cell on a real kernel (nbclient): quiet, it shows the path of its log, the phase bar and
the choices; verbose, what the build printed, a C-level write to descriptor 2 included.

Only a kernel shows why descriptors 1 and 2 are redirected: ipykernel reads them through a pipe into
the cell, so a library's C++ warning (torch's "[W... socket.cpp]") lands in the cell however
sys.stderr is set. The build is made to talk as Unsloth and vLLM do on a GPU; transformers' own
"Loading weights" bars (notebook widgets) are the real ones.
"""

from __future__ import annotations

import nbformat
import pytest

pytestmark = pytest.mark.slow

NOISY_BUILD = """\
import logging, os, sys, time, warnings
import art_nb as art
from art_nb.local import runtime
from art_nb.local.plan.base_models import TINY_MODEL

vllm = logging.getLogger("vllm")  # as vLLM configures it at import: a handler on this stdout, no propagation
vllm.addHandler(logging.StreamHandler(sys.stdout))
vllm.setLevel(logging.INFO)
vllm.propagate = False
real = runtime._create_trainer

def create_trainer(plan, path, config):
    print("UNSLOTH-BANNER")
    vllm.getChild("config").info("VLLM-INFO")
    warnings.warn("UNSLOTH-IMPORT-ORDER", UserWarning)
    os.write(2, b"[W c10d] C-LEVEL-LINE\\n")
    return real(plan, path, config)

runtime._create_trainer = create_trainer
"""
REGISTER = """\
model = art.TrainableModel(name={name!r}, project="p", base_model=TINY_MODEL, config=art.ModelConfig(max_seq_len=256))
backend = art.LocalBackend(path={path!r}, verbose={verbose})
await model.register(backend)
for what, why in backend.choices(model).items():
    print(f"{{what}}: {{why}}")
time.sleep(1)  # ipykernel forwards descriptor writes from a thread: a moment for it before the cell ends
"""
NOISE = ("UNSLOTH-BANNER", "VLLM-INFO", "UNSLOTH-IMPORT-ORDER", "C-LEVEL-LINE", "Loading weights")


def _shown(cell: nbformat.NotebookNode) -> str:
    return "\n".join(o["text"] if o["output_type"] == "stream" else o.get("data", {}).get("text/plain", "")
                     for o in cell.outputs)


def test_a_quiet_register_cell_and_a_verbose_one(tmp_path, monkeypatch):
    pytest.importorskip("ipywidgets")
    from nbclient import NotebookClient

    # ipykernel reads descriptors 1 and 2 into the cell, as in a notebook, only if it sees no pytest around
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(NOISY_BUILD),
                      nbformat.v4.new_code_cell(REGISTER.format(name="quiet", path=str(tmp_path), verbose=False)),
                      nbformat.v4.new_code_cell(REGISTER.format(name="loud", path=str(tmp_path), verbose=True))]
    NotebookClient(notebook, kernel_name="python3", timeout=600,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    quiet, loud = _shown(notebook.cells[1]), _shown(notebook.cells[2])
    log = tmp_path / "p" / "models" / "quiet" / "logs" / "register.log"
    assert f"goes to {log}" in quiet and "register: 4/4 phases" in quiet and "startup: base model" in quiet
    for noise in NOISE:
        assert noise not in quiet, noise
        assert noise in loud, noise  # transformers' bars too: back on after the quiet register
    written = log.read_text()
    for noise in NOISE[:-1]:
        assert noise in written, noise
