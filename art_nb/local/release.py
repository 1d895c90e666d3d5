"""Handing freed memory back to the system once a backend closes (or a register fails after its trainer
was built).

A closed backend's model, optimizer and caches are freed, but glibc keeps freed heap pages in the
arenas of the threads that used them: on SmolLM2-135M on CPU, each register + train step + close left
about 0.5 GB resident (and the loop's threads) without this, none with it (`bench/backend_close_memory.py`:
2.62 vs 0.52 GiB after 4 cycles), so a notebook or a test process that closes one backend and registers
the next grew with every cycle. CUDA's caching allocator holds freed blocks the same way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys

__all__ = ["release_freed_memory"]


def release_freed_memory() -> None:
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
    if sys.platform.startswith("linux"):
        name = ctypes.util.find_library("c")
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError, TypeError):  # musl and other libcs have no malloc_trim
            pass
