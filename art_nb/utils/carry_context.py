"""`carry_context`: a function bound to the caller's context, for a thread started by hand.

A `threading.Thread` starts with an empty context, so model calls made in it belong to no
trajectory and are not recorded (asyncio tasks, `asyncio.to_thread` and `ThreadPoolExecutor` work
carry the rollout's context; art_nb.capture.context says how). Binding the thread's target to a
copy of the rollout's context puts its calls back in the rollout's trajectory:
`threading.Thread(target=art.utils.carry_context(work), args=(...,)).start()`.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["carry_context"]

T = TypeVar("T")


def carry_context(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn`, run in a copy of the context this is called in (the open trajectory scope included).

    The copy is taken now, once: call the result in one thread (a context cannot be entered by two
    threads at once); for several threads, carry once per thread."""
    context = contextvars.copy_context()

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        return context.run(fn, *args, **kwargs)

    return run
