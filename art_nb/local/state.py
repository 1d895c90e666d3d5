"""What the in-process backend keeps per registered model, and the flag a step shares with whoever
interrupts it. Plain data: the runtime, the step and the commit act on it."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from art_nb.config import ModelConfig
from art_nb.store import ModelStore
from art_nb.types import inference_name

if TYPE_CHECKING:
    from .engines.base import Engine
    from .plan.choices import Plan
    from .trainers.base import Trainer

__all__ = ["ModelState", "StepControl", "TrainingStoppedError"]


class TrainingStoppedError(RuntimeError):
    """Too many consecutive updates were non-finite; names the last good checkpoint."""


@dataclass
class StepControl:
    """Shared by a train step and whoever interrupts it."""

    stop: threading.Event = field(default_factory=threading.Event)
    training: bool = False  # the trainer has the step (before this, cancelling is enough)


@dataclass
class ModelState:
    """One registered model: its store, the engine serving it, its trainer, and the served step."""

    model_name: str
    project: str
    base_model: str
    config: ModelConfig
    plan: Plan
    store: ModelStore
    engine: Engine
    trainer: Trainer
    step: int
    choices: dict[str, str] = field(default_factory=dict)  # what was picked automatically, and why
    loaded_adapters: set[int] = field(default_factory=set)
    nonfinite_in_row: int = 0
    train_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The newest step's checkpoint being finished in the background (its seconds when done).
    commit: asyncio.Future[float] | None = None
    commit_seconds: float | None = None  # how long the last one took, for the next step's metrics
    train_metrics: dict[str, float] = field(default_factory=dict)  # what the last step recorded and returned

    def adapter_name(self, step: int) -> str:
        return inference_name(self.model_name, step)
