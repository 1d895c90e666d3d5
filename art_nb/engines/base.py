"""The `Engine` protocol: what the OpenAI endpoint and the backend need from an inference engine.

An engine works in token ids only. Chat templating, stop-string handling on text and tool-call
parsing live in the server, so every engine (transformers on CPU, vLLM on a GPU) looks the same to
a rollout. Adapters are addressed by name ("{model}@{step}"); `None` means the base weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "Engine",
    "EngineError",
    "ContextTooLongError",
    "EngineDeadError",
    "SamplingParams",
    "GenerationRequest",
    "Sample",
]


class EngineError(RuntimeError):
    """A request the engine could not serve (the server maps it to a 500 unless a subclass says 400)."""


class ContextTooLongError(EngineError):
    """The prompt plus `max_tokens` do not fit the model's context (HTTP 400)."""


class EngineDeadError(EngineError):
    """The engine stopped answering; re-register the model to start a new one (HTTP 503)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling knobs, already validated by the server."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # Fixed-length output for benchmarks: keep sampling past EOS.
    ignore_eos: bool = False


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None  # a name passed to `load_adapter`, or None for base weights


@dataclass
class Sample:
    """One sampled continuation. `logprobs[i]` is the log-probability of `token_ids[i]` under the
    unscaled (temperature 1) distribution of the served weights: what the trainer recomputes."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """An async inference engine. Every method is called from the backend's event loop.

    Optional attributes the backend reads with a default: `train_awake` (bool, default False: the
    backend calls `sleep` before a train step unless it is True) and `dead_reason` (str | None).
    """

    tokenizer: Any  # a transformers PreTrainedTokenizerBase with a chat template
    max_context: int  # prompt + completion tokens the engine accepts

    async def generate(self, request: GenerationRequest) -> list[Sample]:
        """`request.params.n` samples for one prompt. Concurrent calls should share batches."""
        ...

    async def load_adapter(self, name: str, path: Path) -> None:
        """Make the PEFT adapter in `path` servable as `name` (replacing any adapter of that name)."""
        ...

    async def unload_adapter(self, name: str) -> None: ...

    async def sleep(self) -> None:
        """Free accelerator memory for training (no-op where there is none to free)."""
        ...

    async def wake(self) -> None: ...

    async def close(self) -> None: ...
