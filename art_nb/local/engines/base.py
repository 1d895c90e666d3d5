"""The `Engine` protocol: what the OpenAI endpoint and the backend need from an inference engine.

An engine works in token ids only. Chat templating, stop-string handling on text and tool-call
parsing live in the server, so every engine (transformers on CPU, vLLM on a GPU) looks the same to
a rollout. Adapters are addressed by name ("{model}@{step}"); `None` means the base weights.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

__all__ = [
    "Engine",
    "EngineError",
    "ContextTooLongError",
    "EngineDeadError",
    "SamplingParams",
    "GenerationRequest",
    "Sample",
    "AdapterWeights",
    "packed_copies",
]

T = TypeVar("T")


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
    # The most likely tokens at each position, with their logprobs (OpenAI's top_logprobs, 0-20).
    top_logprobs: int = 0
    # A Lark grammar (llguidance's dialect) every sample must match: JSON response formats, forced tool
    # calls (server/constrain.py). Tokens it forbids are masked out before sampling.
    grammar: str | None = None


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None  # a name passed to `load_adapter`, or None for base weights


@dataclass
class Sample:
    """One sampled continuation. `logprobs[i]` is the log-probability of `token_ids[i]` under the
    unscaled (temperature 1) distribution of the served weights: what the trainer recomputes. Under a
    `grammar` it is that distribution renormalised over the tokens the grammar allowed, the one the
    token was drawn from (as vLLM reports it); docs/losses.md says how training weighs the difference."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    extra: dict[str, Any] = field(default_factory=dict)
    # With `SamplingParams.top_logprobs` = k > 0: per sampled token, the k most likely (token id, logprob)
    # pairs under the same distribution, most likely first (the sampled token need not be among them).
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True)
class AdapterWeights:
    """A PEFT LoRA adapter held in memory: what the trainer hands the engine on a step's hot path.

    The same content `save_pretrained` writes (`tensors` under the keys of adapter_model.safetensors,
    `config` as adapter_config.json), so an engine that cannot take tensors may still read the files
    once the checkpoint is on disk. The tensors are a private copy on the trainer's device (on a GPU
    nothing crosses to the host on the step's path): the trainer's own weights change at the next
    step. The checkpoint writer puts host copies in their place once it has them (the dict is
    updated in place, so the GPU copy is freed), so an engine copies what it keeps and looks
    tensors up again whenever it re-reads them.
    """

    tensors: dict[str, Any]  # name -> torch.Tensor, on the trainer's device, later on the host
    config: dict[str, Any]

    def on_host(self) -> dict[str, Any]:
        """The tensors on the host (those already there as they are; the rest in one transfer per dtype)."""
        if all(tensor.device.type == "cpu" for tensor in self.tensors.values()):
            return dict(self.tensors)
        return packed_copies(self.tensors, to_host=True, what="adapter weights")


def packed_copies(tensors: dict[str, Any], *, to_host: bool, what: str | None = None,
                  dtype: Any = None) -> dict[str, Any]:
    """Private copies of `tensors` (in `dtype` if given), packed per device and dtype into one new
    buffer on their device; with `what`, checked there for NaN/inf (one sync; ValueError "non-finite
    {what}" naming the first bad one); with `to_host`, copied to the host in one transfer (a copy per
    tensor would wait on the device each time). The copies are views of that buffer.

    A GPU's tensors land in page-locked memory, which torch's host allocator keeps and reuses step
    after step. A copy into pageable memory runs at a fraction of the bus's speed and holds up the
    GPU's other work meanwhile: on an H200, the checkpoint of a rank-64 LoRA on a 3B model (~1.5 GB
    with its AdamW state) written that way beside the rollouts made them 3.6 s instead of 2.4 s a step
    (bench/results/h200/t4_checkpoint_pinned/). vLLM's LoRA loader also pins each tensor it builds on
    the host, and skips those already pinned.
    """
    import torch

    by_kind: dict[tuple[Any, Any], list[str]] = {}
    for name, tensor in tensors.items():
        by_kind.setdefault((tensor.device, dtype or tensor.dtype), []).append(name)
    copied: dict[str, Any] = {}
    for (_, kind), names in by_kind.items():
        flat = torch.cat([tensors[name].detach().reshape(-1) for name in names]).to(kind)  # new, also on CPU
        # A sum is NaN/inf if any element is (5-10x cheaper than isfinite().all() on a CPU); a sum that
        # merely overflowed is told apart by the exact check, which runs only then.
        if what is not None and flat.is_floating_point() and not bool(torch.isfinite(flat.sum())):
            bad = next((name for name in names if not bool(torch.isfinite(tensors[name]).all())), None)
            if bad is not None:
                raise ValueError(f"refusing to save non-finite {what} ({bad})")
        if to_host and flat.is_cuda:
            flat = _page_locked(flat)
        pieces = flat.split([tensors[name].numel() for name in names])
        copied.update((name, piece.view(tensors[name].shape)) for name, piece in zip(names, pieces, strict=True))
    return {name: copied[name] for name in tensors}


def _page_locked(flat: Any) -> Any:
    """`flat`, a GPU tensor, copied into page-locked host memory; into pageable memory where the host
    cannot lock that much (slower, as above, but the copy is still made)."""
    import torch

    try:
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    except RuntimeError:
        return flat.cpu()
    return host.copy_(flat)


@runtime_checkable
class Engine(Protocol):
    """An async inference engine. Every method is called from the backend's event loop.

    The engine owns its memory choreography around a train step (`train_with`): whether to sleep,
    and what to do when training runs out of memory beside it. The backend only asks.
    """

    tokenizer: Any  # a transformers PreTrainedTokenizerBase with a chat template
    max_context: int  # prompt + completion tokens the engine accepts

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving (closed, crashed, stalled), or None while it serves.

        A dead engine is replaced when its model is registered again.
        """
        ...

    @property
    def serves_while_training(self) -> bool:
        """Whether `train_with` keeps serving requests while the step trains (vLLM awake beside a
        training that fits; any engine on a CPU, where sleeping frees nothing), as planned now. The
        plan's pipeline choice reads it at register."""
        ...

    async def train_with(self, step: Callable[[], Awaitable[T]],
                         hold: Callable[[], Awaitable[None]] | None = None) -> T:
        """Run one train step, `step()`, with this engine's memory arranged for training.

        The engine frees what its plan says training needs (e.g. vLLM sleeps unless training fits
        beside it) and is awake again when this returns or raises. A callable rather than a context
        manager because the engine may run `step` a second time: after an out-of-memory error
        beside an awake engine it sleeps and retries (exact, since the trainer raised before its
        optimizer stepped), and sleeps for every later step. `hold()` holds new requests and returns
        once those in flight are done: before it sleeps an engine calls it (or holds them itself), so
        no request reaches a sleeping engine; awake beside training it does not (a pipeline's run on).
        """
        ...

    async def generate(self, request: GenerationRequest) -> list[Sample]:
        """`request.params.n` samples for one prompt. Concurrent calls should share batches."""
        ...

    async def load_adapter(self, name: str, path: Path, weights: AdapterWeights | None = None) -> None:
        """Make the PEFT adapter in `path` servable as `name` (replacing any adapter of that name).

        With `weights` the engine serves those tensors and must not need `path` yet: a train step
        hands its update over in memory, and the checkpoint reaches `path` in the background. `path`
        is still where the same adapter will be on disk (an engine may re-read it from there later,
        once the checkpoint has landed).
        """
        ...

    async def unload_adapter(self, name: str) -> None:
        """Stop serving `name` (a later request for it is an `EngineError`), freeing its weights."""
        ...

    async def sleep(self) -> None:
        """Free accelerator memory for training (no-op where there is none to free)."""
        ...

    async def wake(self) -> None:
        """Undo `sleep`. Idempotent: `train_with` and the backend's error paths may call it again."""
        ...

    async def close(self) -> None:
        """Fail waiting requests with `EngineDeadError` and free the engine; `dead_reason` says it was
        closed. Idempotent: the backend closes a dead engine before it starts a new one."""
        ...
