"""Register's phases: each timed and named as it starts, the summary kept in choices["startup"]."""

from __future__ import annotations

import itertools

from art_nb.local.phases import PhaseClock


def test_each_phase_is_timed_and_announced_as_it_starts() -> None:
    ticks = itertools.count(0.0, 1.5)  # every clock read is 1.5 s after the previous one
    announced: list[str] = []
    clock = PhaseClock(announced.append, clock=lambda: next(ticks))  # began at 0.0
    clock.start("base model")  # 1.5
    clock.start("engine (vllm)")  # 3.0
    clock.start("trainer (unsloth)")  # 4.5
    summary = clock.finish()  # 6.0
    assert announced == ["base model", "engine (vllm)", "trainer (unsloth)"]
    assert clock.seconds == {"base model": 1.5, "engine (vllm)": 1.5, "trainer (unsloth)": 1.5}
    assert summary == "base model 1.5 s, engine (vllm) 1.5 s, trainer (unsloth) 1.5 s: 6.0 s in all"


def test_a_clock_without_phases_reports_the_total() -> None:
    ticks = iter([0.0, 2.0])
    assert PhaseClock(clock=lambda: next(ticks)).finish() == "2.0 s"


def test_overlapping_phases_keep_their_own_seconds_and_the_total_is_the_wall_time() -> None:
    ticks = iter([0.0, 1.0, 3.0, 5.0, 9.0, 10.0])
    clock = PhaseClock(clock=lambda: next(ticks))  # began at 0.0
    clock.start("trainer (unsloth)")  # 1.0
    clock.begin("engine (vllm)")  # 3.0, alongside the trainer
    clock.end("trainer (unsloth)")  # 5.0
    clock.start("checkpoint 0")  # 9.0: ends the engine
    summary = clock.finish()  # 10.0
    assert clock.seconds == {"trainer (unsloth)": 4.0, "engine (vllm)": 6.0, "checkpoint 0": 1.0}
    assert summary == ("trainer (unsloth) 4.0 s, engine (vllm) 6.0 s (2.0 s of it alongside trainer (unsloth)), "
                       "checkpoint 0 1.0 s: 10.0 s in all")  # 10 s of wall time, 11 s of phases
