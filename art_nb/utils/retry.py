"""`retry`: call a function again when it raises one of `exceptions`, waiting longer each time."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["retry"]

F = TypeVar("F", bound=Callable[..., Any])
_log = logging.getLogger("art_nb")


def retry(
    max_attempts: int = 3,
    delay: float = 0.25,
    backoff_factor: float = 2.0,
    exceptions: type[BaseException] | tuple[type[BaseException], ...] = (Exception,),
    on_retry: Callable[[BaseException, int], Any] | None = None,
    *,
    backoff: float | None = None,
) -> Callable[[F], F]:
    """Retry on `exceptions` (one class or a tuple), sleeping `delay`, then `delay * backoff_factor`, ...

    An async function stays async and a sync one stays sync (as in ART). `on_retry(error, attempt)`
    is called before each new attempt; without it the retry is logged at WARNING. The last failure
    propagates unchanged. Each sleep is jittered by +-50% so many rollouts that failed together do
    not all retry at the same instant. `backoff` is art_nb's older name for `backoff_factor`.
    """
    if backoff is not None:
        backoff_factor = backoff
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1; got {max_attempts}")
    catch = exceptions if isinstance(exceptions, tuple) else (exceptions,)

    def wait_for(attempt: int) -> float:
        return delay * backoff_factor ** (attempt - 1) * (0.5 + random.random())

    def report(error: BaseException, attempt: int, name: str) -> None:
        if on_retry is not None:
            on_retry(error, attempt)
        else:
            _log.warning("retry %d/%d of %s after %s: %s", attempt, max_attempts, name, type(error).__name__, error)

    def decorate(func: F) -> F:
        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                for attempt in range(1, max_attempts + 1):
                    try:
                        return await func(*args, **kwargs)
                    except catch as error:
                        if attempt == max_attempts:
                            raise
                        report(error, attempt, func.__name__)
                        await asyncio.sleep(wait_for(attempt))
                raise AssertionError("unreachable")

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            for attempt in range(1, max_attempts + 1):
                try:
                    return func(*args, **kwargs)
                except catch as error:
                    if attempt == max_attempts:
                        raise
                    report(error, attempt, func.__name__)
                    time.sleep(wait_for(attempt))
            raise AssertionError("unreachable")

        return sync_wrapper  # type: ignore[return-value]

    return decorate
