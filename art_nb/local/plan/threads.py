"""How many torch threads the CPU engine and trainer use, chosen on purpose and reported with a reason.

torch defaults to one intra-op thread per physical core. That is the wrong default for us: the same
process also runs the event loop, the OpenAI server, tokenization and the user's rollout code, and on
a small machine other work shares the cores. An intra-op thread pool that loses one of its cores
stalls at every barrier: on our shared 2-core machine, two threads decoded the tiny model 1.6-11x
slower than one whenever anything else ran (bench/results/cpu_threads.json, from
bench/cpu_threads.py). So the default leaves one core free. Explicit choices win: the `cpu_threads`
argument (from `ModelConfig.cpu_threads`), then the environment variable ART_NB_CPU_THREADS.

torch applies `set_num_threads` per OS thread once that thread has run an op: a worker thread
started earlier keeps its old count. Set it in each worker that runs torch (`HFEngine` does so in
its executor's initializer).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["choose_cpu_threads", "usable_cores"]

ENV_VAR = "ART_NB_CPU_THREADS"
_CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def choose_cpu_threads(requested: int | None = None) -> tuple[int, str]:
    """The torch intra-op thread count to use and why (a sentence to show the user)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {requested}")
        return requested, f"cpu_threads={requested} was requested"
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        try:
            count = int(env)
        except ValueError:
            count = 0
        if count < 1:
            raise ValueError(f"{ENV_VAR}={env!r} is not a positive integer; set it to e.g. 1, or unset it")
        return count, f"{ENV_VAR}={count}"
    cores, where = usable_cores()
    if cores <= 1:
        return 1, f"1 usable core ({where})"
    count = cores - 1
    return count, (
        f"{cores} usable cores ({where}); one is left for the event loop, server and rollout code, "
        f"because a thread pool that loses a core to other work stalls (bench/cpu_threads.py)"
    )


def usable_cores() -> tuple[int, str]:
    """Cores this process may actually run on: CPU affinity, narrowed by a cgroup CPU quota if any."""
    if hasattr(os, "sched_getaffinity"):  # third-party: Linux only (not on macOS)
        cores, where = len(os.sched_getaffinity(0)), "CPU affinity"
    else:
        cores, where = os.cpu_count() or 1, "os.cpu_count"
    quota = _cgroup_quota()
    if quota is not None and quota < cores:
        return quota, f"cgroup CPU quota {quota}"
    return cores, where


def _cgroup_quota() -> int | None:
    """Whole CPUs allowed by a cgroup v2 quota (containers, Colab), or None when unlimited/unknown."""
    try:
        quota, period = _CGROUP_CPU_MAX.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, math.floor(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None
