"""The notebooks' install cell, run for real in a fresh Colab-like venv: torch, numpy and ipywidgets
installed, art_nb not, no system site-packages.

Without ART_NB_SOURCE (and an index that has no art-nb) the cell stops with one message naming
ART_NB_SOURCE; with ART_NB_SOURCE pointing at a copy of this checkout it installs art_nb and the CPU
set (this machine has no GPU), keeps the venv's numpy, ipywidgets and torch, and ships the constraint
files inside the package. The unit tests (tests/unit/test_notebooks_clean.py) cover the GPU branches
against fakes of pip and nvidia-smi.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]
COLAB_LIKE = ["torch==2.13.0", "numpy", "ipywidgets"]  # what a Colab runtime has before the cell runs


def install_cell() -> str:
    notebook = json.loads((ROOT / "notebooks" / "tic_tac_toe.ipynb").read_text())
    return "".join(next(c for c in notebook["cells"] if c["cell_type"] == "code")["source"])


def versions(python: Path, *names: str) -> dict[str, str | None]:
    code = ("import json, importlib.metadata as m, sys\n"
            "def v(n):\n    try:\n        return m.version(n)\n    except m.PackageNotFoundError:\n        return None\n"
            "print(json.dumps({n: v(n) for n in sys.argv[1:]}))")
    # cwd: not this checkout, whose art_nb.egg-info a `python -c` would find first
    return json.loads(subprocess.run([str(python), "-c", code, *names], capture_output=True, text=True,
                                     check=True, cwd=python.parents[2]).stdout)


@pytest.fixture(scope="module")
def colab(tmp_path_factory):
    """(python of a fresh venv holding only torch, numpy, ipywidgets; a copy of this checkout; the cell)."""
    root = tmp_path_factory.mktemp("colab")
    venv = root / "venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
        python = venv / "bin" / "python"
        # --no-compile: byte-compiling torch's ~2,800 modules is time the test needs nothing from
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check",
                        *COLAB_LIKE], check=True, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or ""
        pytest.skip(f"could not build a Colab-like venv ({' '.join(COLAB_LIKE)}) from this machine's package "
                    f"index: {error} {str(detail)[-500:]}")
    checkout = root / "art_nb-checkout"  # what a user's Drive checkout holds; built there, not in this tree
    checkout.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, checkout / name)
    shutil.copytree(ROOT / "art_nb", checkout / "art_nb", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    cell = root / "install_cell.py"
    cell.write_text(install_cell())
    return python, checkout, cell


def run_cell(python: Path, cell: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), str(cell)], capture_output=True, text=True, env=env, timeout=1500,
                          cwd=cell.parent)


def test_without_a_source_the_cell_names_art_nb_source(colab, tmp_path):
    python, _, cell = colab
    empty_index = tmp_path / "index"  # an index without art-nb, so the answer never depends on the network
    empty_index.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "ART_NB_SOURCE"}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": empty_index.as_uri()}
    done = run_cell(python, cell, env)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: art_nb is not on the package index this runtime uses: set ART_NB_SOURCE")
    assert "CalledProcessError" not in done.stderr and "numpy" not in done.stderr + done.stdout
    assert done.stdout.strip() == "installing art_nb from the package index"
    assert versions(python, "art-nb")["art-nb"] is None


def test_with_art_nb_source_it_installs_the_cpu_set_and_keeps_the_runtimes_packages(colab):
    python, checkout, cell = colab
    kept = ("numpy", "ipywidgets", "torch")
    before = versions(python, *kept)
    env = {**os.environ, "ART_NB_SOURCE": str(checkout), "PATH": os.defpath}  # no nvidia-smi: a CPU runtime
    done = run_cell(python, cell, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "installing art_nb from ART_NB_SOURCE"
    assert lines[1].startswith("installing art_nb's cpu set (no GPU")
    assert lines[-1] == "art_nb installed with the cpu set; no restart needed."
    assert versions(python, *kept) == before  # the runtime's own copies stayed

    check = ("import art_nb, transformers, peft, matplotlib\n"
             "from art_nb.local.plan.versions import constraints_file, check_stack\n"
             "print(constraints_file('turing').is_file(), check_stack('cpu'))")
    shipped = subprocess.run([str(python), "-c", check], capture_output=True, text=True, cwd=cell.parent)
    assert shipped.returncode == 0, shipped.stderr[-2000:]
    assert shipped.stdout.strip() == "True []"  # the constraint files ship inside the package; the CPU set holds

    again = run_cell(python, cell, env)
    assert again.stdout.strip() == "art_nb is already installed: skipping the install."
