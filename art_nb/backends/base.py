"""The `Backend` protocol: everything a model handle asks of whatever serves and trains it.

`LocalBackend` (in this kernel), `RemoteBackend` (a GPU server over HTTP) and `ServerlessBackend`
(a hosted API) implement the same methods, so a notebook swaps one object and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..config import TrainConfig
from ..trajectory import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from ..model import Model, TrainableModel

__all__ = ["Backend", "TrainResult", "InferenceEndpoint", "ProgressCallback", "checkpoint_written"]

ProgressCallback = Callable[[dict[str, Any]], None]
"""Receives train-progress events: {"phase": "train", "done": k, "total": n, ...}."""


@dataclass(frozen=True)
class TrainResult:
    """What one `train` call did: the step now served, and the step's metrics."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class InferenceEndpoint:
    base_url: str
    api_key: str = field(repr=False)


@runtime_checkable
class Backend(Protocol):
    async def register(self, model: Model) -> None:
        """Make `model` servable (and trainable). Idempotent: a second call reuses what runs."""
        ...

    def inference_endpoint(self, model: Model) -> InferenceEndpoint: ...

    def inference_model_name(self, model: Model, step: int | None = None) -> str: ...

    async def get_step(self, model: TrainableModel) -> int: ...

    async def train(
        self,
        model: TrainableModel,
        groups: Iterable[TrajectoryGroup],
        config: TrainConfig | None = None,
        *,
        on_progress: ProgressCallback | None = None,
    ) -> TrainResult: ...

    async def log(
        self,
        model: Model,
        trajectories: Iterable[TrajectoryGroup | Trajectory],
        split: str = "val",
        step: int | None = None,
        metrics: dict[str, float] | None = None,
    ) -> dict[str, float]: ...

    async def delete_checkpoints(
        self, model: TrainableModel, steps: Iterable[int] | None = None, keep_last: int = 1
    ) -> list[int]: ...

    async def close(self) -> None: ...


async def checkpoint_written(backend: Any, model: TrainableModel) -> None:
    """Wait until `backend` has the served step's checkpoint on disk, for callers about to read it.

    `LocalBackend` finishes a step's checkpoint in the background (`wait_for_checkpoint`); the
    other backends have theirs complete when `train` returns.
    """
    wait = getattr(backend, "wait_for_checkpoint", None)
    if wait is not None:
        await wait(model)
