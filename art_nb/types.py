"""Data shared by the model handle and every backend, below both so neither imports the other.

`ModelRef` is what a backend needs to know of a model: the backend protocol is typed on it, not on
`Model`, so `backend.py` never imports `model.py` (and `model.py` never imports a backend).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .config import ModelConfig

__all__ = [
    "ExportResult",
    "InferenceEndpoint",
    "LocalTrainResult",
    "Message",
    "Messages",
    "MessagesAndChoices",
    "ModelRef",
    "ProgressCallback",
    "ServerlessTrainResult",
    "Tools",
    "TrainResult",
    "TrainableModelRef",
    "check_name",
    "inference_name",
]

ProgressCallback = Callable[[dict[str, Any]], None]
"""Receives train-progress events: {"phase": "train", "done": k, "total": n, ...}."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


Message = dict[str, Any]
"""One chat message, as OpenAI's API takes it ({"role": ..., "content": ...})."""
Messages = list[Message]
MessagesAndChoices = list[Any]
"""Messages and the `Choice`s the endpoint returned, in conversation order (a trajectory's history)."""
Tools = list[dict[str, Any]]
"""Tool definitions, as OpenAI's `tools=` takes them."""


@dataclass(frozen=True)
class TrainResult:
    """What one `train` call did: the step now served, and the step's metrics."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LocalTrainResult(TrainResult):
    """ART's name for what `LocalBackend.train` returns: also where the new checkpoint is."""

    checkpoint_path: str | None = None


@dataclass(frozen=True)
class ServerlessTrainResult(TrainResult):
    """ART's name for what `ServerlessBackend.train` returns: also the checkpoint's W&B artifact,
    "entity/project/model:step5"."""

    artifact_name: str | None = None


@dataclass(frozen=True)
class InferenceEndpoint:
    base_url: str
    api_key: str = field(repr=False)


class ModelRef(Protocol):
    """A model as a backend sees it (`art_nb.Model` is one)."""

    name: str
    project: str

    @property
    def trainable(self) -> bool: ...


class TrainableModelRef(ModelRef, Protocol):
    """A trainable model as a backend sees it (`art_nb.TrainableModel` is one)."""

    base_model: str

    @property
    def backend_config(self) -> ModelConfig:
        """How to serve and train it (the model's `config` may be the user's own object, as in ART)."""
        ...


def check_name(kind: str, value: str) -> str:
    """Reject names that could escape the model directory or confuse the step suffix."""
    if not isinstance(value, str) or not _NAME.match(value) or ".." in value:
        raise ValueError(
            f"{kind} {value!r} is not allowed: use letters, digits, '.', '_' or '-' "
            "(at most 128, starting with a letter or digit, no '..', no '/', no '@')"
        )
    return value


def inference_name(name: str, step: int | None = None) -> str:
    """The name a model is served under: `name` for the newest weights, `name@step` for a checkpoint."""
    return name if step is None else f"{name}@{step}"


@dataclass(frozen=True)
class ExportResult:
    """Where an export went: written by `art_nb.local.export`, shown by `art_nb.notebook.show_export`.
    `notes` says what was skipped and why (no secrets in here, ever)."""

    step: int
    adapter_dir: Path
    zip_path: Path | None = None
    merged_dir: Path | None = None
    gguf_path: Path | None = None
    hub_url: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __str__(self) -> str:
        lines = [f"exported step {self.step}", f"  adapter: {self.adapter_dir}"]
        if self.zip_path:
            lines.append(f"  zip:     {self.zip_path}")
        if self.merged_dir:
            lines.append(f"  merged:  {self.merged_dir}")
        if self.gguf_path:
            lines.append(f"  gguf:    {self.gguf_path}")
        if self.hub_url:
            lines.append(f"  hub:     {self.hub_url}")
        lines += [f"  note:    {note}" for note in self.notes]
        return "\n".join(lines)
