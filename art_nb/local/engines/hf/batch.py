"""The pure half of `HFEngine`'s continuous batching: its data and the tensor arithmetic on it.

Nothing here runs the model or touches the event loop's scheduling, so each piece can be tested
with hand-made tensors: sampling (per-row temperature and top-p, logprobs under the unscaled
distribution), when a row finishes, how prompts are padded and chunked for prefill, and how the
left-padded KV cache of the running batch grows when rows join and shrinks when they leave; and
which peft adapter a name points to, and when a replaced one may be deleted.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..base import EngineError, Sample, SamplingParams

__all__ = [
    "AdapterTable",
    "Batch",
    "EngineStats",
    "Job",
    "Row",
    "check_full_attention",
    "finish_reason",
    "left_padded",
    "prefill_chunks",
    "sample_tokens",
    "settle",
    "top_alternatives",
]

# Padded prompt tokens per prefill forward: bounds activation memory when many long prompts arrive at once.
PREFILL_TOKENS = 8192
# Extra tokens decoded around a stop string's length when checking the tail (byte-level BPE splits characters).
_STOP_WINDOW_SLACK = 4


@dataclass
class EngineStats:
    """Counters that show whether requests were batched."""

    batches: int = 0  # admission rounds: rows prefilled together and joined to the decode batch
    steps: int = 0  # forwards that advanced every live row by one token
    max_batch_size: int = 0  # most rows advanced by a single forward
    tokens: int = 0  # tokens sampled
    prefills: int = 0  # distinct prompts prefilled
    prefix_hits: int = 0  # of those, started from a prefix in the prefix cache
    prefilled_tokens: int = 0  # prompt tokens the prefill forwards computed (padding not counted)
    reused_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache


@dataclass(eq=False)
class Job:
    """One `generate` call: its future and the samples collected so far."""

    future: asyncio.Future[list[Sample]]
    samples: list[Sample | None]
    adapter: str | None  # internal peft adapter name, fixed at submission
    abandoned: bool = False  # the caller stopped waiting (answered, failed or cancelled)


@dataclass(eq=False)
class Row:
    """One sequence being sampled for a job."""

    job: Job
    index: int
    prompt: tuple[int, ...]
    params: SamplingParams
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # with params.top_logprobs > 0
    finish: str | None = None
    matcher: Any = None  # llguidance's matcher of params.grammar (grammar.py), None when unconstrained


@dataclass
class Batch:
    """Rows decoding together: a left-padded KV cache and, per row, the next input token and its position."""

    rows: list[Row] = field(default_factory=list)
    adapter: str | None = None
    cache: DynamicCache | None = None
    mask: torch.Tensor | None = None  # [rows, cache length], 1 where the cache holds a real token
    next_tokens: torch.Tensor | None = None  # [rows], sampled but not yet fed to the model
    positions: torch.Tensor | None = None  # [rows], position id of next_tokens

    def join(self, rows: list[Row], cache: DynamicCache, mask: torch.Tensor, tokens: torch.Tensor,
             positions: torch.Tensor) -> None:
        """Append freshly prefilled rows, left-padding whichever cache is shorter."""
        if not self.rows:
            self.rows, self.cache, self.mask = list(rows), cache, mask
            self.next_tokens, self.positions = tokens, positions
            return
        assert self.cache is not None and self.mask is not None
        assert self.next_tokens is not None and self.positions is not None
        width = max(self.mask.shape[1], mask.shape[1])
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width, 2), _left_pad(new.keys, width, 2)])
            old.values = torch.cat([_left_pad(old.values, width, 2), _left_pad(new.values, width, 2)])
        self.mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(mask, width, 1)])
        self.next_tokens = torch.cat([self.next_tokens, tokens])
        self.positions = torch.cat([self.positions, positions])
        self.rows = [*self.rows, *rows]

    def keep(self, rows: list[Row]) -> None:
        """Shrink to `rows` (a subset, in order), in place, and drop cache columns no row needs."""
        if not rows:
            self.rows, self.cache, self.mask, self.next_tokens, self.positions = [], None, None, None, None
            return
        assert self.cache is not None and self.mask is not None
        assert self.next_tokens is not None and self.positions is not None
        index = {id(r): i for i, r in enumerate(self.rows)}
        keep = torch.tensor([index[id(r)] for r in rows], device=self.mask.device)
        self.cache.batch_select_indices(keep)
        self.mask, self.next_tokens, self.positions = self.mask[keep], self.next_tokens[keep], self.positions[keep]
        self.rows = list(rows)
        unused = int((self.mask.sum(0) == 0).long().cumprod(0).sum())  # leading all-padding columns
        if unused:
            self.mask = self.mask[:, unused:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, unused:], layer.values[:, :, unused:]


class AdapterTable:
    """Public adapter names -> internal peft adapter names, and how many submitted jobs use each.

    A job keeps the weights its name pointed to when it was submitted: loading new weights under a
    name, or unloading it, only retires the old internal adapter, which is deleted once no job
    uses it any more.

    One retired slot that was filled from memory is kept instead, while some name is still bound:
    a train step's next hand-over has the same config, and copying into an existing slot is ~7x
    faster than peft making a new one and deleting the old (bench/hf_adapter_swap.py: 2-core CPU,
    SmolLM2, r16 on all linear modules, 0.10 s vs 0.75 s).
    """

    def __init__(self) -> None:
        self._internal: dict[str, str] = {}
        self._users: Counter[str] = Counter()
        self.retired: set[str] = set()  # unloaded or replaced; deleted once unused
        self._ids = itertools.count()
        self._configs: dict[str, str] = {}  # internal -> its config's key, for slots filled from memory
        self.spare: str | None = None  # a retired, unused slot kept to be filled again

    def lookup(self, name: str | None) -> str | None:
        """The internal adapter serving `name` (None: the base weights)."""
        if name is None:
            return None
        if name not in self._internal:
            raise EngineError(f"no adapter named {name!r}; loaded: {sorted(self._internal) or 'none'}")
        return self._internal[name]

    def new_internal(self, config_key: str | None = None) -> tuple[str, bool]:
        """A slot for an adapter whose config has `config_key` (None: read from files, config unknown):
        the spare when its config matches (True: fill it in place), else a new name (False)."""
        if config_key is not None and self.spare is not None and self._configs.get(self.spare) == config_key:
            internal, self.spare = self.spare, None
            return internal, True
        internal = f"adapter_{next(self._ids)}"
        if config_key is not None:
            self._configs[internal] = config_key
        return internal, False

    def bind(self, name: str, internal: str) -> None:
        """Serve `name` from `internal` from now on; the adapter it replaces is retired."""
        previous, self._internal[name] = self._internal.get(name), internal
        if previous is not None:
            self.retired.add(previous)

    def abandon(self, internal: str) -> None:
        """A slot whose filling failed: deleted once unused, never kept as the spare."""
        self._configs.pop(internal, None)
        self.retired.add(internal)

    def unbind(self, name: str) -> None:
        self.lookup(name)  # raises for a name that was never loaded
        self.retired.add(self._internal.pop(name))

    def acquire(self, internal: str | None) -> None:
        if internal is not None:
            self._users[internal] += 1

    def release(self, internal: str | None) -> bool:
        """One job stopped using `internal`; True when that makes a retired adapter deletable."""
        if internal is None:
            return False
        self._users[internal] -= 1
        return self._users[internal] <= 0 and internal in self.retired

    def take_unused(self) -> list[str]:
        """Retired adapters no submitted job uses any more, forgotten here: the caller deletes them.
        The newest one filled from memory becomes the spare instead while a name is bound (the one it
        replaces goes); with none bound the spare goes too (the model can then drop its LoRA layers)."""
        unused = sorted(a for a in self.retired if self._users[a] <= 0)
        for internal in unused:
            self.retired.discard(internal)
            self._users.pop(internal, None)
        order = list(self._configs)  # made in this order
        keep = max((a for a in unused if a in self._configs), key=order.index, default=None)
        if self._internal and keep is not None:
            unused.remove(keep)
            if self.spare is not None:
                unused.append(self.spare)
            self.spare = keep
        elif not self._internal and self.spare is not None:
            unused.append(self.spare)
            self.spare = None
        for internal in unused:
            self._configs.pop(internal, None)
        return unused


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    shared: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row with that row's temperature (0 = greedy) and top_p, and its logprob under
    the unscaled (temperature 1) distribution. Sampling uses the exponential race
    (argmax p/E, E ~ Exp(1)), so each row draws its noise from its own generator if it has one."""
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    hot = [i for i, p in enumerate(params) if p.temperature > 0]
    if hot:
        index = torch.tensor(hot, device=logits.device)
        temperature = torch.tensor([params[i].temperature for i in hot], device=logits.device, dtype=logits.dtype)
        top_p = torch.tensor([params[i].top_p for i in hot], device=logits.device, dtype=logits.dtype)
        probs = _top_p(torch.softmax(logits[index] / temperature[:, None], dim=-1), top_p)
        noise = torch.empty_like(probs)
        for j, i in enumerate(hot):
            noise[j].exponential_(generator=generators[i] or shared)
        tokens[index] = (probs / noise).argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def top_alternatives(logits: torch.Tensor, counts: list[int]) -> list[list[tuple[int, float]]]:
    """Per row, its `counts[i]` most likely (token id, logprob) pairs under the unscaled distribution
    (the one `sample_tokens` reports logprobs under), most likely first; [] for a count of 0.
    One top-k over the rows that ask: only requests with `top_logprobs` pay for it."""
    out: list[list[tuple[int, float]]] = [[] for _ in counts]
    rows = [i for i, k in enumerate(counts) if k]
    if not rows:
        return out
    values, ids = torch.log_softmax(logits[rows].float(), dim=-1).topk(max(counts), dim=-1)
    for row, row_ids, row_values in zip(rows, ids.tolist(), values.tolist(), strict=True):
        out[row] = list(zip(row_ids, row_values, strict=True))[: counts[row]]
    return out


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail outside each row's nucleus (the smallest set of tokens whose mass reaches top_p)."""
    if bool((top_p >= 1).all()):
        return probs
    ordered, order = probs.sort(dim=-1, descending=True)
    outside = (ordered.cumsum(dim=-1) - ordered) > top_p[:, None]
    outside &= (top_p < 1)[:, None]
    return probs.scatter(-1, order, ordered.masked_fill(outside, 0.0))


def finish_reason(row: Row, token: int, eos_ids: frozenset[int], tokenizer: Any) -> str | None:
    """"stop" (a stop token, EOS unless ignored, or a stop string in the decoded tail), "length", or None."""
    params = row.params
    if token in params.stop_token_ids or (token in eos_ids and not params.ignore_eos):
        return "stop"
    if params.stop:
        window = max(len(s) for s in params.stop) + _STOP_WINDOW_SLACK
        tail = tokenizer.decode(row.tokens[-window:], skip_special_tokens=True)
        if any(s in tail for s in params.stop):
            return "stop"
    if len(row.tokens) >= params.max_tokens:
        return "length"
    return None


def prefill_chunks(rows: list[Row], need: Callable[[tuple[int, ...]], int] = len) -> list[list[Row]]:
    """Group rows into prefill forwards. Identical prompts share a chunk (computed once); prompts go in
    order of the tokens they `need` computed, and a new chunk starts when a forward would hold more than
    `PREFILL_TOKENS` padded tokens, or more padding than work (padding is computed too)."""
    by_prompt: dict[tuple[int, ...], list[Row]] = {}
    for row in rows:
        by_prompt.setdefault(row.prompt, []).append(row)
    chunks: list[list[Row]] = []
    current: list[Row] = []
    distinct = work = 0
    for prompt in sorted(by_prompt, key=need):
        width = need(prompt)  # the widest so far: prompts come in increasing need
        padded = (distinct + 1) * width
        if current and (padded > PREFILL_TOKENS or padded > 2 * (work + width)):
            chunks.append(current)
            current, distinct, work = [], 0, 0
        current.extend(by_prompt[prompt])
        distinct, work = distinct + 1, work + width
    if current:
        chunks.append(current)
    return chunks


def left_padded(prompts: list[tuple[int, ...]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of `prompts`, right-aligned so every prompt's next token is last."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def _left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def check_full_attention(cache: DynamicCache) -> None:
    """Joining and shrinking assume every layer caches all positions (no sliding window, no state)."""
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        kinds = sorted({type(layer).__name__ for layer in cache.layers})
        raise EngineError(f"the HF engine batches full-attention KV caches only; this model uses {kinds}")


def settle(job: Job, *, result: list[Any] | None = None, exc: BaseException | None = None) -> None:
    """Answer `job` once: a later failure of a job already answered changes nothing."""
    if job.future.done():
        return
    if exc is not None:
        job.future.set_exception(exc)
    else:
        job.future.set_result(result)  # type: ignore[arg-type]
