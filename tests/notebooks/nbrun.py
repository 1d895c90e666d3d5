"""Execute a notebook headless with parameters, papermill-style, on a real kernel (nbclient).

`inject_parameters` adds a cell tagged `injected-parameters` right after the cell tagged
`parameters`, so the notebook's own defaults run first and the test's values override them,
exactly as papermill does. The executed copy is written next to the run for inspection.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def inject_parameters(notebook: nbformat.NotebookNode, parameters: dict[str, Any]) -> nbformat.NotebookNode:
    """A copy of `notebook` with `NAME = value` assignments injected after its `parameters` cell."""
    result = copy.deepcopy(notebook)
    index = next((i for i, cell in enumerate(result.cells) if "parameters" in cell.metadata.get("tags", [])), None)
    if index is None:
        raise ValueError("the notebook has no cell tagged 'parameters'")
    source = "# Parameters injected by the test\n" + "\n".join(f"{k} = {v!r}" for k, v in parameters.items())
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = ["injected-parameters"]
    cell.id = "injected-parameters"
    result.cells.insert(index + 1, cell)
    return result


def run_notebook(name: str, parameters: dict[str, Any], workdir: Path, timeout: int = 1800) -> tuple[nbformat.NotebookNode, float]:
    """Execute `notebooks/{name}.ipynb` in `workdir`; returns the executed notebook and the seconds it took.

    Raises nbclient's CellExecutionError (with the cell and traceback) when a cell fails; the
    partially executed notebook is still written to `workdir/{name}.executed.ipynb`.
    """
    notebook = inject_parameters(nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4), parameters)
    client = NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}})
    started = time.perf_counter()
    try:
        client.execute()
    finally:
        nbformat.write(notebook, workdir / f"{name}.executed.ipynb")
    return notebook, time.perf_counter() - started


def outputs(notebook: nbformat.NotebookNode, cell_index: int | None = None) -> list[dict[str, Any]]:
    cells = notebook.cells if cell_index is None else [notebook.cells[cell_index]]
    return [output for cell in cells if cell.cell_type == "code" for output in cell.get("outputs", [])]


def output_text(output: dict[str, Any]) -> str:
    if output.get("output_type") == "stream":
        return output.get("text", "")
    data = output.get("data", {})
    return str(data.get("text/plain", "")) + str(data.get("text/markdown", "")) + str(data.get("text/html", ""))


def find_cell(notebook: nbformat.NotebookNode, needle: str) -> int:
    """Index of the first code cell whose source contains `needle`."""
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code" and needle in cell.source:
            return index
    raise LookupError(f"no code cell contains {needle!r}")


def main(argv: list[str]) -> int:
    """`python nbrun.py NAME PARAMETERS_JSON WORKDIR`: one notebook per process, so several run side by side."""
    import json
    import sys

    from nbclient.exceptions import CellExecutionError

    name, parameters, workdir = argv[0], json.loads(argv[1]), Path(argv[2])
    try:
        _, seconds = run_notebook(name, parameters, workdir)
    except CellExecutionError as error:
        print(str(error)[-4000:], file=sys.stderr)
        return 1
    print(f"{name}: {seconds:.1f}s")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
