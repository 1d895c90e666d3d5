"""What the in-process backend keeps per registered model, and the flag a step shares with whoever
interrupts it. Plain data: the runtime, the step and the commit act on it."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from art_nb.config import ModelConfig
from art_nb.store import ModelStore
from art_nb.types import inference_name

if TYPE_CHECKING:
    from .engines.base import Engine
    from .plan.choices import Plan
    from .trainers.base import Trainer

__all__ = ["LoadedAdapters", "ModelState", "StepControl", "TrainingStoppedError"]


class TrainingStoppedError(RuntimeError):
    """Too many consecutive updates were non-finite; names the last good checkpoint."""


@dataclass
class StepControl:
    """Shared by a train step and whoever interrupts it."""

    stop: threading.Event = field(default_factory=threading.Event)
    training: bool = False  # the trainer has the step (before this, cancelling is enough)


class LoadedAdapters:
    """The steps whose adapters the engine holds for one model, least recently used first.

    Bounded (`ModelConfig.max_loaded_adapters`): each old step a client asks for as `name@step` is
    loaded on demand, and without a bound every one stayed loaded (12.8 MB a step on SmolLM2, never
    given back). A step is pinned while a request that resolved it has not finished, so it is not
    unloaded between the resolve and the engine taking the request; the served step is never a
    candidate. Pure bookkeeping: `adapters.py` loads and unloads.
    """

    def __init__(self) -> None:
        self._order: dict[int, None] = {}  # insertion order = use order, oldest first
        self._pins: Counter[int] = Counter()

    def __contains__(self, step: object) -> bool:
        return step in self._order

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)

    def add(self, step: int) -> None:
        """`step` is loaded, and used now (most recently used)."""
        self._order.pop(step, None)
        self._order[step] = None

    def discard(self, step: int) -> None:
        self._order.pop(step, None)
        self._pins.pop(step, None)

    def clear(self) -> None:
        self._order.clear()
        self._pins.clear()

    def pin(self, step: int) -> None:
        self._pins[step] += 1

    def unpin(self, step: int) -> None:
        if self._pins[step] <= 1:
            self._pins.pop(step, None)
        else:
            self._pins[step] -= 1

    def beyond(self, capacity: int, keep: int) -> list[int]:
        """The least recently used unpinned steps other than `keep` that take the count over `capacity`
        (fewer when pinned ones hold it over: they go once released)."""
        excess = len(self._order) - capacity
        candidates = [s for s in self._order if s != keep and not self._pins[s]]
        return candidates[:max(excess, 0)]


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
    loaded_adapters: LoadedAdapters = field(default_factory=LoadedAdapters)
    adapter_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # loads and unloads of old steps, one at a time
    nonfinite_in_row: int = 0
    train_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The newest step's checkpoint being finished in the background (its seconds when done).
    commit: asyncio.Future[float] | None = None
    commit_seconds: float | None = None  # how long the last one took, for the next step's metrics
    train_metrics: dict[str, float] = field(default_factory=dict)  # what the last step recorded and returned

    def adapter_name(self, step: int) -> str:
        return inference_name(self.model_name, step)
