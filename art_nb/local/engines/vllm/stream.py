"""The CUDA stream vLLM's thread issues its work on: the device's default stream, or one of its own.

vLLM runs its forward passes on the calling thread's current stream, and so does the trainer; both
threads' current stream is the device's default (legacy) stream, where kernels run one after another
whichever thread queued them. A step that trains while the next rollouts decode (`art.pipeline`)
therefore cannot overlap on the GPU: on the H200 (3B) training beside the rollouts took 2.60 s
instead of 1.32 s and the rollouts 2.10 s instead of 1.38 s. `ART_NB_VLLM_STREAM` gives vLLM's
thread a stream of its own ("own"), or one at the device's highest priority ("high": decoding's short
kernels are scheduled ahead of training's), so the GPU may run both at once. "default" (the default)
keeps the shared stream: measured with "high" (bench/results/h200/pipeline_stream_high), the pipelined
step took 2.30 s against 2.54 s on the shared stream in an earlier run, but the rounds overlap and the
phases beside each other were no faster (training 2.65 s instead of 2.74 s): the two share the SMs
whichever stream they are queued on.

Device memory crosses between the streams only in calls on vLLM's thread (an adapter handed over on
the device, sleep and wake giving memory back and taking it), so each call first waits for what the
default stream has queued and returns only once its own work is done (`crossing`); decoding steps
do neither.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["STREAM_CHOICES", "STREAM_ENV", "EngineStream"]

STREAM_ENV = "ART_NB_VLLM_STREAM"
STREAM_CHOICES = ("default", "own", "high")
_HIGHEST = -100  # torch maps a priority beyond the device's range to its highest


class EngineStream:
    """The stream vLLM's thread issues work on, from `ART_NB_VLLM_STREAM` (checked when made: ValueError)."""

    def __init__(self) -> None:
        self.choice = os.environ.get(STREAM_ENV, "").strip().lower() or "default"
        if self.choice not in STREAM_CHOICES:
            raise ValueError(f"{STREAM_ENV}={self.choice!r}: expected one of {', '.join(STREAM_CHOICES)}")
        self._stream: Any = None
        if self.choice != "default":
            import torch

            if torch.cuda.is_available():
                self._stream = torch.cuda.Stream(priority=_HIGHEST if self.choice == "high" else 0)

    @property
    def reason(self) -> str | None:
        """What to show among the engine's choices, or None on the default stream."""
        if self._stream is None:
            return None
        return (f"vLLM issues its GPU work on a stream of its own{' at the highest priority' if self.choice == 'high' else ''} "
                f"({STREAM_ENV}={self.choice}), so training and decoding may overlap on the GPU")

    def issuing(self) -> contextlib.AbstractContextManager[Any]:
        """The context vLLM's thread runs in: its stream as the current one (nothing on the default stream)."""
        if self._stream is None:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.stream(self._stream)

    @contextlib.contextmanager
    def crossing(self) -> Iterator[None]:
        """Around a call on vLLM's thread: after the default stream's queued work, done when it returns."""
        if self._stream is None:
            yield
            return
        import torch

        self._stream.wait_stream(torch.cuda.default_stream(self._stream.device))
        try:
            yield
        finally:
            self._stream.synchronize()
