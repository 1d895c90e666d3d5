"""What this machine is (Colab or not, which GPU) and the notebook defaults that suit it, each with a reason.

The notebooks' parameters cell starts from `pick_defaults()`, so a notebook opened on a Colab T4, an
A100 or a laptop without a GPU runs top to bottom with no edits, and the user sees why each value
was chosen. Detection is separate from the policy: `pick_defaults(hardware)` is a pure function of
a `Hardware` value, which is what the unit tests feed it.

The policy, in short:

- no CUDA GPU: the offline tiny model (SmolLM2-135M-Instruct), float32, transformers engine +
  peft trainer, a few small steps (a tic-tac-toe step took 130-254 s on a 2-core CPU);
- Turing/Volta (T4 on Colab, sm75): float16 (no bf16 there), vLLM 0.11.2 where the T4 set installed it
  (else the transformers engine: `versions.gpu_path_for`), Unsloth training, a 0.5B model;
- Ampere and newer (A100, L4, H100: sm80+): bfloat16, vLLM, Unsloth, a larger model by memory.

The learning rate follows the model's size (`learning_rate_for_size`), not the hardware row, so a
base model set in the parameters cell (or injected by papermill) gets a rate that learns with it:
SmolLM2-135M with the 7B model's 2e-5 did not move its evaluation in 12 steps on an H200, at 2e-4 it
learned. `NotebookDefaults.learning_rate_for(BASE_MODEL, LEARNING_RATE)` applies the rule unless the
user set a rate.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..local.plan.base_models import TINY_MODEL
from ..local.plan.choices import compute_dtype
from ..local.plan.memory import count_parameters
from ..local.plan.versions import gpu_path_for, installed_version, stack_differences, stack_for

if TYPE_CHECKING:
    from ..config import ModelConfig

__all__ = ["Hardware", "NotebookDefaults", "detect_hardware", "from_nvidia_smi", "in_colab", "learning_rate_for_size",
           "parameter_count", "pick_defaults"]

TASKS = ("tic_tac_toe", "2048", "custom")


def in_colab() -> bool:
    """True inside a Google Colab runtime (its kernel sets COLAB_RELEASE_TAG and ships google.colab)."""
    if os.environ.get("COLAB_RELEASE_TAG"):
        return True
    try:
        return importlib.util.find_spec("google.colab") is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class Hardware:
    """The facts the defaults depend on. `gpu_*` are None without a CUDA GPU."""

    in_colab: bool = False
    cpu_count: int = 1
    gpu_name: str | None = None
    gpu_capability: tuple[int, int] | None = None
    gpu_memory_gib: float | None = None
    vllm_version: str | None = None
    unsloth_installed: bool = False

    @property
    def has_gpu(self) -> bool:
        return self.gpu_capability is not None

    @property
    def sm(self) -> str:
        return "" if self.gpu_capability is None else f"sm{self.gpu_capability[0]}{self.gpu_capability[1]}"

    def describe(self) -> str:
        where = "Colab" if self.in_colab else "this machine"
        if not self.has_gpu:
            return f"{where}: no CUDA GPU, {self.cpu_count} CPU cores"
        return f"{where}: {self.gpu_name} ({self.sm}, {self.gpu_memory_gib:.0f} GiB), {self.cpu_count} CPU cores"


def detect_hardware() -> Hardware:
    """Look at this machine: torch's view of CUDA when torch is installed, else `nvidia-smi`."""
    base = Hardware(
        in_colab=in_colab(),
        cpu_count=os.cpu_count() or 1,
        vllm_version=installed_version("vllm"),
        unsloth_installed=importlib.util.find_spec("unsloth") is not None,
    )
    if importlib.util.find_spec("torch") is not None:
        import torch

        if not torch.cuda.is_available():
            return base
        props = torch.cuda.get_device_properties(0)
        return replace(base, gpu_name=props.name, gpu_capability=(props.major, props.minor),
                       gpu_memory_gib=props.total_memory / 1024**3)
    return from_nvidia_smi(base)


def from_nvidia_smi(base: Hardware) -> Hardware:
    """`base` with the first GPU `nvidia-smi` reports (unchanged without one): no torch needed, so the
    install cell can ask before torch is installed or imported."""
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


@dataclass(frozen=True)
class NotebookDefaults:
    """Values for a notebook's parameters cell, and why each was picked (`reasons[name]`)."""

    hardware: Hardware
    task: str
    base_model: str
    dtype: str
    engine: str
    trainer: str
    load_in_4bit: bool
    lora_rank: int
    max_seq_len: int
    steps: int
    groups_per_step: int
    rollouts_per_group: int
    learning_rate: float
    eval_games: int
    max_turns: int | None = None  # games with a turn limit (2048); None where the game ends by itself
    reasons: dict[str, str] = field(default_factory=dict)

    def model_config(self, **overrides: Any) -> ModelConfig:
        """The `ModelConfig` these defaults describe; keyword arguments override fields."""
        from ..config import LoraConfig, ModelConfig

        values: dict[str, Any] = {
            "engine": self.engine, "trainer": self.trainer, "dtype": self.dtype, "load_in_4bit": self.load_in_4bit,
            "max_seq_len": self.max_seq_len, "lora": LoraConfig(rank=self.lora_rank, alpha=2 * self.lora_rank),
        }
        values.update(overrides)
        return ModelConfig(**values)

    def learning_rate_for(self, base_model: str, learning_rate: float) -> float:
        """`learning_rate` when the user set one, else the rate for `base_model`'s size (the parameters
        cell's default was picked for the default model, which the user may have replaced)."""
        if learning_rate != self.learning_rate:
            return learning_rate
        return self._rate(base_model)[0]

    def _rate(self, base_model: str) -> tuple[float, str]:
        if base_model == self.base_model:
            return self.learning_rate, self.reasons.get("learning_rate", "")
        return learning_rate_for_size(parameter_count(base_model), self.hardware.has_gpu, self.learning_rate)

    def report(self, **chosen: Any) -> ChoicesReport:
        """A table of the values in use (pass the parameters cell's values by name) with the reason
        for each: the hardware's when it is the default, "set in the parameters cell" otherwise; the
        learning rate's default is the one for the chosen base model. A last row says whether the
        installed packages are the set art_nb tested on this hardware."""
        rows = []
        base_model = chosen.get("base_model", chosen.get("BASE_MODEL", self.base_model))
        for name in ("base_model", "steps", "groups_per_step", "rollouts_per_group", "learning_rate", "max_seq_len",
                     "eval_games", "max_turns", "dtype", "engine", "trainer"):
            default, reason = getattr(self, name), self.reasons.get(name, "")
            if name == "learning_rate":
                default, reason = self._rate(base_model)
            if default is None:
                continue
            value = chosen.get(name, chosen.get(name.upper(), default))
            rows.append((name, value, reason if value == default else "set in the parameters cell"))
        stack = stack_for(self.hardware.gpu_capability)
        differences = [f"{name} {version} (tested {pinned})" for name, version, pinned in stack_differences(stack)]
        rows.append(("packages", f"{stack} set", "as art_nb tested them" if not differences else
                     "differ from the set art_nb tested: " + ", ".join(differences)))
        return ChoicesReport(self.hardware.describe(), rows)


@dataclass(frozen=True)
class ChoicesReport:
    """What the notebook will use and why; shows as a table in Jupyter and as text elsewhere."""

    header: str
    rows: list[tuple[str, Any, str]]

    def __str__(self) -> str:
        width = max(len(name) for name, _, _ in self.rows)
        lines = [self.header]
        lines += [f"  {name:<{width}}  {value!s:<28} {why}" for name, value, why in self.rows]
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        lines = [f"**{self.header}**", "", "| parameter | value | why |", "|---|---|---|"]
        lines += [f"| `{name}` | `{value}` | {why.replace('|', '/')} |" for name, value, why in self.rows]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)


# The larger models for GPUs, by memory; each fits LoRA training next to vLLM with room to spare.
_GPU_MODELS: tuple[tuple[float, str], ...] = (
    # (at least this many GiB, base model)
    (70.0, "Qwen/Qwen2.5-7B-Instruct"),
    (35.0, "Qwen/Qwen2.5-3B-Instruct"),
    (20.0, "Qwen/Qwen2.5-1.5B-Instruct"),
    (0.0, "Qwen/Qwen2.5-0.5B-Instruct"),
)

# LoRA learning rate by model size: smaller models take larger steps. (fewer parameters than, rate, why)
_RATES: tuple[tuple[float, float, str], ...] = (
    (0.3e9, 2e-4, "SmolLM2-135M learned tic-tac-toe on an H200 at 2e-4 (reward -0.73 -> 0.13 in 14 steps) "
                  "and did not move at 2e-5"),
    (2e9, 1e-4, "the usual LoRA rate for 0.5-1.5B models (not measured by art_nb)"),
    (5e9, 5e-5, "the usual LoRA rate for 3B models (not measured by art_nb)"),
    (math.inf, 2e-5, "the usual LoRA rate for 7B and larger models (not measured by art_nb)"),
)
# A CPU run is 8 short steps (24 games each): the smallest models take a larger rate there.
_CPU_SMALL_RATE = (5e-4, "with 24 games a step, LoRA on a 135M model learns legal moves in 4-6 steps "
                         "(the CPU demo: 2e-4 for 3 steps did not move, 5e-4 for 8 did)")
_SIZE_IN_NAME = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)([mb])(?![a-z])", re.IGNORECASE)


def parameter_count(base_model: str) -> int | None:
    """Parameters of `base_model`: read from a local directory's safetensors headers, else from the
    size in its name ("SmolLM2-135M", "Qwen2.5-0.5B", "Llama-3.2-1B"); None when neither says."""
    path = os.path.expanduser(base_model)
    if os.path.isdir(path):
        return count_parameters(path) or None
    found = _SIZE_IN_NAME.search(base_model.rsplit("/", 1)[-1].replace("_", "-"))
    if found is None:
        return None
    return int(float(found.group(1)) * (1e6 if found.group(2).lower() == "m" else 1e9))


def learning_rate_for_size(parameters: int | None, on_gpu: bool, unknown: float) -> tuple[float, str]:
    """(learning rate, why) for a model of `parameters`; `unknown` (with a reason saying so) when the
    size is not known."""
    if parameters is None:
        return unknown, (f"{unknown:g}: this hardware's default; the model's size is not in its name, "
                         "so set LEARNING_RATE for it if it does not learn")
    size = f"{parameters / 1e9:.1f}B" if parameters >= 1e9 else f"{parameters / 1e6:.0f}M"
    floor, rate, why = next(band for band in _RATES if parameters < band[0])
    if not on_gpu and floor == _RATES[0][0]:
        rate, why = _CPU_SMALL_RATE
    return rate, f"{rate:g} for a {size} model: {why}"

# Per task: (groups per step, rollouts per group, max_seq_len) on CPU and on a GPU; GPU steps.
_TASK_SHAPES: Mapping[str, dict[str, tuple[int, int, int]]] = {
    "tic_tac_toe": {"cpu": (4, 6, 1024), "gpu": (8, 8, 2048)},
    "2048": {"cpu": (3, 4, 2048), "gpu": (8, 8, 4096)},
    "custom": {"cpu": (4, 6, 1024), "gpu": (8, 8, 2048)},
}


def pick_defaults(hardware: Hardware | None = None, task: str = "tic_tac_toe") -> NotebookDefaults:
    """Notebook defaults for `hardware` (detected when None) and `task`, each with its reason."""
    if task not in _TASK_SHAPES:
        raise ValueError(f"task is {task!r}; expected one of {', '.join(_TASK_SHAPES)}")
    hw = detect_hardware() if hardware is None else hardware
    if not hw.has_gpu:
        return _cpu_defaults(hw, task)
    return _gpu_defaults(hw, task)


def _cpu_defaults(hw: Hardware, task: str) -> NotebookDefaults:
    groups, rollouts, seq = _TASK_SHAPES[task]["cpu"]
    steps = 8
    rate, rate_why = learning_rate_for_size(parameter_count(TINY_MODEL), False, _CPU_SMALL_RATE[0])
    return NotebookDefaults(
        hardware=hw, task=task, base_model=TINY_MODEL, dtype="float32", engine="hf", trainer="peft",
        load_in_4bit=False, lora_rank=16, max_seq_len=seq, steps=steps, groups_per_step=groups,
        rollouts_per_group=rollouts, learning_rate=rate, eval_games=32, max_turns=10 if task == "2048" else None,
        reasons={
            "max_turns": "10 moves per game: long conversations are the slow part on a CPU",
            "base_model": "no GPU: the 135M model runs on a CPU and has an offline copy (no download needed)",
            "dtype": "float32: CPUs have slow or emulated 16-bit matmuls",
            "engine": "transformers: vLLM needs a CUDA GPU",
            "trainer": "peft: Unsloth needs a CUDA GPU",
            "steps": (f"a few steps: a tic-tac-toe step took 130-254 s on 2 CPU cores (the CPU demo); "
                      f"{hw.cpu_count} here"),
            "groups_per_step": f"{groups} groups x {rollouts} rollouts keep a CPU step short",
            "rollouts_per_group": "enough rollouts that rewards within a group differ",
            "learning_rate": rate_why,
            "max_seq_len": f"{seq} tokens hold the longest {task.replace('_', '-')} conversation used here",
            "eval_games": "fixed games scored greedily, the same for the base model and the trained one",
        },
    )


def _gpu_defaults(hw: Hardware, task: str) -> NotebookDefaults:
    assert hw.gpu_capability is not None and hw.gpu_memory_gib is not None
    groups, rollouts, seq = _TASK_SHAPES[task]["gpu"]
    engine, engine_why = gpu_path_for(hw.gpu_capability, hw.vllm_version)
    # The rule the trainer and the engines follow (art_nb/local/plan/choices.py): the notebook shows what runs.
    dtype, dtype_why = compute_dtype("auto", "cuda", hw.gpu_capability)
    if hw.gpu_capability < (8, 0):
        # A T4 is slow at anything (65 fp16 TFLOPS, 320 GB/s), and slower still on the transformers engine,
        # which serves when vLLM 0.11.2 is absent or cannot start: a 0.5B model keeps a step near a minute.
        base_model = "Qwen/Qwen2.5-0.5B-Instruct"
        served = f"vLLM {hw.vllm_version}" if engine == "vllm" else "the transformers engine"
        model_why = (f"{hw.gpu_name} ({hw.sm}) serves with {served} on a slow GPU: a 0.5B model keeps steps short")
    else:
        memory = hw.gpu_memory_gib
        base_model = next(m for floor, m in _GPU_MODELS if memory >= floor)
        model_why = f"{memory:.0f} GiB on {hw.gpu_name}: room to serve and LoRA-train {base_model.split('/')[-1]}"
    trainer = "unsloth" if hw.unsloth_installed else "peft"
    trainer_why = ("Unsloth: installed with the gpu extra; faster LoRA training and less memory"
                   if hw.unsloth_installed else "peft: Unsloth is not installed (pip install 'art-nb[gpu]')")
    steps = 20
    lr, rate_why = learning_rate_for_size(parameter_count(base_model), True, _RATES[-1][1])
    return NotebookDefaults(
        hardware=hw, task=task, base_model=base_model, dtype=dtype,
        engine=engine, trainer=trainer, load_in_4bit=False, lora_rank=16, max_seq_len=seq, steps=steps,
        groups_per_step=groups, rollouts_per_group=rollouts, learning_rate=lr, eval_games=64,
        max_turns=40 if task == "2048" else None,
        reasons={
            "max_turns": "40 moves per game: reaching the 64 tile takes about 27",
            "base_model": model_why,
            "dtype": dtype_why,
            "engine": engine_why,
            "trainer": trainer_why,
            "steps": f"{steps} steps: enough for the reward curve to climb on a GPU",
            "groups_per_step": f"{groups} groups x {rollouts} rollouts: a GPU serves them in one batch",
            "rollouts_per_group": "enough rollouts that rewards within a group differ",
            "learning_rate": rate_why,
            "max_seq_len": f"{seq} tokens hold the longest {task.replace('_', '-')} conversation used here",
            "eval_games": "fixed games scored greedily, the same for the base model and the trained one",
        },
    )
