"""The user's handle on a model: `Model` (anything behind an OpenAI endpoint) and `TrainableModel`.

The handle holds no weights. It names the model, remembers which backend serves it, and hands out
an OpenAI client pointed at that backend, so rollout code is plain OpenAI code. Every method that
touches the backend is async, for top-level `await` in notebooks and `asyncio.run` in scripts.

Names and shapes are ART's: `config` is the user's own (any object, e.g. a pydantic model their
rollout reads), `register` fills `inference_base_url`/`inference_api_key`/`inference_model_name`,
and ART's experimental knobs (`_internal_config`, `lora_config`) map onto the `ModelConfig` the
backend serves and trains with, `backend_config` (art_nb.porting says how).
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from . import porting
from .config import ModelConfig, TrainConfig
from .pipelining import pinned_step
from .records import UnknownMetricError
from .sft_config import TrainSFTConfig
from .trajectories import Trajectory, TrajectoryGroup
from .types import check_name, inference_name

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from .backend import Backend
    from .types import ProgressCallback, TrainResult

__all__ = ["DEFAULT_BEST_METRIC", "HandoffTarget", "Model", "NotRegisteredError", "TrainableModel"]

DEFAULT_BEST_METRIC = "val/reward"  # ART's `delete_checkpoints` default
_log = logging.getLogger("art_nb")


class NotRegisteredError(ValueError, RuntimeError):
    """A model used before `register` (or a `Model` without an endpoint). A ValueError with ART's
    message, as ART raises it; a RuntimeError too, as art_nb raised it before."""


class HandoffTarget(Protocol):
    """A backend that can continue a model's training from a checkpoint of another backend (serverless)."""

    async def handoff(self, model: TrainableModel, *, source: Backend | None = None, **kwargs: Any) -> int: ...


class Model(BaseModel):
    """A model behind an OpenAI-compatible endpoint: a baseline to compare with, or a judge.

    Give `inference_base_url` (+ key, + `inference_model_name` if the endpoint names it otherwise);
    `register` it with a backend to log its rollouts next to the trained model's.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, validate_assignment=True)

    name: str
    project: str = "default"
    config: Any = None
    inference_base_url: str | None = None
    inference_api_key: str | None = Field(default=None, repr=False, exclude=True)
    inference_model_name: str | None = None
    # ART's bookkeeping fields, accepted so ART code runs: art_nb keeps runs under the backend's path.
    entity: str | None = None
    id: str | None = None
    run_id: str | None = None
    base_path: str = ".art"
    report_metrics: list[str] | None = None

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
        """The backend `register` attached (ART calls it, `model.backend()`: a backend called is itself)."""
        if self._backend is None:
            raise NotRegisteredError("Model is not registered with the Backend. You must call `model.register()` "
                                     f"first (model {self.name!r}: `await model.register(backend)`)")
        return self._backend

    async def register(self, backend: Backend) -> None:
        """Attach to `backend` (idempotent: re-running the cell reuses the running engine)."""
        await backend.register(self)
        if self._backend is not backend:
            self._clients.clear()
            self._sync_clients.clear()
        self._backend = backend

    def get_inference_name(self, step: int | None = None) -> str:
        """The model name to send to the endpoint (for a trained model, `name@step`; default: the served step,
        or inside a pipeline's gather the step that gather samples from: art_nb.pipelining)."""
        if self.trainable and self._backend is not None:
            return self._backend.inference_model_name(self, pinned_step(self) if step is None else step)
        return inference_name(self.inference_model_name or self.name, step)

    def _endpoint(self) -> tuple[str, str]:
        if self.inference_base_url:
            return self.inference_base_url, self.inference_api_key or "none"
        raise NotRegisteredError("In order to create an OpenAI client you must provide an `inference_api_key` and "
                                 f"`inference_base_url` (model {self.name!r} has no inference_base_url)")

    def openai_client(self, **kwargs: Any) -> AsyncOpenAI:
        """An `AsyncOpenAI` pointed at this model's endpoint, one per event loop (clients bind to a loop)."""
        from art_nb.chat_client import chat_client_class

        base_url, api_key = self._endpoint()
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
            if "http_client" not in kwargs and os.environ.get("ART_NB_IN_PROCESS_CLIENT", "1") != "0":
                # A backend serving in this process is called without a socket (server/inprocess.py: a third of
                # the CPU per request); any other client still reaches it over HTTP at base_url.
                http_client = None if self._backend is None else self._backend.in_process_http_client(self)
                if http_client is not None:
                    kwargs["http_client"] = http_client
            client = chat_client_class()(base_url=base_url, api_key=api_key, **kwargs)  # AsyncOpenAI, lighter chat requests
            clients[key] = client
        return client

    def litellm_completion_params(self, step: int | None = None) -> dict[str, Any]:
        """What `litellm.completion(**params, messages=...)` needs to call this model (as in ART). A
        model without an endpoint yet (an OpenAI model named by `name`, a model not registered) gets
        None for both, as in ART: LiteLLM then picks the provider from the model's name."""
        try:
            base_url, api_key = self._endpoint()
        except NotRegisteredError:
            base_url, api_key = self.inference_base_url, self.inference_api_key  # type: ignore[assignment]
        name = self.get_inference_name(step)
        return {"model": f"hosted_vllm/{name}" if self.trainable else name, "base_url": base_url,
                "api_key": api_key, "temperature": 1}

    async def get_step(self) -> int:
        """The step whose weights are served (always 0 for a model that is not trained here)."""
        return 0

    async def log(
        self,
        trajectories: Iterable[TrajectoryGroup | Trajectory | BaseException] | None = None,
        split: str = "val",
        metrics: dict[str, float] | None = None,
        *,
        step: int | None = None,
    ) -> dict[str, float]:
        """Record trajectories (with their reward metrics, plus `metrics`) for `split` at `step` (default:
        the current one); `metrics` alone (`trajectories=None`) records just those.

        Groups `train` already recorded, and the metrics its result already reported, are not written
        again (ART's loop logs both after `backend.train`): each step is recorded once.
        """
        items = list(trajectories or ())
        loose = [t for t in items if not isinstance(t, TrajectoryGroup)]
        if loose:  # ART: loose trajectories (and exceptions) form one group
            items = [t for t in items if isinstance(t, TrajectoryGroup)] + [TrajectoryGroup(loose)]
        return await self.backend.log(self, items, split=split, step=step, metrics=metrics)


class TrainableModel(Model):
    """A base model plus a LoRA that `train` updates. `base_model` is a hub id or a local path.

    `config` is a `ModelConfig` (how it is served and trained) or, as in ART, the user's own
    config object; `backend_config` is the ModelConfig either way.
    """

    base_model: str
    config: Any = Field(default_factory=ModelConfig)
    lora_config: dict[str, Any] | None = None
    run_name: str | None = None
    _internal_config: dict[str, Any] | None = PrivateAttr(default=None)
    _reporter: Any = PrivateAttr(default=None)  # art_nb.reporting.Reporter once registered

    def __init__(self, *, _internal_config: Mapping[str, Any] | None = None, **data: Any) -> None:
        super().__init__(**data)
        self._internal_config = dict(_internal_config) if _internal_config is not None else None

    @property
    def trainable(self) -> bool:
        return True

    @property
    def backend_config(self) -> ModelConfig:
        """The ModelConfig the backend serves and trains this model with: `config` when it is one
        (else the defaults), with ART's `_internal_config` and `lora_config` applied."""
        base = self.config if isinstance(self.config, ModelConfig) else ModelConfig()
        if not self._internal_config and not self.lora_config:
            return base
        return porting.model_config(base, self._internal_config, self.lora_config)

    async def register(self, backend: Backend, _openai_client_config: Mapping[str, Any] | None = None) -> None:
        """Attach to `backend` and fill `inference_base_url`, `inference_api_key` and `inference_model_name`,
        so `AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)` works."""
        if _openai_client_config:
            from .config import report_ignored

            report_ignored({"_openai_client_config": "the endpoint is the backend's own "
                            "(LocalBackend(port=, api_key=))"}, "TrainableModel.register")
        await super().register(backend)
        endpoint = backend.inference_endpoint(self)
        self.inference_base_url = endpoint.base_url
        self.inference_api_key = endpoint.api_key
        self.inference_model_name = backend.inference_model_name(self)
        from . import reporting  # W&B / trackio per ART's rule: report_metrics=None means W&B when a key is found

        self._reporter = reporting.start(self, backend, self.report_metrics)

    def _endpoint(self) -> tuple[str, str]:
        if self._backend is not None:
            endpoint = self._backend.inference_endpoint(self)
            return endpoint.base_url, endpoint.api_key
        if not self.inference_base_url:
            raise NotRegisteredError("OpenAI client not yet available on this trainable model. You must call "
                                     f"`model.register()` first (model {self.name!r}: `await model.register(backend)`)")
        return super()._endpoint()

    async def get_step(self) -> int:
        """The step whose weights are served now (0 before any training): resume loops from here."""
        return await self.backend.get_step(self)

    async def train(
        self,
        groups: Iterable[TrajectoryGroup] | None = None,
        config: TrainConfig | None = None,
        _config: Mapping[str, Any] | None = None,
        verbose: bool = False,
        *,
        on_progress: ProgressCallback | None = None,
        trajectory_groups: Iterable[TrajectoryGroup] | None = None,
    ) -> TrainResult:
        """One GRPO step on `groups`; the next request to `get_inference_name()` sees the new weights.

        ART's older call (`config=art.TrainConfig(...)`, `_config={...}` of `art.dev.TrainConfig`,
        `trajectory_groups=`) works as well: `_config` maps as `backend.train`'s arguments do.
        """
        chosen = groups if groups is not None else trajectory_groups
        if chosen is None:
            raise TypeError("train needs the gathered groups: model.train(groups)")
        if _config:
            config = porting.train_config(config, _config, "TrainableModel.train")
        return await self.backend.train(self, list(chosen), config or TrainConfig(), on_progress=on_progress)

    async def train_sft(
        self,
        trajectories: Iterable[Trajectory],
        config: TrainSFTConfig | None = None,
        _config: Mapping[str, Any] | None = None,
        verbose: bool = False,
        log_metrics: bool = True,
        *,
        on_progress: ProgressCallback | None = None,
    ) -> TrainResult:
        """Supervised fine-tuning on demonstrations, as ART's `model.train_sft`: each trajectory's
        assistant turns (written dicts or sampled Choices) are the labels, one optimizer step per
        batch of `config.batch_size`, one new checkpoint for the call. Use it to warm-start a LoRA
        from a few good examples before GRPO; `get_inference_name()` serves the result at once.

        `log_metrics=False` is accepted for ART code; the metrics are recorded either way (history
        split "sft"). Returns the new step and its metrics (ART returns None).
        """
        if not log_metrics:
            from .config import report_ignored

            report_ignored({"log_metrics": "SFT metrics are always recorded (history split 'sft')"},
                           "TrainableModel.train_sft")
        return await self.backend.train_sft(self, list(trajectories), config or TrainSFTConfig(), _config,
                                            verbose, on_progress=on_progress)

    async def handoff(self, backend: HandoffTarget, **kwargs: Any) -> int:
        """Continue training on `backend` (a ServerlessBackend) from this model's latest local LoRA.

        Returns the step the hosted model starts from. docs/remote.md lists what leaves the machine.
        """
        return await backend.handoff(self, source=self._backend, **kwargs)

    async def delete_checkpoints(
        self,
        best_checkpoint_metric: str | Iterable[int] | None = None,
        *,
        steps: Iterable[int] | None = None,
        keep_last: int | None = None,
    ) -> list[int]:
        """Delete every checkpoint but the served one and the best by `best_checkpoint_metric` (ART's
        rule: the step whose mean of that history metric is highest). A metric no logged step has
        is refused (`UnknownMetricError`, naming the metrics there are: a typo must not delete the
        best step), except ART's default: with none given, "val/reward", and when no step has
        it, ART's fallback, a warning and only the served step kept. art_nb's older forms:
        `steps=[...]` deletes those, `keep_last=n` keeps the newest n. The served step is always
        kept. Returns the steps deleted.
        """
        if best_checkpoint_metric is not None and not isinstance(best_checkpoint_metric, str):
            steps = best_checkpoint_metric  # art_nb's older positional `steps`
        if steps is not None or keep_last is not None:
            return await self.backend.delete_checkpoints(self, steps, keep_last=keep_last or 1)
        if isinstance(best_checkpoint_metric, str):
            return await self.backend.delete_checkpoints(self, None, keep_last=1, best_metric=best_checkpoint_metric)
        try:
            return await self.backend.delete_checkpoints(self, None, keep_last=1, best_metric=DEFAULT_BEST_METRIC)
        except UnknownMetricError as exc:
            _log.warning("delete_checkpoints() with ART's default metric: %s. As ART does then, every checkpoint "
                         "but the served one is deleted", str(exc).replace("; nothing was deleted", ""))
            return await self.backend.delete_checkpoints(self, None, keep_last=1)
