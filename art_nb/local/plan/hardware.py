"""What this machine is: its GPU (if any) and the releases of the GPU stack installed. Read here and nowhere else.

The plan (`choices.plan_for`) is a pure function of a `ModelConfig` and a `Hardware` value, so the
same rules run at register (on the detected machine), in a notebook's parameters cell before
anything loads (a dry run that shows the choices register will make), and in tests (on a simulated
T4 or A100). Package versions come from metadata, never from importing the package: vLLM and
Unsloth take tens of seconds to import and patch what they touch.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from .versions import installed_version

__all__ = ["PACKAGES", "Hardware", "detect_hardware", "from_nvidia_smi"]

PACKAGES = ("vllm", "unsloth", "trl", "torch", "transformers", "bitsandbytes")
"""The distributions the plan's choices depend on (vLLM's CPU build counts as vllm)."""


@dataclass(frozen=True)
class Hardware:
    """The facts the plan and the notebook defaults read. `gpu_*` are None without a CUDA GPU;
    `packages` maps each of PACKAGES to its installed version, None (or absent) when not installed."""

    cpu_count: int = 1
    gpu_name: str | None = None
    gpu_capability: tuple[int, int] | None = None
    gpu_memory_gib: float | None = None
    packages: Mapping[str, str | None] = field(default_factory=dict)

    @property
    def has_gpu(self) -> bool:
        return self.gpu_capability is not None

    @property
    def sm(self) -> str:
        return "" if self.gpu_capability is None else f"sm{self.gpu_capability[0]}{self.gpu_capability[1]}"

    def version(self, package: str) -> str | None:
        return self.packages.get(package)

    def describe(self) -> str:
        if not self.has_gpu:
            return f"no CUDA GPU, {self.cpu_count} CPU cores"
        memory = "" if self.gpu_memory_gib is None else f", {self.gpu_memory_gib:.0f} GiB"
        return f"{self.gpu_name} ({self.sm}{memory}), {self.cpu_count} CPU cores"


def detect_hardware() -> Hardware:
    """This machine: torch's view of CUDA when torch is installed (what the engines and trainers will
    use), else `nvidia-smi`'s; the installed versions of PACKAGES from metadata."""
    base = Hardware(cpu_count=os.cpu_count() or 1, packages={name: installed_version(name) for name in PACKAGES})
    if importlib.util.find_spec("torch") is None:
        return from_nvidia_smi(base)
    import torch

    if not torch.cuda.is_available():
        return base
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return replace(base, gpu_name=props.name, gpu_capability=(int(props.major), int(props.minor)),
                   gpu_memory_gib=props.total_memory / 1024**3)


def from_nvidia_smi(base: Hardware) -> Hardware:
    """`base` with the first GPU `nvidia-smi` reports (unchanged without one): no torch needed, so the
    notebooks' install cell can ask before torch is installed or imported."""
    if shutil.which("nvidia-smi") is None:
        return base
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.splitlines()[0]
        name, capability, memory_mib = (part.strip() for part in out.split(","))
        major, minor = (int(x) for x in capability.split("."))
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return base
    return replace(base, gpu_name=name, gpu_capability=(major, minor), gpu_memory_gib=float(memory_mib) / 1024)
