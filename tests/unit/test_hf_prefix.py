"""The prefix cache's pure parts on hand-made tensors: matching, the byte budget, what replaces what,
adapters, refusing caches that do not keep every position, and the contiguous prefill layout."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from art_nb.local.engines.base import EngineError, SamplingParams
from art_nb.local.engines.hf.batch import PREFILL_TOKENS, Job, Row, prefill_chunks
from art_nb.local.engines.hf.prefix import MIN_REUSE_TOKENS, PrefixCache, chunk_inputs, common_prefix, filled_layer

LAYERS, HEADS, DIM = 2, 2, 4
BYTES_PER_TOKEN = LAYERS * 2 * HEADS * DIM * 4  # keys and values, float32


def kv_cache(rows: int, length: int, layer: type[DynamicLayer] = DynamicLayer) -> DynamicCache:
    """A cache whose key at (row, position) is row * 1000 + position everywhere, values the negative."""
    cache = DynamicCache()
    for _ in range(LAYERS):
        pos = torch.arange(length, dtype=torch.float32)[None, None, :, None]
        keys = (torch.arange(rows, dtype=torch.float32)[:, None, None, None] * 1000 + pos).expand(rows, HEADS, length, DIM)
        new = layer(sliding_window=8) if layer is DynamicSlidingWindowLayer else layer()
        cache.layers.append(filled_layer(new, keys.contiguous(), -keys.contiguous()))
    return cache


def seq(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def test_common_prefix() -> None:
    a = seq(0, 100)
    assert common_prefix(a, a) == 100
    assert common_prefix(a, a[:40]) == 40
    assert common_prefix(a, (*a[:57], 999, *a[58:])) == 57
    assert common_prefix(a, (5,)) == 0
    assert common_prefix((), a) == 0


def test_match_takes_the_longest_common_prefix_and_leaves_one_token_to_run() -> None:
    cache = PrefixCache(budget=10**9)
    base = seq(0, 40)
    assert cache.store(None, base, kv_cache(1, 40), 0)
    entry, reuse = cache.match(None, base + seq(100, 10))
    assert entry is not None and reuse == 40
    entry, reuse = cache.match(None, base)  # the same prompt again: its last token must still run
    assert entry is not None and reuse == 39
    entry, reuse = cache.match(None, base[:30] + seq(500, 20))  # diverges after 30: the first 30 are reused
    assert reuse == 30
    assert cache.match(None, base[: MIN_REUSE_TOKENS - 1] + seq(500, 20)) == (None, 0)  # too little to bother
    assert cache.match("adapter_0", base + seq(100, 10)) == (None, 0)  # other weights, other keys


def test_match_finds_the_best_entry_among_decoys() -> None:
    """Entries that agree with the prompt where the best so far stops agreeing, but diverge earlier, lose."""
    prompt = seq(0, 60)
    cache = PrefixCache(budget=10**9)
    cache.store(None, prompt[:40] + seq(900, 10), kv_cache(1, 50), 0)  # the best: 40 shared
    cache.store(None, prompt[:20] + (999,) + prompt[21:45], kv_cache(1, 45), 0)  # agrees at 40, diverges at 20
    cache.store(None, prompt[:25] + seq(700, 20), kv_cache(1, 45), 0)  # most recent: looked at first, 25 shared
    entry, reuse = cache.match(None, prompt)
    assert reuse == 40 and entry is not None and entry.tokens[40] == 900


def test_store_copies_the_rows_last_columns() -> None:
    cache = PrefixCache(budget=10**9)
    batch = kv_cache(3, 50)  # row 1's sequence is its last 20 columns (left padding before them)
    assert cache.store(None, seq(0, 20), batch, 1)
    entry, _ = cache.match(None, seq(0, 21))
    assert entry is not None
    keys, values = entry.layers[0]
    assert keys.shape == (HEADS, 20, DIM)
    torch.testing.assert_close(keys[0, :, 0], 1000 + torch.arange(30, 50, dtype=torch.float32))
    torch.testing.assert_close(values, -keys)
    batch.layers[0].keys.add_(1)  # the batch moves on; the entry is a copy
    torch.testing.assert_close(entry.layers[0][0][0, :, 0], 1000 + torch.arange(30, 50, dtype=torch.float32))
    assert cache.nbytes == 20 * BYTES_PER_TOKEN == entry.nbytes


def test_a_longer_sequence_replaces_its_prefixes_and_a_prefix_of_an_entry_is_not_stored() -> None:
    cache = PrefixCache(budget=10**9)
    turn1 = seq(0, 30)
    turn2 = turn1 + seq(200, 20)
    assert cache.store(None, turn1, kv_cache(1, 30), 0)
    assert cache.store("adapter_0", turn1, kv_cache(1, 30), 0)
    assert cache.store(None, turn2, kv_cache(1, 50), 0)
    assert len(cache) == 2 and cache.nbytes == (30 + 50) * BYTES_PER_TOKEN  # turn1 under None is gone, not adapter_0's
    assert not cache.store(None, turn1, kv_cache(1, 30), 0)  # turn2 already serves whatever turn1 would
    assert len(cache) == 2
    assert cache.store(None, turn1 + seq(300, 5), kv_cache(1, 35), 0)  # a sibling: both kept
    assert len(cache) == 3


def test_budget_evicts_least_recently_used_and_resize_zero_turns_it_off() -> None:
    cache = PrefixCache(budget=100 * BYTES_PER_TOKEN)
    a, b, c = seq(0, 40), seq(1000, 40), seq(2000, 40)
    cache.store(None, a, kv_cache(1, 40), 0)
    cache.store(None, b, kv_cache(1, 40), 0)
    assert cache.match(None, a + (7,))[0] is not None  # a used: b is now the oldest
    cache.store(None, c, kv_cache(1, 40), 0)
    assert cache.nbytes == 80 * BYTES_PER_TOKEN <= cache.budget and cache.evictions == 1
    assert cache.match(None, b + (7,)) == (None, 0)
    assert cache.match(None, a + (7,))[0] is not None and cache.match(None, c + (7,))[0] is not None
    assert not cache.store(None, seq(5000, 101), kv_cache(1, 101), 0)  # larger than the whole budget
    cache.resize(0)
    assert len(cache) == 0 and cache.nbytes == 0
    assert not cache.store(None, a, kv_cache(1, 40), 0) and cache.match(None, a + (7,)) == (None, 0)


def test_dropping_an_adapter_forgets_only_its_entries_and_clear_forgets_all() -> None:
    cache = PrefixCache(budget=10**9)
    for adapter in (None, "adapter_0", "adapter_1"):
        cache.store(adapter, seq(0, 20), kv_cache(1, 20), 0)
    cache.drop_adapters(["adapter_0"])
    assert cache.match("adapter_0", seq(0, 30)) == (None, 0)
    assert cache.match("adapter_1", seq(0, 30))[1] == 20 and cache.match(None, seq(0, 30))[1] == 20
    assert cache.nbytes == 2 * 20 * BYTES_PER_TOKEN
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_a_cache_that_does_not_keep_every_position_is_refused() -> None:
    cache = PrefixCache(budget=10**9)
    with pytest.raises(EngineError, match="full-attention"):
        cache.store(None, seq(0, 20), kv_cache(1, 20, DynamicSlidingWindowLayer), 0)
    assert len(cache) == 0


def test_chunk_inputs_keep_every_row_contiguous_and_reuse_what_fits() -> None:
    cache = PrefixCache(budget=10**9)
    cache.store(None, seq(0, 40), kv_cache(1, 40), 0)
    long_hit = seq(0, 40) + seq(100, 10)  # 40 cached, 10 new
    short_hit = seq(0, 30) + seq(300, 4)  # 30 cached, 4 new: reuses 34 - 10 = 24, recomputes 6 in padding's place
    miss = seq(7000, 6)
    prompts = [long_hit, short_hit, miss]
    inputs = chunk_inputs(prompts, [cache.match(None, p) for p in prompts], pad_id=0, device=torch.device("cpu"))
    assert inputs.reused == [40, 24, 0]
    assert inputs.ids.shape == (3, 10) and inputs.mask.shape == (3, 50)
    for i, prompt in enumerate(prompts):
        row = inputs.mask[i].tolist()
        first = row.index(1)
        assert row[first:] == [1] * len(prompt) and sum(row) == len(prompt)  # padding, then one run of tokens
        assert inputs.ids[i, 10 - (len(prompt) - inputs.reused[i]):].tolist() == list(prompt[inputs.reused[i]:])
        new = len(prompt) - inputs.reused[i]
        assert inputs.positions[i, 10 - new:].tolist() == list(range(inputs.reused[i], len(prompt)))
    keys = inputs.cache.layers[0].keys
    assert keys.shape == (3, HEADS, 40, DIM)
    torch.testing.assert_close(keys[1, 0, 16:, 0], torch.arange(24, dtype=torch.float32))  # the entry's first 24
    assert not keys[1, :, :16].any() and not keys[2].any()


def test_chunk_inputs_without_hits_are_a_plain_left_padded_prefill() -> None:
    prompts = [seq(0, 5), seq(10, 3)]
    inputs = chunk_inputs(prompts, [(None, 0), (None, 0)], pad_id=9, device=torch.device("cpu"))
    assert inputs.reused == [0, 0] and len(inputs.cache.layers) == 0
    assert inputs.ids.tolist() == [[0, 1, 2, 3, 4], [9, 9, 10, 11, 12]]
    assert inputs.mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
    assert inputs.positions.tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]]


def _rows(prompts: list[tuple[int, ...]]) -> list[Row]:
    job = Job(asyncio.get_running_loop().create_future(), [], None)
    return [Row(job, i, p, SamplingParams(), None) for i, p in enumerate(prompts)]


async def test_prefill_chunks_group_by_work_needed() -> None:
    hits = [seq(1000 * i, 500) for i in range(4)]  # long prompts, but each needs only 20 tokens run
    miss = seq(9000, 400)
    need = {p: 20 for p in hits} | {miss: 400}
    rows = _rows([miss, *hits, hits[0]])
    chunks = prefill_chunks(rows, lambda p: need[p])
    assert [[r.prompt for r in c] for c in chunks] == [[hits[0], hits[0], *hits[1:]], [miss]]  # the miss would make the hits recompute
    assert [len(c) for c in prefill_chunks(rows)] == [6]  # by length alone: 5 x 500 padded vs 2,400 real, one forward
    big = _rows([seq(i * 10_000, PREFILL_TOKENS // 2) for i in range(3)])
    assert [len(c) for c in prefill_chunks(big)] == [2, 1]  # the token budget still splits


def test_the_gpu_budget_asks_torch_with_a_device_index(monkeypatch) -> None:
    """torch.device("cuda") has no index, and torch's memory-fraction getter refuses it (ValueError):
    the T4 configuration's register failed on the H200 until the budget passed an index."""
    import types

    import torch

    from art_nb.local.engines.hf.prefix import CUDA_SHARE, default_budget

    asked: list[object] = []

    def fraction(index: object) -> float:
        asked.append(index)
        if not isinstance(index, int):
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{index}")
        return 0.5

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(total_memory=16 * 2**30))
    assert default_budget(torch.device("cuda")) == int(16 * 2**30 * 0.5 * CUDA_SHARE)
    assert default_budget(torch.device("cuda", 0)) == int(16 * 2**30 * 0.5 * CUDA_SHARE)
    assert asked == [0, 0]
