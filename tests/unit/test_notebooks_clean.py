"""The committed notebooks: stripped of outputs and widget state, shaped the way the issue promises
(install cell first, a `parameters` cell, resumable loops, export last), and an install cell that
does the right thing on Colab with and without a GPU (run here against fakes of pip and nvidia-smi)."""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import io
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

from art_nb.notebook import install as install_step  # imported before metadata is faked, as the cell's own process does

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
EXPECTED = {"tic_tac_toe.ipynb", "2048.ipynb", "custom_rollout.ipynb", "tool_agent.ipynb"}
PARAMETERS = {"BASE_MODEL", "STEPS", "GROUPS_PER_STEP", "ROLLOUTS_PER_GROUP", "LEARNING_RATE", "KEEP_ON_DRIVE"}


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def code_cells(notebook: dict) -> list[dict]:
    return [c for c in notebook["cells"] if c["cell_type"] == "code"]


def test_the_four_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} >= EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs_or_widget_state(path):
    notebook = load(path)
    assert "widgets" not in notebook["metadata"], "widget state is saved: clear it (Edit > Clear outputs)"
    assert set(notebook["metadata"]) == {"kernelspec", "language_info", "accelerator", "colab"}, notebook["metadata"].keys()
    assert notebook["metadata"]["kernelspec"]["name"] == "python3"
    # Colab opens it on a GPU runtime (what Colab itself writes for "T4 GPU"); nothing else of Colab's is kept.
    assert notebook["metadata"]["accelerator"] == "GPU" and notebook["metadata"]["colab"] == {"gpuType": "T4"}
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
    loop = source(training[0]) if len(training) == 1 else ""
    # resumable: from the served step up to STEPS, by hand or through art.pipeline (whose switch is a parameter)
    assert "range(await model.get_step(), STEPS)" in loop or "art.pipeline(model, gather, STEPS, enabled=PIPELINE)" in loop
    assert "enabled=PIPELINE" not in loop or "PIPELINE" in assigned
    assert any("get_inference_name(0)" in source(c) for c in cells), "evaluation against the base model"
    assert "export_model(" in source(cells[-1]), "the export cell comes last"
    # The base model's evaluation is logged at step 0: the reward plot's base point.
    assert any('split="val", step=0)' in source(c) for c in cells)
    # A base model set in the parameters gets a learning rate for its size before anything uses it.
    assert "LEARNING_RATE = defaults.learning_rate_for(BASE_MODEL, LEARNING_RATE)" in source(cells[2])
    # Engine, trainer and dtype stay the plan's ("auto"): the choices cell shows the plan's picks and reasons
    # for the config register gets, and register may fall back from vLLM on a T4 (only for the plan's choices).
    assert "MODEL_CONFIG = defaults.model_config(max_seq_len=MAX_SEQ_LEN)" in source(cells[2])
    assert "defaults.report(MODEL_CONFIG," in source(cells[2])
    assert sum("config=MODEL_CONFIG," in source(c) for c in cells) == 1
    keywords = {k.arg for c in cells for node in ast.walk(ast.parse(source(c))) if isinstance(node, ast.Call)
                for k in node.keywords}
    assert not keywords & {"engine", "trainer", "dtype"}, "the notebook sets what the plan should choose"
    assert any("keep_on_drive(ART_PATH) if KEEP_ON_DRIVE else ART_PATH" in source(c) for c in cells)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_talk_to_your_model_after_training_before_export(path):
    cells = code_cells(load(path))
    talk = [i for i, c in enumerate(cells) if "PROMPT = " in source(c)]
    assert len(talk) == 1
    text = source(cells[talk[0]])
    assert "openai_client()" in text or "rollout(model" in text  # the endpoint itself, or the notebook's agent
    assert "model.get_inference_name(0)" in text and "model.get_inference_name()" in text  # base vs trained
    assert "temperature=0.0" in text and '# @param {type:"string"}' in text  # greedy; a text box on Colab
    trained = next(i for i, c in enumerate(cells) if "model.train(" in source(c))
    assert trained < talk[0] < len(cells) - 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_cell_says_what_runs_how_long_and_where(path):
    first = load(path)["cells"][0]
    assert first["cell_type"] == "markdown"
    text = source(first)
    assert "**What a run does**" in text
    assert "130–254 s" in text and "H200" in text  # measured numbers, named where they were measured
    assert "not measured on a T4" in text and "not an A100" in text
    assert "A CPU runtime runs the tiny model, SmolLM2-135M-Instruct" in text
    assert "ART_NB_SOURCE" in text and "KEEP_ON_DRIVE" in text


def test_the_notebook_extra_holds_what_the_tool_agent_imports():
    """The install cell installs the `notebook` extra on every runtime: the agent framework must be in it."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0] for r in extras["notebook"]}
    cells = code_cells(load(next(p for p in NOTEBOOKS if p.name == "tool_agent.ipynb")))
    imported = {node.module.split(".")[0] for c in cells for node in ast.walk(ast.parse(source(c)))
                if isinstance(node, ast.ImportFrom) and node.module}
    assert {"langgraph", "langchain_openai", "langchain_core"} <= imported
    # langchain_core comes with both
    assert {"langgraph", "langchain-openai"} <= installed


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


# What art_nb's metadata declares (as importlib.metadata.requires gives it), fixed so the tests do not
# depend on when .venv was installed.
DECLARED = [
    "pydantic>=2.6", "tqdm>=4.66",
    'torch>=2.4; extra == "cpu"', 'transformers>=4.56; extra == "cpu"', 'peft>=0.17; extra == "cpu"',
    'art-nb[cpu]; extra == "gpu"', 'vllm<0.34,>=0.11; extra == "gpu"', 'unsloth>=2025.10; extra == "gpu"',
    'trl>=0.20; extra == "gpu"', 'ipywidgets<9,>=7.7; extra == "notebook"', 'matplotlib>=3.7; extra == "notebook"',
    'pytest>=8; extra == "dev"',
]
MODULES = {"numpy": ["numpy"], "torch": ["torch"], "transformers": ["transformers"], "PIL": ["pillow"],
           "ipywidgets": ["ipywidgets"], "pydantic": ["pydantic"]}


class FakeDistribution:
    def __init__(self, name: str, version: str) -> None:
        self.metadata, self.version = {"Name": name}, version


class FakeMachine:
    """pip, nvidia-smi and package metadata as seen by the install cell and `art_nb.notebook.install`.

    `gpu` is a compute capability ("7.5") or None; `pip_fails` maps a step ("art_nb", "kept", "stack")
    to pip's stderr for a failing run of that step; `after_pip` are the versions the stack install leaves."""

    def __init__(self, gpu: str | None, installed: dict[str, str], after_pip: dict[str, str] | None = None,
                 pip_fails: dict[str, str] | None = None) -> None:
        self.gpu, self.installed, self.after_pip = gpu, dict(installed), after_pip or {}
        self.pip_fails = pip_fails or {}
        self.pip_calls: list[list[str]] = []
        self.constraints: list[str] = []  # the constraints of each stack install, in order

    def which(self, name: str) -> str | None:
        return "/usr/bin/nvidia-smi" if name == "nvidia-smi" and self.gpu else None

    def run(self, cmd, *args, **kwargs):
        if cmd[0] == "nvidia-smi":
            assert any("compute_cap" in part for part in cmd), cmd
            name = "Tesla T4" if self.gpu == "7.5" else "NVIDIA A100-SXM4-40GB"
            return subprocess.CompletedProcess(cmd, 0, f"{name}, {self.gpu}, 15360\n", "")
        assert cmd[1:4] == ["-m", "pip", "install"], cmd
        self.pip_calls.append(list(cmd))
        if "-c" not in cmd:
            step = "art_nb"
        else:
            self.constraints.append(Path(cmd[cmd.index("-c") + 1]).read_text())
            step = "kept" if len(self.constraints) == 1 else "stack"
        if step in self.pip_fails:
            if kwargs.get("capture_output"):
                return subprocess.CompletedProcess(cmd, 1, "", self.pip_fails[step])
            print(self.pip_fails[step])  # pip's own error, shown as it happens
            return subprocess.CompletedProcess(cmd, 1)
        self.installed.update({"art-nb": "0.1.0"} if step == "art_nb" else self.after_pip)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def popen(self, cmd, *args, **kwargs):
        """The cell's `python -m art_nb.notebook.install STATE`, run here with the fakes in place."""
        assert cmd[1:3] == ["-m", "art_nb.notebook.install"], cmd
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = install_step.main(cmd[3:])
        return types.SimpleNamespace(stdout=io.StringIO(out.getvalue()), wait=lambda: code)

    def version(self, dist: str) -> str:
        if dist not in self.installed:
            raise importlib.metadata.PackageNotFoundError(dist)
        return self.installed[dist]

    def distributions(self):
        return [FakeDistribution(name, version) for name, version in self.installed.items()]


@pytest.fixture
def run_install(monkeypatch, tmp_path, capsys):
    real_find_spec = importlib.util.find_spec

    def run(machine: FakeMachine, art_nb_installed: bool = False, imported: tuple[str, ...] = (),
            source: str | None = None) -> str:
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (real_find_spec(name, *a) if art_nb_installed or name != "art_nb" else None))
        monkeypatch.setattr(shutil, "which", machine.which)
        monkeypatch.setattr(subprocess, "run", machine.run)
        monkeypatch.setattr(subprocess, "Popen", machine.popen)
        monkeypatch.setattr(importlib.metadata, "version", machine.version)
        monkeypatch.setattr(importlib.metadata, "distributions", machine.distributions)
        monkeypatch.setattr(importlib.metadata, "requires", lambda name: DECLARED if name == "art-nb" else None)
        monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: MODULES)
        monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: str(tmp_path))
        if source is None:
            monkeypatch.delenv("ART_NB_SOURCE", raising=False)
        else:
            monkeypatch.setenv("ART_NB_SOURCE", source)
        for name in ("numpy", "ipywidgets", "torch", "transformers", "PIL", "tqdm"):
            if name in imported:
                monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
            else:  # the module and its submodules: the cell counts top-level names
                for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                    monkeypatch.delitem(sys.modules, loaded)
        exec(compile(install_source(), "install-cell", "exec"), {})
        return capsys.readouterr().out

    return run


COLAB = {"numpy": "1.26.4", "ipywidgets": "7.7.1", "pillow": "11.1.0", "torch": "2.6.0+cu124",
         "transformers": "4.48.0", "pydantic": "2.10.6"}
NOT_ON_INDEX = ("ERROR: Could not find a version that satisfies the requirement art-nb (from versions: none)\n"
                "ERROR: No matching distribution found for art-nb")


def stack_requirements(call: list[str]) -> set[str]:
    return {part.split("<")[0].split(">")[0] for part in call[5:call.index("-c")]}


def test_install_is_skipped_where_art_nb_is_installed(run_install):
    machine = FakeMachine(gpu="7.5", installed=COLAB)
    out = run_install(machine, art_nb_installed=True)
    assert out.strip() == "art_nb is already installed: skipping the install."
    assert machine.pip_calls == []


def test_t4_gets_the_turing_set_with_vllm_0_11_2_and_keeps_colabs_other_packages(run_install):
    machine = FakeMachine(gpu="7.5", installed=COLAB)
    out = run_install(machine)
    first, stack = machine.pip_calls
    assert first[4:] == ["-q", "art-nb"]  # art_nb itself, from the package index
    assert {"vllm", "unsloth", "trl", "transformers", "peft", "ipywidgets", "matplotlib"} <= stack_requirements(stack)
    assert "pytest" not in stack_requirements(stack)
    pinned = set(machine.constraints[0].splitlines())
    assert {"vllm==0.11.2", "torch==2.9.0", "transformers==4.57.6", "unsloth==2026.10.9", "numpy==1.26.4",
            "ipywidgets==7.7.1", "pillow==11.1.0"} <= pinned
    assert "torch==2.6.0+cu124" not in pinned  # vLLM 0.11.2 needs torch 2.9.0
    assert "turing set (Tesla T4 (sm75)" in out and "vLLM 0.11.2" in out


def test_a100_gets_the_vllm_set_with_its_torch(run_install):
    machine = FakeMachine(gpu="8.0", installed=COLAB)
    out = run_install(machine)
    stack = machine.pip_calls[1]
    assert {"vllm", "unsloth", "trl", "transformers"} <= stack_requirements(stack)
    pinned = set(machine.constraints[0].splitlines())
    assert {"vllm==0.25.0", "torch==2.11.0", "numpy==1.26.4", "ipywidgets==7.7.1", "pillow==11.1.0"} <= pinned
    assert "torch==2.6.0+cu124" not in pinned  # vLLM 0.25 needs torch 2.11
    assert "ampere set" in out


def test_cpu_runtime_gets_the_cpu_set_and_keeps_its_torch(run_install):
    machine = FakeMachine(gpu=None, installed=COLAB)
    run_install(machine)
    stack = machine.pip_calls[1]
    assert {"torch", "transformers", "peft"} <= stack_requirements(stack)
    assert not {"vllm", "unsloth"} & stack_requirements(stack)
    pinned = set(machine.constraints[0].splitlines())
    assert "torch==2.6.0+cu124" in pinned and "torch==2.13.0" not in pinned  # the runtime's torch wins over cpu.txt
    assert "transformers==5.24.0" in pinned


def test_art_nb_source_is_installed_instead_of_the_index(run_install):
    machine = FakeMachine(gpu=None, installed=COLAB)
    out = run_install(machine, source="/content/drive/MyDrive/art_nb")
    assert machine.pip_calls[0][4:] == ["-q", "/content/drive/MyDrive/art_nb"]
    assert "installing art_nb from ART_NB_SOURCE" in out


def test_not_on_the_index_and_no_source_stops_with_one_message_naming_art_nb_source(run_install):
    machine = FakeMachine(gpu="7.5", installed=COLAB, pip_fails={"art_nb": NOT_ON_INDEX})
    with pytest.raises(RuntimeError) as err:
        run_install(machine)
    message = str(err.value)
    assert "ART_NB_SOURCE" in message and "not on the package index" in message
    assert not {"numpy", "ipywidgets", "CalledProcessError"} & set(message.replace("'", " ").split())
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert len(machine.pip_calls) == 1  # nothing else was tried


def test_a_source_pip_cannot_install_shows_pips_reason_without_credentials(run_install):
    failure = "ERROR: git clone https://user:ghp_secret123@github.com/x/art_nb failed: repository not found"
    machine = FakeMachine(gpu=None, installed=COLAB, pip_fails={"art_nb": failure})
    with pytest.raises(RuntimeError) as err:
        run_install(machine, source="git+https://user:ghp_secret123@github.com/x/art_nb")
    message = str(err.value)
    assert message.startswith("pip could not install art_nb from ART_NB_SOURCE") and "repository not found" in message
    assert "ghp_secret123" not in message


def test_one_clear_line_when_an_imported_package_changed(run_install):
    machine = FakeMachine(gpu="7.5", installed=COLAB, after_pip={"transformers": "5.17.0", "numpy": "2.2.0"})
    out = run_install(machine, imported=("transformers",))  # numpy changed too, but was never imported
    restart = [line for line in out.splitlines() if "RESTART" in line]
    assert len(restart) == 1
    assert restart[0].startswith("RESTART NEEDED: transformers 4.48.0 -> 5.17.0 changed after this kernel imported it")
    assert "numpy" not in restart[0]


def test_lets_pip_change_kept_packages_when_the_set_needs_it(run_install):
    machine = FakeMachine(gpu="8.0", installed=COLAB, pip_fails={"kept": "ResolutionImpossible: numpy==1.26.4"})
    out = run_install(machine)
    assert len(machine.pip_calls) == 3
    assert "numpy==1.26.4" in machine.constraints[0] and "numpy==" not in machine.constraints[1]
    assert "vllm==0.25.0" in machine.constraints[1]  # the tested set still holds
    assert "needs other versions of some of numpy 1.26.4, ipywidgets 7.7.1, pillow 11.1.0" in out
    assert "ResolutionImpossible" not in out  # the first try's error is not shown: it was retried


def test_a_stack_pip_cannot_install_stops_the_cell(run_install):
    machine = FakeMachine(gpu="8.0", installed=COLAB, pip_fails={"kept": "conflict", "stack": "ERROR: no vllm for cp313"})
    with pytest.raises(RuntimeError, match="the lines above say why"):
        run_install(machine)
