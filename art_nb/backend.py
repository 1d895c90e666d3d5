"""The `Backend` protocol: everything a model handle, the notebook views and `art-nb serve` ask of
whatever serves and trains a model.

`LocalBackend` (in this kernel), `RemoteBackend` (a GPU server over HTTP) and `ServerlessBackend`
(a hosted API) implement every method here, so a notebook swaps one object and nothing else, and
no caller needs to probe a backend for what it can do. The protocol is typed on `ModelRef` (in
`types.py`), not on `Model`, so this module does not import the model handle.

`train_inputs` and `sft_inputs` are what every backend's `train` and `train_sft` do first, so the
three take ART's arguments and refuse bad input the same way, whether the call came through the
handle (`model.train`) or straight to the backend (`backend.train(model, groups, ...)`, as ART code
does), before anything is written or sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .config import TrainConfig
from .porting import train_config
from .sft_config import TrainSFTConfig
from .trajectories import Trajectory, TrajectoryGroup, gathered_groups
from .types import InferenceEndpoint, ModelRef, ProgressCallback, TrainableModelRef, TrainResult

__all__ = ["Backend", "InferenceEndpoint", "ProgressCallback", "TrainResult", "sft_inputs", "train_inputs"]


def train_inputs(groups: Iterable[TrajectoryGroup], config: TrainConfig | None, kwargs: Mapping[str, Any],
                 where: str) -> tuple[list[TrajectoryGroup], TrainConfig]:
    """The groups, checked (`gathered_groups`), and the config: `config` (default `TrainConfig()`) with
    ART's keyword arguments applied (`art_nb.porting.train_config`; `where` names the call in its messages)."""
    if kwargs:
        config = train_config(config, kwargs, where)
    return gathered_groups(groups), config or TrainConfig()


def sft_inputs(trajectories: Iterable[Trajectory | Mapping[str, Any]],
               config: TrainSFTConfig | None) -> tuple[list[Trajectory], TrainSFTConfig]:
    """The demonstrations as Trajectories (a dict of their fields is validated into one) and the
    config (default `TrainSFTConfig()`), whose learning-rate schedule must fit their batches.

    Raises TypeError naming the index of something that is not a trajectory, or a config of another
    type; ValueError when a schedule has another length than the batches (`TrainSFTConfig.schedule`).
    """
    items = [Trajectory.model_validate(t) if isinstance(t, Mapping) else t for t in trajectories]
    for i, item in enumerate(items):
        if not isinstance(item, Trajectory):
            raise TypeError(f"trajectories[{i}] is a {type(item).__name__}: train_sft takes art.Trajectory "
                            "objects (or dicts of their fields)")
    config = config or TrainSFTConfig()
    if not isinstance(config, TrainSFTConfig):
        raise TypeError(f"config is a {type(config).__name__}: pass art.TrainSFTConfig(...)")
    if items:  # an empty call trains nothing and checks nothing
        config.schedule(len(items))
    return items, config


@runtime_checkable
class Backend(Protocol):
    async def register(self, model: ModelRef) -> None:
        """Make `model` servable (and trainable). Idempotent: a second call reuses what runs."""
        ...

    def choices(self, model: ModelRef) -> dict[str, str]:
        """What was chosen automatically for `model` (engine, trainer, dtype...) and why; {} if nothing."""
        ...

    def inference_endpoint(self, model: ModelRef) -> InferenceEndpoint: ...

    def in_process_http_client(self, model: ModelRef) -> Any | None:
        """An httpx client with which `model.openai_client()` reaches the endpoint without a socket, where the
        endpoint runs in this process (LocalBackend); None where it does not (remote, hosted)."""
        ...

    def inference_model_name(self, model: ModelRef, step: int | None = None) -> str: ...

    async def get_step(self, model: TrainableModelRef) -> int: ...

    async def train(
        self,
        model: TrainableModelRef,
        groups: Iterable[TrajectoryGroup],
        config: TrainConfig | None = None,
        *,
        on_progress: ProgressCallback | None = None,
        **kwargs: Any,
    ) -> TrainResult:
        """One step. `kwargs` are ART's `backend.train` arguments (`learning_rate=`, `loss_fn=`, ...),
        applied to `config` by `art_nb.porting.train_config`."""
        ...

    async def train_sft(
        self,
        model: TrainableModelRef,
        trajectories: Iterable[Trajectory],
        config: TrainSFTConfig | None = None,
        _config: Mapping[str, Any] | None = None,
        verbose: bool = False,
        *,
        on_progress: ProgressCallback | None = None,
    ) -> TrainResult:
        """Supervised fine-tuning on demonstrations (ART's `train_sft`): one checkpoint per call. A
        backend that cannot do it raises NotImplementedError saying what to use instead."""
        ...

    async def log(
        self,
        model: ModelRef,
        trajectories: Iterable[TrajectoryGroup | Trajectory],
        split: str = "val",
        step: int | None = None,
        metrics: dict[str, float] | None = None,
    ) -> dict[str, float]: ...

    async def wait_for_checkpoint(self, model: TrainableModelRef) -> int:
        """Wait until the served step's checkpoint is complete, and return that step.

        A backend whose checkpoints are complete when `train` returns answers at once.
        """
        ...

    def model_dir(self, model: ModelRef) -> Path:
        """The directory on this machine that holds the model's run records (history, trajectories)."""
        ...

    async def delete_checkpoints(
        self, model: TrainableModelRef, steps: Iterable[int] | None = None, keep_last: int = 1,
        *, best_metric: str | None = None,
    ) -> list[int]:
        """Delete `steps`, or all but the newest `keep_last`, or (ART's rule, `best_metric` given) all
        but the served step and the step whose mean of that history metric is highest."""
        ...

    async def close(self) -> None: ...
