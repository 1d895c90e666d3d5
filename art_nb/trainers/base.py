"""The `Trainer` protocol: a resident model + LoRA + optimizer that takes GRPO steps and checkpoints.

Trainers are synchronous and run in a worker thread; the backend owns the ordering (pause
inference, train, save, swap adapter, resume). A trainer never decides where files go: it is
handed a directory to fill.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..config import TrainConfig
from ..trajectory import TrajectoryGroup

__all__ = ["Trainer", "ADAPTER_FILES", "TRAINER_STATE"]

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
TRAINER_STATE = "trainer_state.pt"


@runtime_checkable
class Trainer(Protocol):
    tokenizer: Any
    name: str  # "peft" or "unsloth", shown to the user

    def train_step(self, groups: list[TrajectoryGroup], config: TrainConfig, should_stop: Any = None) -> dict[str, float]:
        """One GRPO update. Returns metrics; `skipped_nonfinite` = 1 when the update was discarded."""
        ...

    def save(self, directory: Path) -> None:
        """Write the PEFT adapter (safetensors + config) and optimizer/RNG state into `directory`."""
        ...

    def save_adapter(self, directory: Path) -> None:
        """Write only the PEFT adapter: what an engine needs to serve the step."""
        ...

    def snapshot_state(self) -> Callable[[Path], None]:
        """Copy optimizer/RNG state now; the returned function writes it into a directory later."""
        ...

    def load(self, directory: Path) -> None:
        """Restore adapter weights and optimizer/RNG state written by `save`."""
        ...
