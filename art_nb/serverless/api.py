"""The W&B Training API as this client speaks it: routes, wire format, retries, and one error type.

    POST   /preview/models                          {entity, project, name, base_model, return_existing}
    POST   /preview/models/{id}/log                 {model_id, trajectory_groups, split}
    GET    /preview/models/{id}/checkpoints         ?order=&limit=&after= -> {data: [{id, step, metrics}], has_more}
    DELETE /preview/models/{id}/checkpoints         {steps}
    POST   /preview/training-jobs                   {model_id, trajectory_groups, experimental_config} -> {id}
    GET    /preview/training-jobs/{id}/events       ?after=<event id>  -> {data: [{id, type, data}], has_more}
    POST   /chat/completions                        model "wandb-artifact:///{entity}/{project}/{name}:step{N}"

Transient failures (connection refused, 429, 5xx) are retried with bounded exponential backoff and
jitter, waiting what `Retry-After` asks; a caller that creates something passes one idempotency key
used on every attempt. Every failure becomes a `ServerlessError` whose text has the key scrubbed out,
because a server may quote a request back, and error messages end up in saved notebooks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from art_nb.config import LOSSES, TrainConfig
from art_nb.secrets import Secret
from art_nb.trajectories import TrajectoryGroup
from art_nb.wire import LoopClients, RetryPolicy, request_with_retries

__all__ = ["API_KEY_ENV", "DEFAULT_BASE_URL", "RemoteModel", "ServerlessError", "ServiceClient", "TrainingJobFailed"]

DEFAULT_BASE_URL = "https://api.training.wandb.ai/v1"
API_KEY_ENV = "WANDB_API_KEY"
_log = logging.getLogger("art_nb")


class ServerlessError(RuntimeError):
    """The W&B Training API refused a request, or could not be reached after retrying."""


class TrainingJobFailed(ServerlessError):
    """A training job ended with `training_failed`; the message is the service's."""


@dataclass(frozen=True)
class RemoteModel:
    """A model as the service knows it: its id, and the entity/project/name its artifacts live under."""

    id: str
    entity: str
    project: str
    name: str
    run_id: str | None


def art_group(group: TrajectoryGroup) -> dict[str, Any]:
    """A group in ART's JSON shape (exceptions as {type, message, traceback})."""
    data = group.model_dump(mode="json", include={"trajectories", "metadata"})
    data["exceptions"] = [{"type": "Exception", "message": e, "traceback": ""} for e in group.exceptions]
    return data


def experimental_config(config: TrainConfig) -> dict[str, Any]:
    """TrainConfig as the service's RL knobs (what it has no knob for stays local).

    The service trains with ART's losses (CISPO, PPO); the rest of art_nb's menu runs locally only, and
    is refused here rather than sent as a name the service would reject or, worse, read as another loss.
    """
    spec = LOSSES[config.loss]
    if not spec.serverless:
        hosted = " or ".join(f"loss={name!r}" for name, other in LOSSES.items() if other.serverless)
        raise ValueError(f"loss={config.loss!r} runs on LocalBackend only; the hosted service trains with {hosted}")
    return {
        "learning_rate": config.learning_rate,
        "loss_fn": config.loss,
        "ppo": spec.objective == "clip",  # ART's flag: the clip objective instead of CISPO's
        "epsilon": config.epsilon,
        "epsilon_high": config.epsilon_high,
        "scale_rewards": config.scale_rewards,
        "logprob_calculation_chunk_size": config.logprob_chunk_tokens,
    }


class ServiceClient:
    """One method per route. Holds the key as a `Secret`: it is revealed only into the auth header."""

    def __init__(self, key: Secret, base_url: str, retry: RetryPolicy, timeout: float) -> None:
        self.key, self.base_url, self.retry = key, base_url, retry
        self._clients = LoopClients(lambda: httpx.AsyncClient(
            base_url=base_url, timeout=timeout, headers={"Authorization": f"Bearer {key.reveal()}"}))

    async def call(self, method: str, route: str, what: str, *, idempotency_key: str | None = None,
                   **kwargs: Any) -> Any:
        """The decoded JSON reply (None when empty); `what` names the action in the error, if any."""
        def on_retry(attempt: int, delay: float, reason: str) -> None:
            _log.warning("W&B Training API: %s on %s %s; retry %d/%d in %.1f s",
                         reason, method, route, attempt, self.retry.attempts - 1, delay)

        try:
            response = await request_with_retries(self._clients.get(), method, route, policy=self.retry,
                                                  idempotency_key=idempotency_key, on_retry=on_retry, **kwargs)
        except httpx.TransportError as exc:
            raise ServerlessError(f"{what}: could not reach {self.base_url} after retrying: "
                                  f"{self.key.redact(f'{type(exc).__name__}: {exc}')}") from None
        if response.is_success:
            return response.json() if response.content else None
        try:
            message = str(response.json().get("error", {}).get("message") or response.text)
        except (json.JSONDecodeError, AttributeError):
            message = response.text
        message = self.key.redact(message)[:1000]  # redact first: a cut could leave most of the key
        if response.status_code in (401, 403):
            raise ServerlessError(f"{what}: the W&B Training API rejected the key from {self.key.source} "
                                  f"(HTTP {response.status_code}): {message}")
        raise ServerlessError(f"{what} failed: HTTP {response.status_code} from {self.base_url}: {message}")

    async def create_model(self, entity: str | None, project: str, name: str, base_model: str) -> RemoteModel:
        body = {"entity": entity, "project": project, "name": name, "base_model": base_model, "return_existing": True}
        reply = await self.call("POST", "/preview/models", f"register {name!r}", json=body)
        return RemoteModel(str(reply["id"]), str(reply["entity"]), str(reply.get("project", project)),
                           str(reply.get("name", name)), reply.get("run_id"))

    async def checkpoint_steps(self, model_id: str) -> list[int]:
        """Every step with a checkpoint, ascending (the listing is paged)."""
        steps: list[int] = []
        after = None
        while True:
            params = {"order": "asc", "limit": 100, **({"after": after} if after else {})}
            page = await self.call("GET", f"/preview/models/{model_id}/checkpoints", "list checkpoints", params=params)
            steps.extend(int(c["step"]) for c in page.get("data", []))
            if not page.get("has_more") or not page.get("data"):
                return sorted(steps)
            after = page["data"][-1]["id"]

    async def latest_step(self, model_id: str) -> int:
        """The newest checkpoint's step, 0 before any."""
        page = await self.call("GET", f"/preview/models/{model_id}/checkpoints", "get_step",
                               params={"order": "desc", "limit": 1})
        data = page.get("data") or []
        return int(data[0]["step"]) if data else 0

    async def delete_checkpoints(self, model_id: str, steps: list[int]) -> None:
        await self.call("DELETE", f"/preview/models/{model_id}/checkpoints", "delete checkpoints",
                        json={"steps": steps})

    async def create_job(self, model_id: str, groups: Iterable[TrajectoryGroup], config: TrainConfig,
                         idempotency_key: str, what: str) -> str:
        """Start a training job; the same `idempotency_key` on every attempt makes it start at most once."""
        body = {"model_id": model_id, "trajectory_groups": [art_group(g) for g in groups],
                "experimental_config": experimental_config(config)}
        job = await self.call("POST", "/preview/training-jobs", what, json=body, idempotency_key=idempotency_key)
        return str(job["id"])

    async def job_events(self, job_id: str, after: str | None) -> dict[str, Any]:
        """One page of the job's events after the event id `after`: {data: [...], has_more}."""
        params = {"after": after} if after else {}
        page = await self.call("GET", f"/preview/training-jobs/{job_id}/events", f"progress of job {job_id}",
                               params=params)
        return dict(page or {})

    async def log(self, model_id: str, groups: Iterable[TrajectoryGroup], split: str) -> None:
        body = {"model_id": model_id, "trajectory_groups": [art_group(g) for g in groups], "split": split}
        await self.call("POST", f"/preview/models/{model_id}/log", "log", json=body)

    async def close(self) -> None:
        await self._clients.close()
