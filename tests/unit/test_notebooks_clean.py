"""The committed notebooks: stripped of outputs and widget state, shaped the way the issue promises
(install cell first, a `parameters` cell, resumable loops, export last), and an install cell that
does the right thing on Colab with and without a GPU (run here against fakes of pip and nvidia-smi)."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
EXPECTED = {"tic_tac_toe.ipynb", "2048.ipynb", "custom_rollout.ipynb"}
PARAMETERS = {"BASE_MODEL", "STEPS", "GROUPS_PER_STEP", "ROLLOUTS_PER_GROUP", "LEARNING_RATE"}


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def code_cells(notebook: dict) -> list[dict]:
    return [c for c in notebook["cells"] if c["cell_type"] == "code"]


def test_the_three_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} >= EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs_or_widget_state(path):
    notebook = load(path)
    assert "widgets" not in notebook["metadata"], "widget state is saved: clear it (Edit > Clear outputs)"
    assert set(notebook["metadata"]) <= {"kernelspec", "language_info"}, notebook["metadata"].keys()
    assert notebook["metadata"]["kernelspec"]["name"] == "python3"
    for index, cell in enumerate(notebook["cells"]):
        assert set(cell.get("metadata", {})) <= {"tags"}, f"cell {index} keeps run metadata {cell['metadata']}"
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [], f"cell {index} has outputs: strip them"
            assert cell["execution_count"] is None, f"cell {index} has an execution count"
        assert "attachments" not in cell


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_code_cell_parses(path):
    for cell in code_cells(load(path)):
        compile(source(cell), path.name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_shape(path):
    cells = code_cells(load(path))
    assert "find_spec(\"art_nb\")" in source(cells[0]), "the install cell comes first"
    tagged = [c for c in cells if "parameters" in c["metadata"].get("tags", [])]
    assert len(tagged) == 1, "exactly one cell is tagged `parameters`"
    assigned = {t.id for node in ast.parse(source(tagged[0])).body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    assert PARAMETERS <= assigned, PARAMETERS - assigned
    training = [c for c in cells if "model.train(" in source(c)]
    assert len(training) == 1 and "range(await model.get_step(), STEPS)" in source(training[0])
    assert any("get_inference_name(0)" in source(c) for c in cells), "evaluation against the base model"
    assert "export_model(" in source(cells[-1]), "the export cell comes last"


def test_custom_rollout_has_one_clearly_marked_rollout_cell():
    cells = code_cells(load(next(p for p in NOTEBOOKS if p.name == "custom_rollout.ipynb")))
    marked = [c for c in cells if "YOUR ROLLOUT: replace this cell" in source(c)]
    assert len(marked) == 1
    defined = {n.name for n in ast.parse(source(marked[0])).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert {"make_scenarios", "rollout"} <= defined
    rest = "".join(source(c) for c in cells if c is not marked[0])
    assert "Scenario(" not in rest, "cells outside the rollout cell must not depend on its scenario type"


# ---- the install cell, against fakes -------------------------------------------------------------


def install_source() -> str:
    sources = {source(code_cells(load(p))[0]) for p in NOTEBOOKS}
    assert len(sources) == 1, "the install cells of the notebooks differ"
    return sources.pop()


class FakeMachine:
    """pip, nvidia-smi and package metadata as seen by the install cell."""

    def __init__(self, gpu: bool, installed: dict[str, str], after_pip: dict[str, str] | None = None,
                 constraints_fail: bool = False) -> None:
        self.gpu, self.installed, self.after_pip = gpu, dict(installed), after_pip or {}
        self.constraints_fail = constraints_fail
        self.pip_calls: list[list[str]] = []
        self.constraints: str | None = None

    def which(self, name: str) -> str | None:
        return "/usr/bin/nvidia-smi" if name == "nvidia-smi" and self.gpu else None

    def run(self, cmd, *args, **kwargs):
        if cmd[0] == "nvidia-smi":
            return subprocess.CompletedProcess(cmd, 0 if self.gpu else 9, b"GPU 0: Tesla T4", b"")
        assert cmd[1:4] == ["-m", "pip", "install"], cmd
        self.pip_calls.append(list(cmd))
        if "-c" in cmd:
            self.constraints = Path(cmd[cmd.index("-c") + 1]).read_text()
            if self.constraints_fail:
                return subprocess.CompletedProcess(cmd, 1)
        self.installed.update(self.after_pip)
        return subprocess.CompletedProcess(cmd, 0)

    def version(self, dist: str) -> str:
        if dist not in self.installed:
            raise importlib.metadata.PackageNotFoundError(dist)
        return self.installed[dist]


@pytest.fixture
def run_install(monkeypatch, tmp_path, capsys):
    real_find_spec = importlib.util.find_spec

    def run(machine: FakeMachine, art_nb_installed: bool = False, imported: tuple[str, ...] = ()) -> str:
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (real_find_spec(name, *a) if art_nb_installed or name != "art_nb" else None))
        monkeypatch.setattr(shutil, "which", machine.which)
        monkeypatch.setattr(subprocess, "run", machine.run)
        monkeypatch.setattr(importlib.metadata, "version", machine.version)
        monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: str(tmp_path))
        for name in ("numpy", "ipywidgets", "torch", "transformers", "pydantic", "tqdm"):
            if name in imported:
                monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
            else:
                monkeypatch.delitem(sys.modules, name, raising=False)
        exec(compile(install_source(), "install-cell", "exec"), {})
        return capsys.readouterr().out

    return run


COLAB = {"numpy": "1.26.4", "ipywidgets": "7.7.1", "torch": "2.6.0+cu124", "transformers": "4.48.0"}


def test_install_is_skipped_where_art_nb_is_installed(run_install):
    machine = FakeMachine(gpu=True, installed=COLAB)
    out = run_install(machine, art_nb_installed=True)
    assert out.strip() == "art_nb is already installed: skipping the install."
    assert machine.pip_calls == []


def test_gpu_runtime_gets_the_gpu_extra_and_keeps_numpy_and_ipywidgets(run_install):
    machine = FakeMachine(gpu=True, installed=COLAB)
    out = run_install(machine)
    (call,) = machine.pip_calls
    assert "art-nb[notebook,gpu]" in call
    assert machine.constraints.splitlines() == ["numpy==1.26.4", "ipywidgets==7.7.1"]  # torch: vLLM pins its own
    assert out.strip() == "art_nb installed (art-nb[notebook,gpu]); no restart needed."


def test_cpu_runtime_skips_the_gpu_extra_and_keeps_torch_too(run_install):
    machine = FakeMachine(gpu=False, installed=COLAB)
    run_install(machine)
    (call,) = machine.pip_calls
    assert "art-nb[notebook,cpu]" in call and "art-nb[notebook,gpu]" not in call
    assert "torch==2.6.0+cu124" in machine.constraints.splitlines()


def test_one_clear_line_when_an_imported_package_changed(run_install):
    machine = FakeMachine(gpu=True, installed=COLAB, after_pip={"transformers": "5.0.0", "torch": "2.9.0"})
    out = run_install(machine, imported=("transformers",))  # torch changed too, but was never imported
    lines = out.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("RESTART NEEDED: transformers changed after being imported")


def test_falls_back_to_a_plain_install_when_the_constraints_cannot_hold(run_install):
    machine = FakeMachine(gpu=True, installed=COLAB, constraints_fail=True)
    out = run_install(machine)
    assert len(machine.pip_calls) == 2 and "-c" not in machine.pip_calls[1]
    assert "needs other versions of numpy, ipywidgets" in out
