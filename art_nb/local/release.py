"""The process's heap around a backend: kept out of the garbage collector's way while it serves, and
handed back to the system once it closes (or a register fails after its trainer was built).

Freezing: a registered model's process holds torch, transformers, the engine and the trainer, over half
a million objects the cyclic collector scans in every oldest-generation pass (0.28 s for the imports of
vLLM's CPU build alone on this project's 2-core box). Rollouts allocate enough to set such passes off,
and each one stops every thread, the engine's included, mid-batch. So once register has built
everything, `freeze_heap` moves what lives then out of the collector's sight (`gc.freeze`, as vLLM's own
server does after start-up, though vLLM 0.25 freezes before art_nb's trainer is built), and
`release_freed_memory` thaws it first, so a closed backend's cycles are collected again. Objects made
later (rollouts, steps, adapters) are collected as always; frozen ones are still freed by reference
counting, only cycles among them wait for the thaw.

What a rollout wave makes is still scanned: on the H200, a wave of 256 requests through the endpoint
left ~77,000 objects for each oldest-generation pass (136 ms a pass, ~1 us an object: their references
into the frozen heap miss the cache), and at the collector's default thresholds it set off one or two
such passes per wave. While a backend serves, the oldest generation is therefore collected a tenth as
often as the process had it (`OLDEST_RARER`: by default after 100 passes of the middle generation
instead of 10); the young generations keep their pace, so short-lived cycles are freed as soon as
before, and a collector the user turned off stays off; on a GPU each train step still ends with a full
collection (the trainer's, before it hands cached blocks back), so no cycle holds device memory past a
step. The thaw puts the thresholds back. (An incremental collector, which ignores the third threshold,
is left as it is.) On the 2-core CPU's model of a wave (bench/endpoint_wave_cpu.py) this took the one
full pass of each 256-request wave away, 5-9 ms there, and the wall time moved within its noise; what it
saves on the H200, where a pass took 50-140 ms, is on bench/results/h200's waiting list.

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

__all__ = ["OLDEST_RARER", "freeze_heap", "release_freed_memory"]

OLDEST_RARER = 10  # while a backend serves, the oldest generation's threshold is this many times the process's
_user_thresholds: tuple[int, ...] | None = None  # what the process had before the first freeze


def freeze_heap() -> None:
    global _user_thresholds
    gc.collect()
    gc.freeze()
    if _user_thresholds is None:
        _user_thresholds = young, middle, oldest = gc.get_threshold()
        gc.set_threshold(young, middle, oldest * OLDEST_RARER)


def release_freed_memory() -> None:
    global _user_thresholds
    gc.unfreeze()
    if _user_thresholds is not None:
        gc.set_threshold(*_user_thresholds)
        _user_thresholds = None
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
