"""`HFEngine`'s prefix cache: the KV of sequences already computed, reused when a later prompt starts the same way.

A rollout's next turn sends the whole conversation again: the previous prompt, the sampled reply and a
new user message. Prefilling it from the start every turn makes a 40-move game quadratic. So the
engine keeps, per adapter, the KV of every finished row (its prompt and reply) and of every prompt it
had to prefill from scratch (the games of a group that share a first prompt then compute it once).
A new prompt takes the longest common prefix with an entry of its adapter, and only the rest is
prefilled. Matching by common prefix rather than "starts with an entry" also covers a reply the chat
template re-renders with other ids than were sampled: the ids agree up to there.

Exact: with every layer caching every position (`check_full_attention`), position i's keys and values
depend on tokens 0..i and the weights only, so a cached prefix is what a full prefill computes (to
float rounding). Entries are keyed by the engine's internal adapter name, which is never reused: new
weights under a public name get a new internal name, and the engine drops an adapter's entries when
it deletes the adapter. Bounded: one LRU over all entries within a byte budget.

A chunk's rows stay contiguous in the cache (padding, then reused tokens, then new ones) like a plain
left-padded prefill, so relative distances, and with them sliding-window masks, are what a full
prefill sees. The price: in a chunk whose new parts differ in length, a row reuses fewer tokens than
it could and recomputes the rest in place of padding, which costs the same forward.
"""

from __future__ import annotations

import inspect
import itertools
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .batch import check_full_attention, left_padded

__all__ = ["MIN_REUSE_TOKENS", "ChunkInputs", "Entry", "PrefixCache", "chunk_inputs", "common_prefix",
           "default_budget", "filled_layer"]

# Share of the serving device's memory the prefix cache may hold by default: RAM on CPU (plentiful
# next to a small model), less of a GPU's, which the running batch and the weights need. A `ModelConfig`
# field is the intended knob; until then `HFEngine.create(prefix_cache_bytes=...)` sets it.
CPU_SHARE = 0.10
CUDA_SHARE = 0.05
# Fewer shared tokens than this are not worth a copy: every chat prompt shares its first few tokens.
MIN_REUSE_TOKENS = 16


def default_budget(device: torch.device) -> int:
    """Bytes the prefix cache holds on `device` unless told otherwise (see CPU_SHARE, CUDA_SHARE).

    On a GPU, a share of this process's cap (`torch.cuda.set_per_process_memory_fraction`: a shared GPU,
    or a bigger GPU standing in for a T4) rather than of the whole device.
    """
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index  # torch wants an index
        fraction = 1.0
        if hasattr(torch.cuda, "get_per_process_memory_fraction"):  # third-party: absent before torch 2.6
            fraction = min(1.0, float(torch.cuda.get_per_process_memory_fraction(index)))
        return int(torch.cuda.get_device_properties(index).total_memory * fraction * CUDA_SHARE)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows): assume a modest machine
        total = 8 * 1024**3
    return int(total * CPU_SHARE)


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix, by bisection on slices (compared in C, not token by token)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(eq=False)
class Entry:
    """One cached sequence: per layer, keys and values of shape [heads, len(tokens), head_dim]."""

    adapter: str | None
    tokens: tuple[int, ...]
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    nbytes: int


class PrefixCache:
    """Cached KV by (adapter, token ids), least recently used evicted first, within `budget` bytes.

    The engine's model thread stores and matches; `resize` and `clear` may come from any thread
    (a benchmark turning the cache off), hence the lock, never contended in serving.
    """

    def __init__(self, budget: int) -> None:
        self._budget = max(0, budget)
        # Keyed by a serial number: a key of token ids would be hashed, all of it, on every lookup.
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._serial = itertools.count()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.evictions = 0

    @property
    def budget(self) -> int:
        return self._budget

    def __len__(self) -> int:
        return len(self._entries)

    def resize(self, budget: int) -> None:
        """Hold at most `budget` bytes from now on (0 turns the cache off), evicting what no longer fits."""
        with self._lock:
            self._budget = max(0, budget)
            self._evict()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def drop_adapters(self, adapters: list[str]) -> None:
        """Forget the entries computed with `adapters`: their weights are gone."""
        doomed = set(adapters)
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.adapter in doomed]:
                self._drop(key)

    def match(self, adapter: str | None, prompt: tuple[int, ...]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `prompt` and how many tokens of it to reuse: fewer
        than the whole prompt (its last token must run to give the next token's logits), and 0 under
        `MIN_REUSE_TOKENS`."""
        best, best_key, shared = None, -1, 0
        with self._lock:
            for key, entry in reversed(self._entries.items()):  # recent first: likely the best
                if shared == len(prompt):
                    break
                # To beat the best so far an entry must agree where the best stops agreeing: a one-token
                # test that rejects almost every other entry without comparing prefixes.
                tokens = entry.tokens
                if entry.adapter == adapter and len(tokens) > shared and tokens[shared] == prompt[shared]:
                    n = common_prefix(tokens, prompt)
                    if n > shared:
                        best, best_key, shared = entry, key, n
            reuse = min(shared, len(prompt) - 1)
            if best is None or reuse < MIN_REUSE_TOKENS:
                return None, 0
            self._entries.move_to_end(best_key)
        return best, reuse

    def store(self, adapter: str | None, tokens: tuple[int, ...], cache: DynamicCache, row: int) -> bool:
        """Keep a copy of the last `len(tokens)` cache columns of batch row `row` as the KV of `tokens`.

        Not stored when an entry already extends `tokens` (it serves every prompt this one would) or
        when it alone exceeds the budget; entries that `tokens` extends are replaced by it.
        """
        if not tokens or self._budget == 0:
            return False
        check_full_attention(cache)
        n = len(tokens)
        nbytes = sum(2 * layer.keys[row, :, -n:].numel() * layer.keys.element_size() for layer in cache.layers)
        with self._lock:
            if nbytes > self._budget:
                return False
            for key in [k for k, e in self._entries.items() if e.adapter == adapter]:
                other = self._entries[key].tokens  # the last-token tests skip most slice comparisons
                if len(other) >= n and other[n - 1] == tokens[-1] and other[:n] == tokens:
                    self._entries.move_to_end(key)
                    return False
                if len(other) < n and tokens[len(other) - 1] == other[-1] and tokens[: len(other)] == other:
                    self._drop(key)
            layers = [(layer.keys[row, :, -n:].clone(), layer.values[row, :, -n:].clone()) for layer in cache.layers]
            self._entries[next(self._serial)] = Entry(adapter, tokens, layers, nbytes)
            self.nbytes += nbytes
            self._evict()
        return True

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes

    def _evict(self) -> None:
        while self.nbytes > self._budget and self._entries:
            self._drop(next(iter(self._entries)))
            self.evictions += 1


@dataclass
class ChunkInputs:
    """One prefill forward: new ids [P, S], the mask over cache and new columns [P, K + S], their
    position ids [P, S], the cache holding the reused prefixes [P, heads, K, dim], and per prompt the
    tokens reused."""

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    cache: DynamicCache
    reused: list[int]


def chunk_inputs(prompts: list[tuple[int, ...]], matches: list[tuple[Entry | None, int]], pad_id: int,
                 device: torch.device) -> ChunkInputs:
    """Inputs that prefill `prompts` from their matched prefixes, every row contiguous and right-aligned.

    The forward is as wide as the most new tokens any prompt needs (S); each prompt reuses all but
    its last S tokens when its entry has them, so a row is [padding, reused, new] with no gap.
    """
    width = max(len(p) - reuse for p, (_, reuse) in zip(prompts, matches, strict=True))
    reused = [max(0, len(p) - width) for p in prompts]  # <= each match's reuse, by the choice of width
    ids, new_mask = left_padded([p[r:] for p, r in zip(prompts, reused, strict=True)], pad_id)
    past = max(reused)
    past_mask = torch.zeros((len(prompts), past), dtype=torch.long)
    for i, r in enumerate(reused):
        past_mask[i, past - r :] = 1
    mask = torch.cat([past_mask, new_mask], dim=1).to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
    cache = DynamicCache()
    if past:
        template = next(entry for entry, _ in matches if entry is not None)
        for layer_index, (k, v) in enumerate(template.layers):
            keys = k.new_zeros((len(prompts), k.shape[0], past, k.shape[2]))
            values = v.new_zeros((len(prompts), v.shape[0], past, v.shape[2]))
            for i, ((entry, _), r) in enumerate(zip(matches, reused, strict=True)):
                if r:
                    assert entry is not None
                    keys[i, :, past - r :] = entry.layers[layer_index][0][:, :r]
                    values[i, :, past - r :] = entry.layers[layer_index][1][:, :r]
            cache.layers.append(filled_layer(DynamicLayer(), keys, values))
    return ChunkInputs(ids.to(device), mask, positions, cache, reused)


def filled_layer(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    """`layer` holding `keys` and `values` as they are (its `update` would copy them once more).
    transformers 5 initialises a layer from both tensors, 4.56-4.57 (vLLM 0.11.2's T4 set) from the keys."""
    if _INIT_TAKES_VALUES:
        layer.lazy_initialization(keys, values)
    else:
        layer.lazy_initialization(keys)
    layer.keys, layer.values = keys, values
    return layer


_INIT_TAKES_VALUES = "value_states" in inspect.signature(DynamicLayer.lazy_initialization).parameters
