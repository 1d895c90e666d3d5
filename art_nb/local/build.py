"""Register's build of a model's trainer and engine: in which order, and what runs at the same time.

`build` is the one place that knows; `Runtime._load` (runtime.py) calls it with the factories that
make the real engine and trainer, and the tests with fakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from art_nb.config import ModelConfig

from .phases import PhaseClock
from .release import release_freed_memory

if TYPE_CHECKING:
    from .engines.base import Engine
    from .engines.vllm.args import MemorySnapshot
    from .plan.choices import Plan
    from .trainers.base import Trainer

__all__ = ["build"]

_log = logging.getLogger("art_nb")
_T = TypeVar("_T")


async def build(plan: Plan, path: Path, config: ModelConfig, clock: PhaseClock, engine: Engine | None,
                create_engine: Callable[[Plan, Path, ModelConfig], Awaitable[Engine]],
                create_trainer: Callable[[Plan, Path, ModelConfig], Trainer]
                ) -> tuple[Engine, Trainer, MemorySnapshot | None]:
    """The trainer, and the engine unless one serves this base model already: what may overlap does.
    Also the memory snapshot a new vLLM engine was planned from (None otherwise), which a replacement
    for it must plan from too (Runtime._replace_engine).

    The order, and why no more of it overlaps:
    1. Unsloth is imported first (it asks to be imported before transformers, which vLLM and the
       peft trainer import; it imports vLLM itself too).
    2. The accelerator's free memory is read: the memory plan budgets the resident trainer itself,
       so it plans from the memory as it was before the trainer loaded (engines/vllm/args.planned_memory).
    3. The trainer builds while vLLM's modules import (CPU only), once accelerate, which both import
       and cannot import side by side, is imported (`_import_shared`).
    4. vLLM builds, with the trainer resident. Its `gpu_memory_utilization` is an absolute share
       of the device (requested = share x total, checked against the free memory when vLLM's worker
       starts, which the plan's share leaves room for beside the trainer), and vLLM measures its
       own use as differences from that start, so the resident trainer is not counted as vLLM's.
    vLLM and the trainer are not built at the same time: vLLM's profiler would count the trainer's
    allocations as its own activations (a smaller KV cache, or its "free memory grew" assertion
    when the trainer frees some), its CUDA graph capture fails when another thread allocates
    (torch captures in "global" mode), and both set torch's process-wide default dtype while
    building (two transformers loads in threads corrupted each other: `loading_alone`).
    A failure or an interrupt waits for the other half to stop, frees what was built, and raises
    the first error.
    """
    from .engines.vllm.args import memory_snapshot, planned_memory
    from .engines.vllm.startup import import_vllm

    trainer_phase, engine_phase = f"trainer ({plan.trainer})", f"engine ({plan.engine})"
    new_engine = engine is None
    clock.start(trainer_phase)
    if plan.trainer == "unsloth":
        from .plan.choices import import_unsloth

        _log.info("trainer: %s", await _to_thread_settled(import_unsloth))
    snapshot = await asyncio.to_thread(memory_snapshot) if new_engine and plan.engine == "vllm" \
        and plan.device == "cuda" else None
    if new_engine:
        clock.begin(engine_phase)
    overlap = new_engine and plan.engine == "vllm"
    if overlap:
        await _to_thread_settled(_import_shared)
    prepare = asyncio.ensure_future(_to_thread_settled(import_vllm if overlap else _nothing))
    trainer: Trainer | None = None
    try:
        trainer = await _to_thread_settled(create_trainer, plan, path, config)
        clock.end(trainer_phase)
        await prepare
        if engine is None:
            with planned_memory(snapshot):
                engine = await create_engine(plan, path, config)
        clock.end(engine_phase)
        return engine, trainer, snapshot
    except BaseException:
        if not prepare.done():  # a thread runs to its end: wait for it, keep the first error
            with contextlib.suppress(BaseException):
                await asyncio.shield(prepare)
        elif not prepare.cancelled():
            prepare.exception()  # retrieved: the first error is the one raised
        if trainer is not None:
            del trainer
            await asyncio.to_thread(release_freed_memory)  # what the trainer built for nothing
        raise


async def _to_thread_settled(function: Callable[..., _T], *args: object) -> _T:
    """`asyncio.to_thread`, but a cancelled caller waits for the thread to end before it re-raises:
    a build left running would overlap the next register's (see `loading_alone`)."""
    task = asyncio.ensure_future(asyncio.to_thread(function, *args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await task
        raise


def _nothing() -> None:
    return None


def _import_shared() -> None:
    """Import what the trainer and vLLM both import before they import side by side: two threads
    entering an import cycle at once leave one with a half-imported module. transformers 4.x's
    generation module imports accelerate.hooks, which imports its own package, which imports hooks
    back (vLLM 0.11.2, transformers 4.57.6: "cannot import name 'AlignDevicesHook'" in 2 of 3 runs);
    transformers 5's lazy top-level names import their modules on first use, from both threads (vLLM
    0.32's CPU build, transformers 5.19: "cannot import name 'PreTrainedConfig'" in 1 of 4 registers).
    None once these are imported first; the trainer imports them next anyway."""
    for name in ("accelerate", "transformers.modeling_utils"):
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)
