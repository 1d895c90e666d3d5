"""Thread pools: work handed to a `concurrent.futures.ThreadPoolExecutor` runs in the submitter's
capture scope.

`ThreadPoolExecutor.submit` is what `pool.submit`, `pool.map` and `loop.run_in_executor` (the
default executor included) all go through, and at that moment the submitter is known exactly: the
code asking for the work. So the item runs with the submitter's scopes, groups and `no_capture`
flag (`context.run_carried`), and only those three art_nb variables: every other context variable
behaves in the worker as it always has. Nothing is wrapped while no scope is open anywhere and the
submitter carries nothing, so the patch costs nothing outside rollouts.

`threading.Thread` is not patched. A thread's only known parent is whoever called `start()`, and a
pool starts its worker threads from inside the first `submit`: carrying that caller's scope into
the thread would record every later item the worker runs, for any rollout, into the first one's
trajectory. Calls from such threads are counted instead (`context.note_outside_call`).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from . import context

__all__ = ["install"]


def install() -> None:
    pool = concurrent.futures.ThreadPoolExecutor
    submit = pool.submit

    def patched_submit(self: concurrent.futures.ThreadPoolExecutor, fn: Any, /, *args: Any,
                       **kwargs: Any) -> concurrent.futures.Future[Any]:
        state = context.carried()
        if not any(state) and not context.any_open():
            return submit(self, fn, *args, **kwargs)
        return submit(self, context.run_carried, state, fn, *args, **kwargs)

    pool.submit = patched_submit  # type: ignore[method-assign]
