"""Which of a model's steps the engine holds, for requests that name them (`name@step`).

The served step is loaded by the train step (step.py) and at register; an older step is loaded
from its checkpoint when a request asks for it, checked first (non-finite weights are refused:
they made every answer a 500, "Out of range float values are not JSON compliant"). At most
`ModelConfig.max_loaded_adapters` stay loaded: the least recently used old step is unloaded when
another comes in, and loaded again from disk if it is asked for again. A request pins its step
from the resolve until it is answered, so nothing it uses is unloaded under it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from .resume import check_finite
from .state import ModelState

__all__ = ["evict", "use_step"]


async def use_step(state: ModelState, step: int) -> Callable[[], Awaitable[None]]:
    """Make checkpoint `step` (> 0, on disk or served) servable and pin it; returns the release to
    await once the request is answered. KeyError when the step has no checkpoint; `CheckpointError`
    when its weights are not finite."""
    async with state.adapter_lock:
        if step not in state.loaded_adapters:
            if step not in state.store.steps():
                raise KeyError(step)
            await asyncio.to_thread(check_finite, state.store, step, "serve")
            await evict(state, room=1)  # first: the engine never holds more than the bound
            await state.engine.load_adapter(state.adapter_name(step), state.store.checkpoint_dir(step))
        state.loaded_adapters.add(step)
        state.loaded_adapters.pin(step)

    async def release() -> None:
        async with state.adapter_lock:
            state.loaded_adapters.unpin(step)
            await evict(state)

    return release


async def evict(state: ModelState, room: int = 0) -> None:
    """Unload the least recently used old steps beyond `max_loaded_adapters` less `room` (never the
    served one, nor one a request is using)."""
    for old in state.loaded_adapters.beyond(state.config.max_loaded_adapters - room, keep=state.step):
        state.loaded_adapters.discard(old)
        await state.engine.unload_adapter(state.adapter_name(old))
