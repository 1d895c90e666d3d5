"""Workarounds for quirks of the libraries we build on, each in one place with the reason it exists.

Engines and trainers both wrap models with peft; the workaround lives here so neither imports the other.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

__all__ = ["quiet_checkpointing_alias"]


@contextlib.contextmanager
def quiet_checkpointing_alias() -> Iterator[None]:
    """Hide the one FutureWarning peft causes while it wraps a model or loads an adapter.

    peft (0.21) reads `model.is_gradient_checkpointing` while wrapping a model, an alias that
    transformers 5 deprecated with a FutureWarning; the user did nothing to cause it and can do
    nothing about it. Only that message is filtered, only while the wrap runs. (`catch_warnings`
    swaps the process's filter list: a wrap is short and happens at load or adapter swap.)
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        yield
