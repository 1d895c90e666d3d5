"""Inference engines behind the OpenAI endpoint. Importing this package loads no torch: `base` is
plain Python, and `HFEngine` is imported on first access."""

from __future__ import annotations

from typing import Any

from art_nb.local.engines.base import (
    ContextTooLongError,
    Engine,
    EngineDeadError,
    EngineError,
    GenerationRequest,
    Sample,
    SamplingParams,
)

__all__ = [
    "ContextTooLongError",
    "Engine",
    "EngineDeadError",
    "EngineError",
    "GenerationRequest",
    "HFEngine",
    "Sample",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    if name == "HFEngine":
        from art_nb.local.engines.hf.engine import HFEngine

        return HFEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
