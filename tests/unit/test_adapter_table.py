"""The HF engine's adapter names and slots (local/engines/hf/batch.AdapterTable): which retired slot is kept to be filled
again, and when it goes. Pure bookkeeping, no model; tests/integration/test_hf_engine.py checks the weights."""

from __future__ import annotations

from art_nb.local.engines.hf.batch import AdapterTable


def test_a_retired_slot_from_memory_is_kept_and_refilled_for_the_same_config_only() -> None:
    table = AdapterTable()
    first, refill = table.new_internal("cfg")
    assert not refill
    table.bind("m", first)
    second, _ = table.new_internal("cfg")
    table.bind("m", second)  # retires the first
    assert table.take_unused() == [] and table.spare == first  # kept, not deleted
    assert table.new_internal("other")[1] is False  # another config never gets it
    assert table.new_internal("cfg") == (first, True) and table.spare is None


def test_slots_from_files_and_failed_fills_are_never_kept() -> None:
    table = AdapterTable()
    from_files, _ = table.new_internal(None)
    table.bind("m", from_files)
    failed, _ = table.new_internal("cfg")
    table.abandon(failed)
    fresh, _ = table.new_internal("cfg")
    table.bind("m", fresh)  # retires the slot read from files
    assert sorted(table.take_unused()) == sorted([from_files, failed]) and table.spare is None


def test_a_slot_in_use_waits_and_nothing_is_kept_once_no_name_is_bound() -> None:
    table = AdapterTable()
    first, _ = table.new_internal("cfg")
    table.bind("m", first)
    table.acquire(first)  # a request still decodes with it
    second, _ = table.new_internal("cfg")
    table.bind("m", second)
    assert table.take_unused() == [] and table.spare is None
    assert table.release(first)
    assert table.take_unused() == [] and table.spare == first
    table.unbind("m")
    assert sorted(table.take_unused()) == sorted([first, second]) and table.spare is None


def test_a_newer_retired_slot_replaces_a_spare_whose_config_no_longer_comes() -> None:
    """Otherwise one adapter of another config (a one-off load) would block refills for good."""
    table = AdapterTable()
    odd, _ = table.new_internal("one-off")
    table.bind("m", odd)
    first, _ = table.new_internal("cfg")
    table.bind("m", first)
    assert table.take_unused() == [] and table.spare == odd
    second, _ = table.new_internal("cfg")
    table.bind("m", second)
    assert table.take_unused() == [odd] and table.spare == first
    assert table.new_internal("cfg") == (first, True)
