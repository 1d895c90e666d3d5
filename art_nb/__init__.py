"""art_nb: train multi-step LLM agents with GRPO + LoRA from a notebook.

ART's public names are here under the same spelling (`import art_nb as art` ports ART code), and
ART's submodules too (`art_nb.dev`, `art_nb.utils`, `art_nb.local`, `art_nb.rewards`...).
`art_nb.trajectories` is ART's capture function (`await art.trajectory(rollout(...))`), not the
module of that name: import from the module as `from art_nb.trajectories import ...`.
Importing this package loads no torch, vLLM, Unsloth or ipywidgets: engines and trainers load
when a backend first needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import dev, trajectories, utils  # ART code reaches art.trajectories.History
from ._version import __version__
from .backend import Backend
from .config import LoraConfig, ModelConfig, TrainConfig
from .datasets_io import trajectories_dataset
from .dev import LoRAConfig
from .gather import (
    DatasetBatch,
    TooManyExceptionsError,
    gather_trajectories,
    gather_trajectory_groups,
    iterate_dataset,
    limit_concurrency,
    retry,
    trajectory_group_batches,
)
from .model import Model, NotRegisteredError, TrainableModel
from .pipelining import pipeline
from .scopes import (
    auto_trajectory,
    capture_auto_trajectory,
    capture_yielded_trajectory,
    current_trajectory,
    current_trajectory_group,
    no_capture,
    trajectory,
    trajectory_group,
    yield_trajectory,
)
from .sft_config import TrainSFTConfig
from .trajectories import History, Trajectory, TrajectoryGroup
from .types import LocalTrainResult, Messages, MessagesAndChoices, ServerlessTrainResult, Tools, TrainResult

if TYPE_CHECKING:
    from .local import LocalBackend
    from .remote.client import RemoteBackend
    from .serverless import ServerlessBackend

__all__ = [
    "Backend",
    "DatasetBatch",
    "History",
    "LocalBackend",
    "LoRAConfig",
    "LocalTrainResult",
    "LoraConfig",
    "Messages",
    "MessagesAndChoices",
    "Model",
    "ModelConfig",
    "NotRegisteredError",
    "RemoteBackend",
    "ServerlessBackend",
    "ServerlessTrainResult",
    "TooManyExceptionsError",
    "Tools",
    "TrainConfig",
    "TrainResult",
    "TrainSFTConfig",
    "TrainableModel",
    "Trajectory",
    "TrajectoryGroup",
    "__version__",
    "auto_trajectory",
    "capture_auto_trajectory",
    "capture_yielded_trajectory",
    "current_trajectory",
    "current_trajectory_group",
    "dev",
    "gather_trajectories",
    "gather_trajectory_groups",
    "iterate_dataset",
    "limit_concurrency",
    "no_capture",
    "pipeline",
    "retry",
    "trajectories",
    "trajectories_dataset",
    "trajectory",
    "trajectory_group",
    "trajectory_group_batches",
    "utils",
    "yield_trajectory",
]


def __getattr__(name: str) -> Any:
    """Backends load on first use, so `import art_nb` stays light."""
    if name == "LocalBackend":
        from .local import LocalBackend

        return LocalBackend
    if name == "RemoteBackend":
        from .remote.client import RemoteBackend

        return RemoteBackend
    if name == "ServerlessBackend":
        from .serverless import ServerlessBackend

        return ServerlessBackend
    raise AttributeError(f"module 'art_nb' has no attribute {name!r}")
