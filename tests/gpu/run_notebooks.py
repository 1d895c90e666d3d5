"""Run the project's notebooks top to bottom on the GPU machine, as a Colab user would, and record each cell.

Usage (project root on the GPU machine, after `bash .gpu/bin/unpack.sh && source .gpu/bin/env.sh`):
    python3 tests/gpu/run_notebooks.py WORKDIR NAME:MODE[:STEPS] ...   (tests/gpu/run_notebooks_on_h200.sh calls it)
MODE  a100: the notebook's own hardware defaults (vLLM + Unsloth, bf16 on this GPU); only the base model is
            swapped for the offline SmolLM2 (the GPU machine has no hub access).
      t4:   the plan's hardware detection patched to report a T4 (sm75, 15 GiB) and torch capped at 15 GiB, so the
            notebook and register plan as on a T4 (with vLLM newer than 0.11.2 installed: the transformers engine,
            fp16, Unsloth); base model swapped likewise.
Writes WORKDIR/NAME-MODE.executed.ipynb and WORKDIR/notebooks_gpu.json (per cell: start, end, output tail;
the run's summary.json). Copy those to $OUT to bring them back.
Parameters may be overridden with EXTRA='{"LEARNING_RATE": 2e-4}' in the environment.
"""

import json
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"

T4_PATCH = """# injected: report a Colab T4 (sm75, 15 GiB) on this GPU and cap torch at 15 GiB
import dataclasses, torch
torch.cuda.set_per_process_memory_fraction(15.0 * 1024**3 / torch.cuda.get_device_properties(0).total_memory)
import art_nb.local.plan.hardware as _hw  # the one place the machine is read: the notebook and register both plan from it
_real_hw = _hw.detect_hardware()
_hw.detect_hardware = lambda: dataclasses.replace(
    _real_hw, gpu_name="Tesla T4 (simulated: H200 capped at 15 GiB)", gpu_capability=(7, 5), gpu_memory_gib=15.0)
"""


def tagged_cell(source, tag):
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = [tag]
    cell.id = tag
    return cell


def run(name, mode, steps, out):
    nb = nbformat.read(f"notebooks/{name}.ipynb", as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    work = out / f"{name}-{mode}"
    work.mkdir(parents=True, exist_ok=True)
    values = {"BASE_MODEL": TINY, "ART_PATH": str(work / ".art"), "OUTPUT_DIR": str(work / "out")}
    if steps:
        values["STEPS"] = steps
    values.update(json.loads(os.environ.get("EXTRA", "{}")))
    nb.cells.insert(at + 1, tagged_cell("\n".join(f"{k} = {v!r}" for k, v in values.items()), "injected-parameters"))
    if mode == "t4":  # before the parameters cell, which calls detect_hardware()
        nb.cells.insert(at, tagged_cell(T4_PATCH, "injected-t4"))
    client = NotebookClient(nb, timeout=1500, kernel_name="python3", resources={"metadata": {"path": str(work)}})
    started, error = time.perf_counter(), None
    try:
        client.execute()
    except CellExecutionError as exc:
        error = str(exc)[-3000:]
    except (Exception, KeyboardInterrupt) as exc:  # kernel death, timeout, the deadline's SIGINT (the .sh's)
        error = f"{type(exc).__name__}: {exc}"[-3000:]
    wall = time.perf_counter() - started
    nbformat.write(nb, out / f"{name}-{mode}.executed.ipynb")
    cells = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        texts = []
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                texts.append(output.get("text", ""))
            elif output.get("output_type") == "error":
                texts.append(f"ERROR {output.get('ename')}: {output.get('evalue')}")
            else:
                texts.append(str(output.get("data", {}).get("text/plain", ""))[:2000])
        timing = cell.metadata.get("execution", {})
        cells.append({"index": index, "first_line": (cell.source.splitlines() or [""])[0],
                      "start": timing.get("iopub.execute_input"), "end": timing.get("shell.execute_reply"),
                      "output_tail": "".join(texts)[-1500:]})
    summaries = [json.loads(p.read_text()) for p in (work / "out").glob("**/summary.json")]
    return {"notebook": name, "mode": mode, "steps": steps, "parameters": values, "wall_s": round(wall, 1),
            "error": error, "summary": summaries[-1] if summaries else None, "cells": cells}


def main():
    # The kernels must import this checkout's art_nb (the install cell then skips itself, as in CI).
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for spec in sys.argv[2:]:
        name, mode, *rest = spec.split(":")
        result = run(name, mode, int(rest[0]) if rest else None, out)
        results.append(result)
        print(f"{name} [{mode}] {result['wall_s']} s, error: {(result['error'] or 'none')[:300]}", flush=True)
        (out / "notebooks_gpu.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
