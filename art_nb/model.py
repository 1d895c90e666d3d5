"""The user's handle on a model: `Model` (anything behind an OpenAI endpoint) and `TrainableModel`.

The handle holds no weights. It names the model, remembers which backend serves it, and hands out
an OpenAI client pointed at that backend, so rollout code is plain OpenAI code. Every method that
touches the backend is async, for top-level `await` in notebooks and `asyncio.run` in scripts.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from .config import ModelConfig, TrainConfig
from .trajectory import Trajectory, TrajectoryGroup
from .types import check_name

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from .backends.base import Backend
    from .types import ProgressCallback, TrainResult

__all__ = ["HandoffTarget", "Model", "TrainableModel"]


class HandoffTarget(Protocol):
    """A backend that can continue a model's training from a checkpoint of another backend (serverless)."""

    async def handoff(self, model: TrainableModel, *, source: Backend | None = None, **kwargs: Any) -> int: ...


class Model(BaseModel):
    """A model behind an OpenAI-compatible endpoint: a baseline to compare with, or a judge.

    Give `inference_base_url` (+ key) for an external endpoint, or `register` it with a backend.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, validate_assignment=True)

    name: str
    project: str = "default"
    inference_base_url: str | None = None
    inference_api_key: str | None = Field(default=None, repr=False, exclude=True)
    inference_model_name: str | None = None

    _backend: Backend | None = PrivateAttr(default=None)
    # One client per event loop (a client binds to the loop it first ran on); weak, so a closed loop's
    # client goes with it and a new loop never inherits it.
    _clients: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], AsyncOpenAI]] = PrivateAttr(
        default_factory=weakref.WeakKeyDictionary)
    _sync_clients: dict[tuple[Any, ...], AsyncOpenAI] = PrivateAttr(default_factory=dict)

    @field_validator("name", "project")
    @classmethod
    def _safe_name(cls, value: str, info: Any) -> str:
        return check_name(info.field_name, value)

    @property
    def trainable(self) -> bool:
        return False

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError(f"model {self.name!r} is not registered: run `await model.register(backend)` first")
        return self._backend

    async def register(self, backend: Backend) -> None:
        """Attach to `backend` (idempotent: re-running the cell reuses the running engine)."""
        await backend.register(self)
        if self._backend is not backend:
            self._clients.clear()
            self._sync_clients.clear()
        self._backend = backend

    def get_inference_name(self, step: int | None = None) -> str:
        """The model name to send to the endpoint: latest weights, or `name@step` for a checkpoint."""
        if self._backend is not None:
            return self._backend.inference_model_name(self, step)
        return self.inference_model_name or self.name

    def openai_client(self, **kwargs: Any) -> AsyncOpenAI:
        """An `AsyncOpenAI` pointed at this model's endpoint, one per event loop (clients bind to a loop)."""
        from openai import AsyncOpenAI

        if self._backend is not None:
            endpoint = self._backend.inference_endpoint(self)
            base_url, api_key = endpoint.base_url, endpoint.api_key
        elif self.inference_base_url:
            base_url, api_key = self.inference_base_url, self.inference_api_key or "none"
        else:
            raise RuntimeError(
                f"model {self.name!r} has no endpoint: register it with a backend or set inference_base_url"
            )
        try:
            clients = self._clients.setdefault(asyncio.get_running_loop(), {})
        except RuntimeError:  # built outside a loop (e.g. to inspect it): not bound to one yet
            clients = self._sync_clients
        key = (base_url, repr(sorted(kwargs.items())))
        client = clients.get(key)
        if client is None:
            kwargs.setdefault("timeout", 600.0)
            # Requests wait (never fail) while a step trains; retries only cover a dropped connection.
            kwargs.setdefault("max_retries", 2)
            client = AsyncOpenAI(base_url=base_url, api_key=api_key, **kwargs)
            clients[key] = client
        return client

    async def log(
        self,
        trajectories: Iterable[TrajectoryGroup | Trajectory] = (),
        split: str = "val",
        metrics: dict[str, float] | None = None,
        *,
        step: int | None = None,
    ) -> dict[str, float]:
        """Record trajectories (and their reward metrics, plus `metrics`) for `split` at `step` (default: the current one)."""
        return await self.backend.log(self, list(trajectories), split=split, step=step, metrics=metrics)


class TrainableModel(Model):
    """A base model plus a LoRA that `train` updates. `base_model` is a hub id or a local path."""

    base_model: str
    config: ModelConfig = Field(default_factory=ModelConfig)

    @property
    def trainable(self) -> bool:
        return True

    async def get_step(self) -> int:
        """The step whose weights are served now (0 before any training): resume loops from here."""
        return await self.backend.get_step(self)

    async def train(
        self,
        groups: Iterable[TrajectoryGroup],
        config: TrainConfig | None = None,
        *,
        on_progress: ProgressCallback | None = None,
    ) -> TrainResult:
        """One GRPO step on `groups`; the next request to `get_inference_name()` sees the new weights."""
        return await self.backend.train(self, list(groups), config or TrainConfig(), on_progress=on_progress)

    async def handoff(self, backend: HandoffTarget, **kwargs: Any) -> int:
        """Continue training on `backend` (a ServerlessBackend) from this model's latest local LoRA.

        Returns the step the hosted model starts from. docs/remote.md lists what leaves the machine.
        """
        return await backend.handoff(self, source=self._backend, **kwargs)

    async def delete_checkpoints(self, steps: Iterable[int] | None = None, keep_last: int = 1) -> list[int]:
        """Delete `steps`, or every checkpoint but the newest `keep_last`. The served step is always kept."""
        return await self.backend.delete_checkpoints(self, steps, keep_last=keep_last)
