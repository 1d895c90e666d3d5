"""`strip_logprobs`: a copy of any nested structure without its "logprobs" (to keep traces small)."""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

__all__ = ["strip_logprobs"]


def strip_logprobs(obj: Any) -> Any:
    """A deep copy of `obj` with every "logprobs" key of a dict dropped and every `logprobs`
    attribute of an object (a Choice) set to None. `obj` itself is left as it was: trajectories
    still train on their logprobs after a tracer recorded the stripped copy. What cannot be copied
    is returned as it is."""
    try:
        copied = copy.deepcopy(obj)
    except Exception:  # noqa: BLE001 - e.g. an object holding a lock: better unstripped than lost
        return obj
    return _strip(copied)


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k != "logprobs"}
    if isinstance(obj, (list, tuple)):
        items = [_strip(v) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    if isinstance(obj, BaseModel):  # e.g. a Choice: its fields, then its extras (token_ids...)
        for name, value in list(vars(obj).items()):
            object.__setattr__(obj, name, None if name == "logprobs" else _strip(value))
        extra = obj.model_extra or {}
        for name in list(extra):
            extra[name] = None if name == "logprobs" else _strip(extra[name])
        return obj
    return obj
