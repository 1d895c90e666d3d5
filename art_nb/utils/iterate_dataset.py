"""`iterate_dataset`: the scenarios of each training step, shuffled per epoch, resumable at any step.

The dataset is anything with `len()` and integer indexing: a list, a tuple, or a Hugging Face
`datasets.Dataset` (whose rows come back as dicts). Rows are read by index only when their batch is
yielded, so a large Dataset is never copied into a list and a resumed run reads no skipped rows.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

__all__ = ["DatasetBatch", "IndexedDataset", "iterate_dataset"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class IndexedDataset(Protocol[T_co]):
    """What `iterate_dataset` reads: a length and row `i` (a `Sequence`, a `datasets.Dataset`)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> T_co: ...


@dataclass(frozen=True)
class DatasetBatch(Generic[T]):
    items: list[T]
    step: int
    epoch: int
    epoch_step: int


def iterate_dataset(
    dataset: IndexedDataset[T],
    groups_per_step: int = 1,
    num_epochs: int = 1,
    initial_step: int = 0,
    use_tqdm: bool = True,
    *,
    shuffle: bool = True,
    seed: int = 0,
) -> Iterator[DatasetBatch[T]]:
    """Batches of `groups_per_step` scenarios, one per training step, over `num_epochs` epochs.

    Resumable: `initial_step=await model.get_step()` yields exactly the batches a run that was never
    interrupted would have seen from that step on. Epoch `e` is shuffled by `random.Random(seed + e)`:
    with the default seed 0 that is the order ART's `iterate_dataset` gives (it seeds the global
    generator with the epoch number; this one leaves the global generator alone). A
    `datasets.Dataset` gives the same batches as the list of its rows would.
    """
    _check_indexed(dataset)
    if groups_per_step < 1:
        raise ValueError(f"groups_per_step must be >= 1; got {groups_per_step}")
    if len(dataset) == 0:
        raise ValueError("dataset is empty: give iterate_dataset at least one scenario")
    steps_per_epoch = -(-len(dataset) // groups_per_step)
    total = steps_per_epoch * num_epochs
    bar = None
    if use_tqdm:
        from .progress import progress_bar

        bar = progress_bar(total=total, initial=min(initial_step, total), desc="steps", dynamic_ncols=True)
    try:
        for epoch in range(num_epochs):
            order = list(range(len(dataset)))
            if shuffle:
                random.Random(seed + epoch).shuffle(order)
            for epoch_step in range(steps_per_epoch):
                step = epoch * steps_per_epoch + epoch_step
                if step < initial_step:
                    continue
                picked = order[epoch_step * groups_per_step : (epoch_step + 1) * groups_per_step]
                yield DatasetBatch([dataset[i] for i in picked], step, epoch, epoch_step)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _check_indexed(dataset: object) -> None:
    """Say how to fix the two near misses: a dict of splits and a stream without a length."""
    if isinstance(dataset, Mapping):  # a datasets.DatasetDict is a dict of splits
        raise TypeError(f"iterate_dataset takes one split, not a mapping of {sorted(map(str, dataset))}: "
                        "pass e.g. dataset['train']")
    if not isinstance(dataset, Sized):
        raise TypeError(f"iterate_dataset needs len() and indexing; {type(dataset).__name__} has no len() "
                        "(a generator or a streaming IterableDataset): make a list or a datasets.Dataset of it first")
