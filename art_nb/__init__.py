"""art_nb: train multi-step LLM agents with GRPO + LoRA from a notebook.

Importing this package loads no torch, vLLM, Unsloth or ipywidgets: engines and trainers load
when a backend first needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__
from .backends.base import Backend
from .config import LoraConfig, ModelConfig, TrainConfig
from .gather import (
    DatasetBatch,
    TooManyExceptionsError,
    gather_trajectories,
    gather_trajectory_groups,
    iterate_dataset,
    limit_concurrency,
    retry,
)
from .model import Model, TrainableModel
from .trajectory import Trajectory, TrajectoryGroup
from .types import TrainResult

if TYPE_CHECKING:
    from .backends.local import LocalBackend
    from .backends.remote import RemoteBackend
    from .backends.serverless import ServerlessBackend

__all__ = [
    "Backend",
    "DatasetBatch",
    "LocalBackend",
    "LoraConfig",
    "Model",
    "RemoteBackend",
    "ServerlessBackend",
    "ModelConfig",
    "TooManyExceptionsError",
    "TrainConfig",
    "TrainResult",
    "TrainableModel",
    "Trajectory",
    "TrajectoryGroup",
    "__version__",
    "gather_trajectories",
    "gather_trajectory_groups",
    "iterate_dataset",
    "limit_concurrency",
    "retry",
]


def __getattr__(name: str) -> Any:
    """Backends load on first use, so `import art_nb` stays light."""
    if name == "LocalBackend":
        from .backends.local import LocalBackend

        return LocalBackend
    if name == "RemoteBackend":
        from .backends.remote import RemoteBackend

        return RemoteBackend
    if name == "ServerlessBackend":
        from .backends.serverless import ServerlessBackend

        return ServerlessBackend
    raise AttributeError(f"module 'art_nb' has no attribute {name!r}")
