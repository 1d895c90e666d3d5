"""The `Trainer` protocol: a resident model + LoRA + optimizer that takes GRPO steps and checkpoints.

Trainers are synchronous and run in a worker thread; the backend owns the ordering (pause
inference, train, save, swap adapter, resume). A trainer never decides where files go: it is
handed a directory to fill. Nor does it decide its device or dtype: it is built from the model's
`Plan` (art_nb/local/plan/choices.py), the one owner of automatic choices.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from art_nb.config import TrainConfig
from art_nb.sft_config import TrainSFTConfig
from art_nb.trajectories import Trajectory, TrajectoryGroup
from art_nb.types import ProgressCallback

from ..engines.base import AdapterWeights

__all__ = ["Trainer"]


@runtime_checkable
class Trainer(Protocol):
    tokenizer: Any
    name: str  # "peft" or "unsloth", shown to the user

    def train_step(self, groups: list[TrajectoryGroup], config: TrainConfig,
                   should_stop: Callable[[], bool] | None = None,
                   on_progress: ProgressCallback | None = None,
                   before_update: Callable[[], bool] | None = None) -> dict[str, float]:
        """One GRPO update. Returns metrics; `skipped_nonfinite` = 1 when the update was discarded.

        `should_stop()` is polled between microbatches (True abandons the step before the optimizer
        steps); `on_progress` gets {"phase": "train", "done": k, "total": n} after each microbatch,
        from the trainer's thread. `before_update()` is called, in that thread, after the last
        backward pass and before the weights, optimizer or loss scaler change (the backend waits
        there for the previous checkpoint to be written); False abandons the step (`stopped` = 1).
        """
        ...

    def sft_step(self, trajectories: list[Trajectory], config: TrainSFTConfig,
                 should_stop: Callable[[], bool] | None = None,
                 on_progress: ProgressCallback | None = None) -> dict[str, float]:
        """Supervised fine-tuning on demonstrations: one optimizer step per batch of
        `config.resolved_batch_size` (art_nb.grpo.sft). Returns the call's metrics (per-batch means,
        token and trajectory sums); `skipped_nonfinite` = 1 when no batch was applied.

        `should_stop()` True abandons the call only while no batch has stepped (`stopped` = 1); after
        that it ends early and what was trained is kept (`stopped_early` = 1). `on_progress` gets
        {"phase": "sft", "done": k, "total": n, **batch metrics} after each batch.
        """
        ...

    def save(self, directory: Path) -> None:
        """Write the PEFT adapter (safetensors + config) and optimizer/RNG state into `directory`."""
        ...

    def save_adapter(self, directory: Path) -> None:
        """Write only the PEFT adapter: what an engine needs to serve the step."""
        ...

    def adapter_weights(self) -> AdapterWeights:
        """The adapter as `save_adapter` writes it (same keys, config), as private CPU copies: a step
        hands these to the engine and writes them into the checkpoint later. Refuses (ValueError)
        non-finite weights."""
        ...

    def snapshot_state(self) -> Callable[[Path], None]:
        """Copy what may change before the checkpoint is written (RNG: rollouts draw from it) now; the
        returned function writes that with the optimizer state as it is when called. The optimizer
        state changes only when the next update steps, so the caller must have called it by then
        (`train_step`'s `before_update`)."""
        ...

    def load(self, directory: Path) -> None:
        """Restore adapter weights and optimizer/RNG state written by `save`."""
        ...
