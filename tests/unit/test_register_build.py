"""Register's build (art_nb/local/build.py) with a fake engine and trainer: what overlaps, in which
order, and what a failure or an interrupt leaves behind."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from pathlib import Path

import pytest

from art_nb.config import ModelConfig
from art_nb.local import build as build_module
from art_nb.local.build import build
from art_nb.local.engines.vllm import args as vllm_plan
from art_nb.local.engines.vllm import startup
from art_nb.local.phases import PhaseClock
from art_nb.local.plan import choices as availability
from art_nb.local.plan.choices import Plan

PLAN = Plan(device="cpu", dtype="float32", engine="vllm", trainer="peft", load_in_4bit=False, cpu_threads=None)
STEP = 0.4


class FakeTrainer:
    pass


class FakeEngine:
    closed = False


@pytest.fixture
def events(monkeypatch) -> list[str]:
    log: list[str] = []

    def slow_import() -> None:
        log.append("import vllm")
        time.sleep(STEP)
        log.append("vllm imported")

    monkeypatch.setattr(startup, "import_vllm", slow_import)
    monkeypatch.setattr(build_module, "_import_shared", lambda: log.append("import shared"))
    monkeypatch.setattr(availability, "import_unsloth", lambda: log.append("import unsloth") or "imported")
    return log


def slow_trainer(log: list[str], fail: bool = False):
    def create(plan: Plan, path: Path, config: ModelConfig) -> FakeTrainer:
        log.append("trainer")
        time.sleep(STEP)
        if fail:
            raise RuntimeError("trainer failed")
        log.append("trainer built")
        return FakeTrainer()
    return create


def engine_factory(log: list[str], fail: bool = False):
    async def create(plan: Plan, path: Path, config: ModelConfig) -> FakeEngine:
        log.append("engine")
        await asyncio.sleep(0.05)
        if fail:
            raise RuntimeError("engine failed")
        return FakeEngine()
    return create


def test_the_trainer_builds_while_vllm_imports_and_vllm_builds_after(events):
    clock = PhaseClock()
    began = time.perf_counter()
    engine, trainer, snapshot = asyncio.run(build(PLAN, Path("m"), ModelConfig(), clock, None,
                                                  engine_factory(events), slow_trainer(events)))
    wall = time.perf_counter() - began
    assert isinstance(engine, FakeEngine) and isinstance(trainer, FakeTrainer)
    assert snapshot is None  # only a new vLLM engine on CUDA is planned from a snapshot
    assert wall < 2 * STEP  # the import and the trainer overlapped (their sum is 2 x STEP)
    assert events[0] == "import shared" and set(events[1:3]) == {"import vllm", "trainer"}  # accelerate first
    assert events[-1] == "engine" and events.index("engine") > events.index("trainer built")  # never at once
    summary = clock.finish()
    assert "engine (vllm)" in summary and "of it alongside trainer (peft)" in summary
    assert clock.seconds["trainer (peft)"] >= STEP and clock.seconds["engine (vllm)"] >= STEP


def test_unsloth_is_imported_before_anything_else(events):
    plan = Plan(device="cpu", dtype="float32", engine="vllm", trainer="unsloth", load_in_4bit=False, cpu_threads=None)
    asyncio.run(build(plan, Path("m"), ModelConfig(), PhaseClock(), None, engine_factory(events), slow_trainer(events)))
    assert events[0] == "import unsloth"


def test_a_running_engine_is_reused_and_nothing_is_imported(events):
    running = FakeEngine()
    engine, _, snapshot = asyncio.run(build(PLAN, Path("m"), ModelConfig(), PhaseClock(), running,
                                            engine_factory(events), slow_trainer(events)))
    assert snapshot is None
    assert engine is running and "engine" not in events and "import vllm" not in events


def test_a_failed_trainer_waits_for_the_import_and_builds_no_engine(events):
    with pytest.raises(RuntimeError, match="trainer failed"):
        asyncio.run(build(PLAN, Path("m"), ModelConfig(), PhaseClock(), None, engine_factory(events),
                          slow_trainer(events, fail=True)))
    assert "vllm imported" in events and "engine" not in events


def test_a_failed_engine_frees_the_trainer(events):
    built: list[weakref.ref] = []

    def create(plan: Plan, path: Path, config: ModelConfig) -> FakeTrainer:
        trainer = FakeTrainer()
        built.append(weakref.ref(trainer))
        return trainer

    with pytest.raises(RuntimeError, match="engine failed"):
        asyncio.run(build(PLAN, Path("m"), ModelConfig(), PhaseClock(), None, engine_factory(events, fail=True), create))
    gc.collect()
    assert built and built[0]() is None


def test_an_interrupt_waits_for_the_threads_and_builds_no_engine(events):
    alive: list[threading.Thread] = []

    def create(plan: Plan, path: Path, config: ModelConfig) -> FakeTrainer:
        alive.append(threading.current_thread())
        time.sleep(STEP)
        events.append("trainer built")
        return FakeTrainer()

    async def interrupted() -> None:
        task = asyncio.ensure_future(build(PLAN, Path("m"), ModelConfig(), PhaseClock(), None,
                                           engine_factory(events), create))
        await asyncio.sleep(STEP / 4)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(interrupted())
    assert "trainer built" in events and "vllm imported" in events  # returned only once both had ended
    assert "engine" not in events


def test_the_engine_is_planned_from_memory_read_before_the_trainer(events, monkeypatch):
    plan = Plan(device="cuda", dtype="bfloat16", engine="vllm", trainer="peft", load_in_4bit=False, cpu_threads=None)
    free = [80]
    monkeypatch.setattr(vllm_plan, "memory_snapshot", lambda: (free[0], 141, 141, None))
    seen: list[object] = []

    def create_trainer(plan: Plan, path: Path, config: ModelConfig) -> FakeTrainer:
        free[0] -= 30  # the trainer's weights
        return FakeTrainer()

    async def create_engine(plan: Plan, path: Path, config: ModelConfig) -> FakeEngine:
        seen.append(vllm_plan._plannable_memory(None))
        return FakeEngine()

    _, _, snapshot = asyncio.run(build(plan, Path("m"), ModelConfig(), PhaseClock(), None, create_engine,
                                       create_trainer))
    assert seen == [(80, 141, 141, None)]
    assert snapshot == (80, 141, 141, None)  # kept for an engine that replaces this one (Runtime._replace_engine)


def test_what_both_sides_import_is_imported_before_they_overlap() -> None:
    """The trainer and vLLM import side by side; the modules both enter (accelerate, transformers' model
    base) are imported first, in a fresh interpreter, so neither thread meets the other half-imported."""
    import subprocess
    import sys

    pytest.importorskip("transformers")
    code = ("import sys; from art_nb.local.build import _import_shared; _import_shared(); "
            "print('transformers.modeling_utils' in sys.modules, 'transformers.configuration_utils' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.split() == ["True", "True"]
