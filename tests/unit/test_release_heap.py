"""The heap around a backend: frozen with the oldest generation collected rarer while it serves, and
the process's own collector settings back once it closes."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from art_nb.local.release import OLDEST_RARER, freeze_heap, release_freed_memory


@pytest.fixture()
def thresholds() -> Iterator[None]:
    saved = gc.get_threshold()
    try:
        yield
    finally:
        release_freed_memory()
        gc.set_threshold(*saved)


def test_serving_collects_the_oldest_generation_rarer_and_close_restores(thresholds: None) -> None:
    gc.set_threshold(500, 7, 3)
    if gc.get_threshold()[2] != 3:
        pytest.skip("this interpreter's collector has no third generation threshold (an incremental one)")
    kept = [[] for _ in range(10)]
    freeze_heap()
    assert gc.get_threshold() == (500, 7, 3 * OLDEST_RARER)
    assert gc.get_freeze_count() > len(kept)
    freeze_heap()  # a second register: scaled once, not again
    assert gc.get_threshold() == (500, 7, 3 * OLDEST_RARER)
    release_freed_memory()
    assert gc.get_threshold() == (500, 7, 3)
    assert gc.get_freeze_count() == 0


def test_a_collector_turned_off_stays_off(thresholds: None) -> None:
    gc.set_threshold(0, 10, 10)
    freeze_heap()
    assert gc.get_threshold()[0] == 0
    release_freed_memory()
    assert gc.get_threshold() == (0, 10, 10)
