"""`limit_concurrency`: at most `n` calls of an async function at once, per key."""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["limit_concurrency"]

T = TypeVar("T")


def limit_concurrency(
    n: int, derive_key: Callable[..., str] | None = None
) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
    """At most `n` calls of the decorated async function run at once, per event loop and per key.

    `derive_key(*args, **kwargs)` (as in ART) gives each key its own limit, e.g. one per API host.
    Semaphores are kept per event loop, weakly: a semaphore is bound to the loop it first waited on,
    and a notebook that runs `asyncio.run` twice would otherwise reuse one from a closed loop.
    """
    if n < 1:
        raise ValueError(f"limit_concurrency needs n >= 1; got {n}")
    semaphores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Semaphore]] = (
        weakref.WeakKeyDictionary())

    def decorate(func: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> T:
            key = derive_key(*args, **kwargs) if derive_key is not None else ""
            per_key = semaphores.setdefault(asyncio.get_running_loop(), {})
            async with per_key.setdefault(key, asyncio.Semaphore(n)):
                return await func(*args, **kwargs)

        return wrapper

    return decorate
