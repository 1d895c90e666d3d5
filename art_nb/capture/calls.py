"""What capture keeps of one model call: the request body, the server's prompt ids, and per choice
the sampled ids, their logprobs, and the message (for logging and for the user's own reading).

Pydantic so a captured trajectory crosses the wire to `art-nb serve` and into the run's records
like any other field. No headers are kept: an API key is never part of a record.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CapturedCall", "CapturedChoice"]


class CapturedChoice(BaseModel):
    """One sampled answer. `logprobs` is None when the server sent none (the trainer then uses its own)."""

    model_config = ConfigDict(extra="forbid")

    index: int = 0
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    message: dict[str, Any] = Field(default_factory=dict)


class CapturedCall(BaseModel):
    """One chat-completions call as the server saw it."""

    model_config = ConfigDict(extra="forbid")

    model: str
    prompt_token_ids: list[int]
    choices: list[CapturedChoice]
    request: dict[str, Any] = Field(default_factory=dict)
    streamed: bool = False

    @property
    def model_family(self) -> str:
        """The model without its step suffix: "agent@3" and "agent" are one policy at two versions."""
        return self.model.rpartition("@")[0] or self.model
