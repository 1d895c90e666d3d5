"""Trajectories: what a rollout produced, and the group GRPO compares it within.

A trajectory is the conversation (`messages_and_choices`) plus a scalar reward. Messages are
plain OpenAI-style dicts; what the model said is kept as the `Choice` object the endpoint
returned, because only a Choice carries the sampled token ids and logprobs that training uses.
Assistant dicts are allowed (they are context, never trained on).

Validation happens here, at the boundary, with errors that name the offending message and field,
so a mistake in a rollout is reported when the trajectory is built, not deep inside a train step.
Assignments are validated too (`trajectory.reward = float("nan")` raises at once). What cannot be
seen at assignment, a list changed in place (`messages_and_choices.append(...)`), is checked again
by `check_groups` before a train step, with an error naming the group, trajectory and field.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import math
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from art_nb.capture import CapturedCall
from art_nb.capture import context as capture_scope
from art_nb.capture import hooks as capture_hooks
from art_nb.capture.conversation import captured_conversation, captured_tools

from .messages import Choice, MessageOrChoice, check_messages, choice_to_message, template_message

if TYPE_CHECKING:
    from typing_extensions import Self

T = TypeVar("T")

__all__ = ["Choice", "History", "MessageOrChoice", "RolloutException", "Trajectory", "TrajectoryGroup", "check_groups",
           "choice_to_message", "gathered_groups", "template_message", "trajectory_problem"]


class History(BaseModel):
    """Another conversation of the same rollout (ART's `additional_histories`), e.g. a sub-agent's.

    It is trained on as its own sequence with the rollout's reward, and validated like the main one.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", validate_assignment=True)

    messages_and_choices: list[MessageOrChoice] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _validate_messages(cls, value: Any) -> list[MessageOrChoice]:
        return check_messages(value)

    def conversation(self) -> list[MessageOrChoice]:
        """Its messages and Choices: the same accessor as `Trajectory.conversation`, so code reading
        either kind of history asks one way."""
        return list(self.messages_and_choices)

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as plain dicts (Choices turned into assistant messages)."""
        return [choice_to_message(m) if isinstance(m, Choice) else m for m in self.messages_and_choices]


class Trajectory(BaseModel):
    """One rollout: the conversation, its reward, and anything the user wants to see later.

    Fields and methods follow ART's (`log`, `finish`, `track_duration`, `for_logging`,
    `additional_histories`); subclasses may add fields of their own.

    `with Trajectory() as t:` is a capture scope (ART's): the model calls made inside are recorded
    into `t.exchanges` with the server's token ids (art_nb.capture), and trained on exactly those
    (art_nb.grpo.captured). Leaving the scope records the duration and adds `t` to the enclosing
    `with TrajectoryGroup()` if there is one.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", validate_assignment=True)

    messages_and_choices: list[MessageOrChoice] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    additional_histories: list[History] = Field(default_factory=list)
    exchanges: list[CapturedCall] = Field(default_factory=list)  # calls captured inside `with t:`
    reward: float = 0.0
    initial_policy_version: int | None = None
    final_policy_version: int | None = None
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    start_time: datetime = Field(default_factory=datetime.now, exclude=True)
    # Calls to an art_nb endpoint made outside every trajectory's context while this scope was open
    # (e.g. from a thread started by hand): not recorded anywhere; the step's error reports them.
    _calls_outside_context: int = PrivateAttr(default=0)

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _validate_messages(cls, value: Any) -> list[MessageOrChoice]:
        return check_messages(value)

    @field_validator("reward")
    @classmethod
    def _finite_reward(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"reward is {value}; rewards must be finite numbers")
        return float(value)

    @model_validator(mode="after")
    def _one_way_built(self) -> Trajectory:
        if self.exchanges and (self.messages_and_choices or self.additional_histories):
            raise ValueError("a trajectory holds either captured calls (exchanges, from `with Trajectory()`) or "
                             "messages_and_choices/additional_histories, not both: the same model calls would be "
                             "trained twice; build it one way")
        return self

    def conversation(self) -> list[MessageOrChoice]:
        """The conversation as messages and Choices, however the trajectory was built: its
        `messages_and_choices`, or for captured calls the one they record (the last request's messages,
        each reply the model sampled as its Choice; art_nb.capture.conversation). Every view reads
        this (records, viewer, datasets, RULER); training reads `exchanges` when there are any."""
        return captured_conversation(self.exchanges) if self.exchanges else list(self.messages_and_choices)

    def conversation_tools(self) -> list[dict[str, Any]] | None:
        """The tools offered with `conversation()`: `tools`, or for captured calls those of the last request."""
        return self.tools if self.tools is not None or not self.exchanges else captured_tools(self.exchanges)

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as plain dicts (Choices turned into assistant messages); see `conversation`."""
        return [choice_to_message(m) if isinstance(m, Choice) else m for m in self.conversation()]

    def sampled(self) -> list[bool]:
        """Per message of `messages()`, whether the model sampled it (a Choice) rather than it being
        written into the prompt (a dict, e.g. an example turn)."""
        return [isinstance(m, Choice) for m in self.conversation()]

    def __enter__(self) -> Self:
        capture_hooks.install()  # once per HTTP library, for those imported by now
        capture_scope.enter(self, self.exchanges)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._calls_outside_context += capture_scope.exit(self)
        self.finish()

    @property
    def calls_outside_context(self) -> int:
        """Model calls to an art_nb endpoint made outside every trajectory's context while this one's
        scope was open, so recorded nowhere: e.g. from a `threading.Thread` started without
        `contextvars.copy_context()`. Counted process-wide, so concurrent rollouts each see the others'
        too; 0 when all calls were made in a rollout's own context (docs/capture.md, Threads)."""
        return self._calls_outside_context

    def choices(self) -> list[Choice]:
        return [m for m in self.conversation() if isinstance(m, Choice)]

    def log(self, message: str) -> None:
        """Keep a note with the rollout (shown with it in the run's records)."""
        self.logs.append(message)

    def finish(self) -> Trajectory:
        """Record the seconds since the trajectory was made as `metrics["duration"]`; returns self."""
        self.metrics["duration"] = (datetime.now() - self.start_time).total_seconds()
        return self

    @contextlib.asynccontextmanager
    async def track_duration(self, metric_name: str) -> AsyncIterator[None]:
        """Add the seconds spent in the block to `metrics[f"{metric_name}_duration"]`."""
        started = time.monotonic()
        try:
            yield
        finally:
            key = f"{metric_name}_duration"
            self.metrics[key] = self.metrics.get(key, 0.0) + time.monotonic() - started

    def for_logging(self) -> dict[str, Any]:
        """A JSON-ready view, each message marked `trainable` (it is a sampled Choice) or not."""
        messages = [{**(choice_to_message(m) if isinstance(m, Choice) else m), "trainable": isinstance(m, Choice)}
                    for m in self.conversation()]
        return {"reward": self.reward, "initial_policy_version": self.initial_policy_version,
                "final_policy_version": self.final_policy_version, "metrics": self.metrics,
                "metadata": self.metadata, "messages": messages, "tools": self.conversation_tools(), "logs": self.logs}

    def __str__(self) -> str:
        return f"Trajectory(reward={self.reward:.3f}, messages={len(self.conversation())})"

    def __eq__(self, other: object) -> bool:
        """Equal when the content is: when the object was made (`start_time`) is not content, so a
        trajectory sent over the wire and rebuilt equals the original."""
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, Trajectory)
        mine = {k: v for k, v in self.__dict__.items() if k != "start_time"}
        theirs = {k: v for k, v in other.__dict__.items() if k != "start_time"}
        return mine == theirs and self.__pydantic_extra__ == other.__pydantic_extra__


class RolloutException(str):
    """A rollout's failure as a group keeps it: the one-line text ("ValueError: ...") is the string,
    with ART's fields (`type`, `message`, `traceback`) and the exception object itself (`exception`,
    None once the group has been sent over the wire)."""

    type: str
    message: str
    traceback: str
    exception: BaseException | None

    def __new__(cls, text: str, *, type: str = "", message: str = "", traceback: str = "",
                exception: BaseException | None = None) -> Self:
        self = super().__new__(cls, text)
        self.type, self.message, self.traceback, self.exception = type, message or text, traceback, exception
        return self

    @classmethod
    def of(cls, value: Any) -> RolloutException:
        """From an exception object, ART's {type, message, traceback} dict, or a line of text."""
        if isinstance(value, RolloutException):
            return value
        if isinstance(value, BaseException):
            text = "".join(traceback.format_exception_only(builtins.type(value), value)).strip()
            return cls(text, type=builtins.type(value).__name__, message=str(value),
                       traceback="".join(traceback.format_exception(value)), exception=value)
        if isinstance(value, dict) and "message" in value:
            kind = str(value.get("type") or "Exception")
            return cls(f"{kind}: {value['message']}", type=kind, message=str(value["message"]),
                       traceback=str(value.get("traceback") or ""))
        if isinstance(value, str):
            return cls(value)
        raise TypeError(f"exceptions holds exception objects or their text; got a {builtins.type(value).__name__}")

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_plain_validator_function(
            cls.of, serialization=core_schema.plain_serializer_function_ser_schema(str))


class TrajectoryGroup(BaseModel):
    """Trajectories of the same scenario; GRPO's advantages are relative within a group.

    As in ART: it takes finished trajectories, awaitables of them (what `gather_trajectory_groups`
    or `await group` runs), and exception objects, in any mix; `exceptions=` holds failed rollouts
    (as `RolloutException`), `metrics=` and `logs=` describe the group as a whole.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[RolloutException] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    _pending: list[Awaitable[Trajectory]] = PrivateAttr(default_factory=list)
    _recorded: set[str] = PrivateAttr(default_factory=set)  # where records.record_groups wrote it

    def __init__(
        self,
        trajectories: Iterable[Trajectory | BaseException | Awaitable[Trajectory]] = (),
        *,
        exceptions: Iterable[BaseException | str | dict[str, Any]] | None = None,
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, float | int | bool] | None = None,
        logs: list[str] | None = None,
    ) -> None:
        items = list(trajectories)
        for item in items:
            if not isinstance(item, (Trajectory, BaseException, Awaitable)):
                raise TypeError(f"TrajectoryGroup got a {type(item).__name__}; expected a Trajectory, an awaitable "
                                "of one (a rollout), or an exception")
        super().__init__(
            trajectories=[t for t in items if isinstance(t, Trajectory)],
            exceptions=[e for e in items if isinstance(e, BaseException)] + list(exceptions or []),
            metadata=metadata or {}, metrics=metrics or {}, logs=logs or [],
        )
        self._pending = [t for t in items if not isinstance(t, (Trajectory, BaseException))]

    @property
    def pending(self) -> list[Awaitable[Trajectory]]:
        return self._pending

    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def __enter__(self) -> Self:
        """`with TrajectoryGroup() as g:` collects the trajectory scopes that close inside it (ART's)."""
        capture_scope.enter_group(self, self.trajectories)
        return self

    def __exit__(self, *exc_info: object) -> None:
        capture_scope.exit_group(self)

    def log(self, message: str) -> None:
        self.logs.append(message)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self):  # type: ignore[override]
        return iter(self.trajectories)

    def __await__(self) -> Generator[Any, None, TrajectoryGroup]:
        """`await group` runs its rollouts (as ART's awaitable group does); the first failure is raised."""
        def fail_at_once(trajectory: Trajectory | None, error: BaseException | None) -> None:
            if error is not None:
                raise error

        return self.finished(fail_at_once).__await__()

    async def finished(self, on_outcome: Callable[[Trajectory | None, BaseException | None], None]) -> TrajectoryGroup:
        """The group with its pending rollouts run concurrently: a rollout that raises an `Exception`,
        or returns a trajectory that is no longer valid (a list changed in place: e.g. a message with
        role "bot" appended), becomes one of the group's exceptions; the others go on.

        `on_outcome(trajectory, error)` sees each rollout as it ends; whatever it raises stops the
        whole group (the rollouts still running are cancelled) and propagates. A rollout that returns
        something other than a Trajectory is a programming error: TypeError, at once.
        """
        async def one(awaitable: Awaitable[Trajectory]) -> Trajectory | BaseException:
            try:
                result = await awaitable
            except Exception as error:  # noqa: BLE001 - a failed rollout, counted by on_outcome
                on_outcome(None, error)
                return error
            if not isinstance(result, Trajectory):
                raise TypeError(f"a rollout returned {type(result).__name__}; rollouts must return art_nb.Trajectory")
            problem = trajectory_problem(result)
            if problem is not None:
                error = ValueError(f"the rollout returned an invalid trajectory: {problem}")
                on_outcome(None, error)
                return error
            on_outcome(result, None)
            return result

        results = await gather_or_cancel([one(p) for p in self._pending])
        return TrajectoryGroup(
            [*self.trajectories, *results], exceptions=list(self.exceptions),
            metadata=self.metadata, metrics=self.metrics, logs=self.logs,
        )


def gathered_groups(groups: Iterable[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """The groups `train` was given, checked the same way by every backend before anything is sent or written.

    Raises TypeError for something that is not a TrajectoryGroup, ValueError for a group with
    rollouts never awaited or a trajectory changed in place into something invalid.
    """
    groups = list(groups)
    for i, group in enumerate(groups):
        if not isinstance(group, TrajectoryGroup):
            raise TypeError(f"groups[{i}] is a {type(group).__name__}; train takes gathered TrajectoryGroups "
                            "(await art.gather_trajectory_groups(...) first)")
        if group.pending:
            raise ValueError(f"groups[{i}] has rollouts that were never awaited: gather them first "
                             "(await art.gather_trajectory_groups(...))")
    check_groups(groups)
    return groups


def check_groups(groups: Iterable[TrajectoryGroup]) -> None:
    """Validate every trajectory again (lists may have been changed in place since it was built).

    Raises ValueError naming the group, the trajectory and the field, e.g.
    "groups[2].trajectories[0].messages_and_choices: messages_and_choices[3] has role 'bot'; ...".
    """
    for i, group in enumerate(groups):
        for j, trajectory in enumerate(group.trajectories):
            problem = trajectory_problem(trajectory)
            if problem is not None:
                raise ValueError(f"groups[{i}].trajectories[{j}] is invalid: {problem}")


def trajectory_problem(trajectory: Trajectory) -> str | None:
    """What is wrong with `trajectory` now (its lists may have changed since it was built), or None."""
    fields = {name: getattr(trajectory, name) for name in type(trajectory).model_fields}
    try:
        type(trajectory).model_validate(fields)
    except ValidationError as error:
        return "; ".join(
            f"{'.'.join(str(part) for part in e['loc']) or 'trajectory'}: {e['msg'].removeprefix('Value error, ')}"
            for e in error.errors()
        )
    return None


async def gather_or_cancel(coros: Iterable[Awaitable[T]]) -> list[T]:
    """Await all of `coros` concurrently; if one fails (or the caller is interrupted), cancel the rest and
    wait until they have stopped before raising, so no rollout keeps running behind the error."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
