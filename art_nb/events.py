"""A tiny publish/subscribe channel for progress events.

The core (gather, train) emits plain dicts; views (tqdm bars, the notebook dashboard, W&B) subscribe.
The core never calls `display()`, and a failing subscriber never breaks training.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = ["emit", "subscribe", "Event"]

Event = dict[str, Any]
_subscribers: list[Callable[[Event], None]] = []
_log = logging.getLogger("art_nb")


def subscribe(callback: Callable[[Event], None]) -> Callable[[], None]:
    """Call `callback(event)` for every event from now on; returns a function that unsubscribes."""
    _subscribers.append(callback)

    def unsubscribe() -> None:
        if callback in _subscribers:
            _subscribers.remove(callback)

    return unsubscribe


def emit(kind: str, **fields: Any) -> None:
    event = {"type": kind, "time": time.time(), **fields}
    for callback in list(_subscribers):
        try:
            callback(event)
        except Exception:  # noqa: BLE001 - a broken view must not stop training
            _log.exception("event subscriber %r failed on %s", callback, kind)
