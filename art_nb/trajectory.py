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
import contextlib
import copy
import json
import math
from collections.abc import Awaitable, Iterable
from typing import Any

from openai.types.chat.chat_completion import Choice
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = ["Choice", "Trajectory", "TrajectoryGroup", "MessageOrChoice", "template_message", "check_groups", "gathered_groups"]

MessageOrChoice = dict[str, Any] | Choice
_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _check_message(index: int, item: Any) -> MessageOrChoice:
    if isinstance(item, Choice):
        return item
    if isinstance(item, BaseModel):  # e.g. a ChatCompletionMessage the user appended
        item = item.model_dump(exclude_none=True)
    if not isinstance(item, dict):
        raise ValueError(
            f"messages_and_choices[{index}] is a {type(item).__name__}; expected a message dict "
            "like {'role': 'user', 'content': '...'} or the Choice returned by chat.completions.create"
        )
    role = item.get("role")
    if role not in _ROLES:
        raise ValueError(
            f"messages_and_choices[{index}] has role {role!r}; expected one of {sorted(_ROLES)}"
        )
    if role == "tool" and "tool_call_id" not in item:
        raise ValueError(f"messages_and_choices[{index}] is a tool result without 'tool_call_id'")
    content = item.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise ValueError(
            f"messages_and_choices[{index}]['content'] is a {type(content).__name__}; expected str"
        )
    return item


class Trajectory(BaseModel):
    """One rollout: the conversation, its reward, and anything the user wants to see later."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", validate_assignment=True)

    messages_and_choices: list[MessageOrChoice] = Field(default_factory=list)
    reward: float = 0.0
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    logs: list[str] = Field(default_factory=list)

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _validate_messages(cls, value: Any) -> list[MessageOrChoice]:
        if not isinstance(value, (list, tuple)):
            raise ValueError("messages_and_choices must be a list of message dicts and Choices")
        return [_check_message(i, item) for i, item in enumerate(value)]

    @field_validator("reward")
    @classmethod
    def _finite_reward(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"reward is {value}; rewards must be finite numbers")
        return float(value)

    @model_validator(mode="after")
    def _tool_results_answer_calls(self) -> Trajectory:
        open_calls: set[str] = set()
        for message in self.messages():
            if message.get("role") == "assistant":
                for call in message.get("tool_calls") or []:
                    open_calls.add(call["id"])
            elif message.get("role") == "tool" and message["tool_call_id"] not in open_calls:
                raise ValueError(
                    f"tool result answers tool_call_id {message['tool_call_id']!r}, "
                    "which no earlier assistant message made"
                )
        return self

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as plain dicts (Choices turned into assistant messages)."""
        return [choice_to_message(m) if isinstance(m, Choice) else m for m in self.messages_and_choices]

    def choices(self) -> list[Choice]:
        return [m for m in self.messages_and_choices if isinstance(m, Choice)]

    def __str__(self) -> str:
        return f"Trajectory(reward={self.reward:.3f}, messages={len(self.messages_and_choices)})"


def choice_to_message(choice: Choice) -> dict[str, Any]:
    """The assistant message a Choice stands for, as the next request would send it."""
    return choice.message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"})


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates expect it, for serving and training alike (one rendering, no drift).

    OpenAI sends tool-call arguments as a JSON string; HF templates (Qwen's `| tojson`, Hermes)
    expect an object, and would render a string quoted. Content None becomes "" (templates
    concatenate it).
    """
    message = copy.deepcopy(message)
    if message.get("content") is None:
        message["content"] = ""
    for call in message.get("tool_calls") or []:
        arguments = call.get("function", {}).get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):
                call["function"]["arguments"] = json.loads(arguments)
    return message


class TrajectoryGroup(BaseModel):
    """Trajectories of the same scenario; GRPO's advantages are relative within a group.

    Accepts finished trajectories or awaitables of them (what `gather_trajectory_groups` awaits).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[str] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    _pending: list[Awaitable[Trajectory]] = PrivateAttr(default_factory=list)

    def __init__(
        self,
        trajectories: Iterable[Trajectory | Awaitable[Trajectory]] = (),
        *,
        exceptions: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        items = list(trajectories)
        pending = [t for t in items if not isinstance(t, Trajectory)]
        for t in pending:
            if not asyncio.iscoroutine(t) and not isinstance(t, Awaitable):
                raise TypeError(f"TrajectoryGroup got a {type(t).__name__}; expected Trajectory or awaitable")
        super().__init__(
            trajectories=[t for t in items if isinstance(t, Trajectory)],
            exceptions=exceptions or [],
            metadata=metadata or {},
        )
        self._pending = pending

    @property
    def pending(self) -> list[Awaitable[Trajectory]]:
        return self._pending

    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self):  # type: ignore[override]
        return iter(self.trajectories)


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
            fields = {name: getattr(trajectory, name) for name in type(trajectory).model_fields}
            try:
                type(trajectory).model_validate(fields)
            except ValidationError as error:
                problems = "; ".join(
                    f"{'.'.join(str(part) for part in e['loc']) or 'trajectory'}: {e['msg'].removeprefix('Value error, ')}"
                    for e in error.errors()
                )
                raise ValueError(f"groups[{i}].trajectories[{j}] is invalid: {problems}") from None
