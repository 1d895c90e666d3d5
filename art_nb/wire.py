"""What art_nb's HTTP clients and server agree on: versions, retries, and trajectories as JSON.

- **Versions.** Every request of `RemoteBackend` carries `X-Art-Nb-Version`; client and server must
  agree on major.minor, because the wire format below may change between minor releases.
- **Retries.** Bounded exponential backoff with jitter, honouring `Retry-After`. A request is
  retried only when that cannot do something twice: the connection was never made, the server
  refused it (429), or it is idempotent (GET/DELETE, or a POST with an idempotency key that the
  caller reuses on every attempt).
- **Trajectories.** `Trajectory.model_dump` alone loses which items were `Choice`s (they come
  back as dicts), and a Choice carries what training needs: its `token_ids` and logprobs. On the
  wire each item is tagged, `{"message": {...}}` or `{"choice": {...}}`, and decoded back into
  the same types.
- **Streams.** A train stream is NDJSON; `bounded_lines` splits it without ever holding more than
  one line of a set size (httpx's `aiter_lines` buffers a line without end whole).
- **Request bodies.** `RegisterBody`, `TrainBody`, `SFTBody`, `LogBody`, `DeleteBody`: what `art-nb serve`'s
  routes accept, checked at the door so bad input is a 400 naming the field, never a 500 from deep
  inside the backend (a split that is a path, a step of -5, a metric that is a string or NaN).
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

import httpx
from openai.types.chat.chat_completion import Choice
from pydantic import AfterValidator, BaseModel, Field

from art_nb.store import MAX_STEP
from art_nb.trajectories import Trajectory, TrajectoryGroup
from art_nb.types import check_name

__all__ = [
    "VERSION_HEADER",
    "DeleteBody",
    "LogBody",
    "LineTooLongError",
    "LoopClients",
    "RegisterBody",
    "RetryPolicy",
    "SFTBody",
    "TrainBody",
    "bounded_lines",
    "group_from_wire",
    "group_to_wire",
    "parse_retry_after",
    "request_with_retries",
    "trajectory_from_wire",
    "trajectory_to_wire",
    "version_mismatch",
]

VERSION_HEADER = "X-Art-Nb-Version"
RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})


# --- versions -----------------------------------------------------------------------------------


def _major_minor(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def version_mismatch(client: str, server: str) -> str | None:
    """A message saying how to fix it when `client` and `server` differ in major.minor, else None."""
    if _major_minor(client) == _major_minor(server):
        return None
    pin = ".".join(str(p) for p in _major_minor(server))
    return (
        f"art_nb version mismatch: this client is {client}, the server is {server}; they must agree on "
        f"major.minor. Install the server's version here (pip install 'art-nb=={pin}.*') or upgrade the server"
    )


# --- clients ------------------------------------------------------------------------------------


class LoopClients:
    """One `httpx.AsyncClient` per event loop: a client's connections belong to the loop that opened
    them, and a notebook (one loop) and a script calling `asyncio.run` twice (two loops) both work."""

    def __init__(self, factory: Callable[[], httpx.AsyncClient]) -> None:
        self._factory = factory
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary())

    def get(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._clients[loop] = self._factory()
        return client

    async def close(self) -> None:
        """Close the running loop's client (clients of other loops cannot be closed from here)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        client = self._clients.pop(loop, None)
        if client is not None:
            await client.aclose()


# --- retries ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to wait. Delays double from `base_delay` up to `max_delay`, half of
    each drawn at random so that many clients hit by the same outage do not retry in lockstep."""

    attempts: int = 6
    base_delay: float = 0.5
    max_delay: float = 30.0
    max_retry_after: float = 300.0  # a server asking for longer than this is treated as down

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random | None = None) -> float:
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_retry_after)
        ceiling = min(self.max_delay, self.base_delay * 2**attempt)
        return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a `Retry-After` header: delta-seconds or an HTTP date; None if absent/bad."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - (time.time() if now is None else now), 0.0)


RetryHook = Callable[[int, float, str], None]


async def request_with_retries(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    policy: RetryPolicy,
    idempotency_key: str | None = None,
    on_retry: RetryHook | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    **kwargs: Any,
) -> httpx.Response:
    """Send a request, retrying transient failures; return the last response (any status).

    With `idempotency_key`, every attempt sends the same `Idempotency-Key` header, so a server
    that honours it runs a job-creating POST once even when a response was lost. Transport errors
    are raised after the last attempt (or at once when a retry could repeat a side effect).
    """
    method = method.upper()
    headers = dict(kwargs.pop("headers", None) or {})
    if idempotency_key is not None:
        headers["Idempotency-Key"] = idempotency_key
    repeatable = method in _IDEMPOTENT or idempotency_key is not None
    for attempt in range(policy.attempts):
        last = attempt == policy.attempts - 1
        try:
            response = await client.request(method, url, headers=headers, **kwargs)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached the server
            if last:
                raise
            delay, reason = policy.delay(attempt, None), f"{type(exc).__name__}"
        except httpx.TransportError as exc:  # may have reached it: retry only what is repeatable
            if last or not repeatable:
                raise
            delay, reason = policy.delay(attempt, None), f"{type(exc).__name__}"
        else:
            status = response.status_code
            if last or status not in RETRY_STATUSES or (status != 429 and not repeatable):
                return response
            retry_after = parse_retry_after(response.headers.get("retry-after"))
            delay, reason = policy.delay(attempt, retry_after), f"HTTP {status}"
            await response.aclose()
        if on_retry is not None:
            on_retry(attempt + 1, delay, reason)
        await sleep(delay)
    raise AssertionError("unreachable: the last attempt returns or raises")


class LineTooLongError(ValueError):
    """A stream line grew past the reader's limit without ending."""


async def bounded_lines(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    """The non-blank lines of a byte stream; `LineTooLongError` as soon as one grows past `limit` bytes."""
    buffer = bytearray()
    async for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:  # only the new bytes are searched
            buffer += chunk[start:end]
            if len(buffer) > limit:
                break
            if buffer.strip():
                yield bytes(buffer)
            buffer.clear()
            start = end + 1
        else:
            buffer += chunk[start:]
        if len(buffer) > limit:
            raise LineTooLongError(f"a line of over {limit:,} bytes")
    if buffer.strip():
        yield bytes(buffer)


# --- trajectories on the wire -------------------------------------------------------------------


def trajectory_to_wire(trajectory: Trajectory) -> dict[str, Any]:
    """JSON-ready dict; Choices are tagged so they decode back to Choices (token ids, logprobs), in the
    main conversation and in every additional history alike."""
    data = trajectory.model_dump(mode="json")
    data["messages_and_choices"] = _tagged(trajectory.messages_and_choices, data["messages_and_choices"])
    for history, dumped in zip(trajectory.additional_histories, data.get("additional_histories") or [], strict=True):
        dumped["messages_and_choices"] = _tagged(history.messages_and_choices, dumped["messages_and_choices"])
    return data


def trajectory_from_wire(data: dict[str, Any]) -> Trajectory:
    histories = [{**h, "messages_and_choices": _untagged(h.get("messages_and_choices"), f"additional_histories[{i}]")}
                 for i, h in enumerate(data.get("additional_histories") or [])]
    return Trajectory.model_validate({**data, "messages_and_choices": _untagged(data.get("messages_and_choices"), ""),
                                      "additional_histories": histories})


def _tagged(items: list[Any], dumped: list[Any]) -> list[dict[str, Any]]:
    return [{"choice": d} if isinstance(item, Choice) else {"message": d} for item, d in zip(items, dumped, strict=True)]


def _untagged(items: list[Any] | None, where: str) -> list[Any]:
    out: list[Any] = []
    for i, item in enumerate(items or []):
        if isinstance(item, dict) and set(item) == {"choice"}:
            out.append(Choice.model_validate(item["choice"]))
        elif isinstance(item, dict) and set(item) == {"message"}:
            out.append(item["message"])
        else:
            raise ValueError(f"{where}{'.' if where else ''}messages_and_choices[{i}] is not tagged "
                             "{'message': ...} or {'choice': ...}")
    return out


def group_to_wire(group: TrajectoryGroup) -> dict[str, Any]:
    return {
        "trajectories": [trajectory_to_wire(t) for t in group.trajectories],
        "exceptions": list(group.exceptions),
        "metadata": group.model_dump(mode="json", include={"metadata"})["metadata"],
    }


def group_from_wire(data: dict[str, Any]) -> TrajectoryGroup:
    return TrajectoryGroup(
        [trajectory_from_wire(t) for t in data.get("trajectories") or []],
        exceptions=[str(e) for e in data.get("exceptions") or []],
        metadata=dict(data.get("metadata") or {}),
    )


# --- request bodies of art-nb serve -------------------------------------------------------------

# strict: 1.5, True and "3" are not steps; bounded as the store bounds them (a step names files)
Step = Annotated[int, Field(strict=True, ge=0, le=MAX_STEP)]
Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Split = Annotated[str, AfterValidator(lambda name: check_name("split", name))]


class RegisterBody(BaseModel):
    name: str
    project: str = "default"
    base_model: str = Field(min_length=1, max_length=1024)
    config: dict[str, Any] | None = None


class TrainBody(BaseModel):
    groups: list[dict[str, Any]] = []
    config: dict[str, Any] | None = None
    # the client's pipeline gathers the next step meanwhile (art_nb.pipelining): the server keeps serving
    beside: Annotated[bool, Field(strict=True)] = False


class SFTBody(BaseModel):
    """`train_sft`'s arguments: `dev_config` is ART's `_config` (`art_nb.dev.TrainSFTConfig`, a
    TypedDict, so a plain object), renamed because a leading underscore is private in pydantic."""

    trajectories: list[dict[str, Any]] = []
    config: dict[str, Any] | None = None
    dev_config: dict[str, Any] | None = None
    verbose: Annotated[bool, Field(strict=True)] = False


class LogBody(BaseModel):
    items: list[dict[str, Any]] = []
    split: Split = "val"
    step: Step | None = None
    metrics: dict[str, Finite] | None = None


class DeleteBody(BaseModel):
    steps: list[Step] | None = None
    keep_last: Annotated[int, Field(strict=True, ge=1)] = 1
    best_metric: Annotated[str, Field(min_length=1, max_length=200)] | None = None
