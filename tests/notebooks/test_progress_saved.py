"""On a real kernel (nbclient): the saved output of `progress_bar` ends at 100%, where tqdm's own
notebook bar stays at its first "0%" (what the executed notebooks showed before)."""

from __future__ import annotations

import nbformat
import pytest

pytestmark = pytest.mark.slow

CELL = """\
from art_nb.utils.progress import progress_bar
from tqdm.auto import tqdm
for make, desc in ((progress_bar, "ours"), (tqdm, "tqdm")):
    bar = make(total=4, desc=desc)
    for _ in range(4):
        bar.update(1)
    bar.close()
"""


def test_saved_output_shows_the_final_state(tmp_path):
    pytest.importorskip("ipywidgets")
    from nbclient import NotebookClient

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(CELL)]
    NotebookClient(notebook, kernel_name="python3", timeout=120,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    texts = [o["data"]["text/plain"] for o in notebook.cells[0].outputs if o.get("output_type") == "display_data"]
    ours, theirs = texts
    assert ours.startswith("ours: 100%") and "4/4" in ours
    assert theirs.startswith("tqdm:   0%")  # why the notebooks need ours (gather's bar must ask for it)
