"""The notebook defaults that suit this machine, each with a reason: what is the notebook's to choose.

The notebooks' parameters cell starts from `pick_defaults()`, so a notebook opened on a Colab T4, an
A100 or a laptop without a GPU runs top to bottom with no edits, and the user sees why each value
was chosen. The notebook chooses the base model's size, the learning rate (by that size, from the
rule in `art_nb.local.plan.rates`), the number of steps and the shapes (games per step, token
limits). Engine, trainer and dtype it does not: `model_config()` leaves them on "auto", and
`report()` shows the plan's choices for that config on this machine with the plan's own reasons
(`plan_for`, a dry run of what register decides). So the table says what will run, and on a T4 the
transformers engine can still take over where vLLM cannot start (`engine_fallback` acts only on
choices that were the plan's).

`pick_defaults(hardware)` is a pure function of a `Hardware` value (the plan package detects it when
None), which is what the unit tests feed it. The policy, in short:

- no CUDA GPU: the offline tiny model (SmolLM2-135M-Instruct), a few small steps (a tic-tac-toe step
  took 130-254 s on a 2-core CPU);
- Turing/Volta (T4 on Colab, sm75): a 0.5B model, because the GPU is slow;
- Ampere and newer (A100, L4, H100: sm80+): a larger model by memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..local.plan import hardware as detection  # detect_hardware looked up per call, as the plan does
from ..local.plan.base_models import TINY_MODEL
from ..local.plan.choices import plan_for
from ..local.plan.hardware import Hardware
from ..local.plan.rates import learning_rate_for
from ..local.plan.versions import stack_differences, stack_for

if TYPE_CHECKING:
    from ..config import ModelConfig

__all__ = ["ChoicesReport", "NotebookDefaults", "pick_defaults"]


@dataclass(frozen=True)
class NotebookDefaults:
    """Values for a notebook's parameters cell, and why each was picked (`reasons[name]`)."""

    hardware: Hardware
    task: str
    base_model: str
    lora_rank: int
    max_seq_len: int
    steps: int
    groups_per_step: int
    rollouts_per_group: int
    learning_rate: float
    eval_games: int
    max_turns: int | None = None  # a limit on turns (2048's moves, the agent's model calls); None: the task ends itself
    reasons: dict[str, str] = field(default_factory=dict)

    def model_config(self, **overrides: Any) -> ModelConfig:
        """The `ModelConfig` these defaults describe; keyword arguments override fields. Engine,
        trainer and dtype stay "auto" unless overridden: the plan picks them, with its reasons."""
        from ..config import LoraConfig, ModelConfig

        values: dict[str, Any] = {"max_seq_len": self.max_seq_len,
                                  "lora": LoraConfig(rank=self.lora_rank, alpha=2 * self.lora_rank)}
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
        return learning_rate_for(base_model, short_run=not self.hardware.has_gpu)

    def report(self, config: ModelConfig | None = None, **chosen: Any) -> ChoicesReport:
        """A table of the values in use (pass the parameters cell's values by name) with the reason
        for each: this machine's when it is the default, "set in the parameters cell" otherwise; the
        learning rate's default is the one for the chosen base model. Then the plan's choices for
        `config` (default: `model_config()`) on this hardware, with the plan's reasons: the ones
        register makes. A last row says whether the installed packages are the set art_nb tested."""
        rows = []
        base_model = chosen.get("base_model", chosen.get("BASE_MODEL", self.base_model))
        for name in ("base_model", "steps", "groups_per_step", "rollouts_per_group", "learning_rate", "max_seq_len",
                     "eval_games", "max_turns"):
            default, reason = getattr(self, name), self.reasons.get(name, "")
            if name == "learning_rate":
                default, reason = self._rate(base_model)
            if default is None:
                continue
            value = chosen.get(name, chosen.get(name.upper(), default))
            rows.append((name, value, reason if value == default else "set in the parameters cell"))
        plan = plan_for(self.model_config() if config is None else config, self.hardware)
        chosen_by_plan = {"dtype": plan.dtype, "engine": plan.engine, "trainer": plan.trainer,
                          "load_in_4bit": plan.load_in_4bit, "cpu_threads": plan.cpu_threads}
        rows += [(name, value, plan.reasons[name]) for name, value in chosen_by_plan.items() if name in plan.reasons]
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

# Per task: (groups per step, rollouts per group, max_seq_len) on CPU and on a GPU; GPU steps.
_TASK_SHAPES: Mapping[str, dict[str, tuple[int, int, int]]] = {
    "tic_tac_toe": {"cpu": (4, 6, 1024), "gpu": (8, 8, 2048)},
    "2048": {"cpu": (3, 4, 2048), "gpu": (8, 8, 4096)},
    "custom": {"cpu": (4, 6, 1024), "gpu": (8, 8, 2048)},
    "tool_agent": {"cpu": (4, 6, 1536), "gpu": (8, 8, 4096)},
}

# Per task with a turn limit: (limit, why) on CPU and on a GPU.
_TURN_LIMITS: Mapping[str, dict[str, tuple[int, str]]] = {
    "2048": {"cpu": (10, "10 moves per game: long conversations are the slow part on a CPU"),
             "gpu": (40, "40 moves per game: reaching the 64 tile takes about 27")},
    "tool_agent": {"cpu": (3, "3 model calls per question: the two-lookup questions need exactly 3"),
                   "gpu": (6, "6 model calls per question: room to retry a failed lookup")},
}


def pick_defaults(hardware: Hardware | None = None, task: str = "tic_tac_toe") -> NotebookDefaults:
    """Notebook defaults for `hardware` (detected when None) and `task`, each with its reason."""
    if task not in _TASK_SHAPES:
        raise ValueError(f"task is {task!r}; expected one of {', '.join(_TASK_SHAPES)}")
    hw = detection.detect_hardware() if hardware is None else hardware
    if not hw.has_gpu:
        return _cpu_defaults(hw, task)
    return _gpu_defaults(hw, task)


def _shared_reasons(task: str, seq: int) -> dict[str, str]:
    return {
        "rollouts_per_group": "enough rollouts that rewards within a group differ",
        "max_seq_len": f"{seq} tokens hold the longest {task.replace('_', '-')} conversation used here",
        "eval_games": (f"fixed {'questions' if task == 'tool_agent' else 'games'} scored greedily, the same for "
                       "the base model and the trained one"),
    }


def _cpu_defaults(hw: Hardware, task: str) -> NotebookDefaults:
    groups, rollouts, seq = _TASK_SHAPES[task]["cpu"]
    turns, turns_why = _TURN_LIMITS.get(task, {}).get("cpu", (None, ""))
    steps = 8
    rate, rate_why = learning_rate_for(TINY_MODEL, short_run=True)
    return NotebookDefaults(
        hardware=hw, task=task, base_model=TINY_MODEL, lora_rank=16, max_seq_len=seq, steps=steps,
        groups_per_step=groups, rollouts_per_group=rollouts, learning_rate=rate, eval_games=32,
        max_turns=turns,
        reasons={
            **_shared_reasons(task, seq),
            "max_turns": turns_why,
            "base_model": "no GPU: the 135M model runs on a CPU and has an offline copy (no download needed)",
            "steps": (f"a few steps: a tic-tac-toe step took 130-254 s on 2 CPU cores (the CPU demo); "
                      f"{hw.cpu_count} here"),
            "groups_per_step": f"{groups} groups x {rollouts} rollouts keep a CPU step short",
            "learning_rate": rate_why,
        },
    )


def _gpu_defaults(hw: Hardware, task: str) -> NotebookDefaults:
    assert hw.gpu_capability is not None and hw.gpu_memory_gib is not None
    groups, rollouts, seq = _TASK_SHAPES[task]["gpu"]
    turns, turns_why = _TURN_LIMITS.get(task, {}).get("gpu", (None, ""))
    if hw.gpu_capability < (8, 0):
        # A T4 is slow at anything (65 fp16 TFLOPS, 320 GB/s), and slower still on the transformers engine,
        # which serves when vLLM cannot start there: a 0.5B model keeps steps short.
        base_model = "Qwen/Qwen2.5-0.5B-Instruct"
        model_why = f"{hw.gpu_name} ({hw.sm}) is a slow GPU: a 0.5B model keeps steps short"
    else:
        memory = hw.gpu_memory_gib
        base_model = next(m for floor, m in _GPU_MODELS if memory >= floor)
        model_why = f"{memory:.0f} GiB on {hw.gpu_name}: room to serve and LoRA-train {base_model.split('/')[-1]}"
    steps = 20
    rate, rate_why = learning_rate_for(base_model, short_run=False)
    return NotebookDefaults(
        hardware=hw, task=task, base_model=base_model, lora_rank=16, max_seq_len=seq, steps=steps,
        groups_per_step=groups, rollouts_per_group=rollouts, learning_rate=rate, eval_games=64,
        max_turns=turns,
        reasons={
            **_shared_reasons(task, seq),
            "max_turns": turns_why,
            "base_model": model_why,
            "steps": f"{steps} steps: enough for the reward curve to climb on a GPU",
            "groups_per_step": f"{groups} groups x {rollouts} rollouts: a GPU serves them in one batch",
            "learning_rate": rate_why,
        },
    )
