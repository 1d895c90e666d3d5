"""Pipelined GRPO: the rollouts of step N+1 run while step N trains, one switch in the user's loop.

    async def gather(step):
        return await art.gather_trajectory_groups(..., pbar_desc=f"step {step + 1}/{STEPS}")

    async for groups in art.pipeline(model, gather, STEPS):
        await model.train(groups, config=train_config)

`pipeline` yields the groups of each step from the served one up to `steps`, as the loop
`for step in range(await model.get_step(), steps): groups = await gather(step)` would. Pipelined,
it starts gathering step N+1 as it hands over step N's groups, so those rollouts run while the
body trains step N; the body's `train` is unchanged and the user manages no task.

Off-policy by one step, exactly: every rollout of a gather samples from the adapter that was served
when the gather started (`model.get_inference_name()` names that step inside it, even once a newer
one is served), so the groups trained at step N+1 were sampled from step N's adapter, and each
trajectory says so in ART's `initial_policy_version` / `final_policy_version` (recorded with it).
The loss's engine/trainer mismatch weight (TrainConfig.importance_sampling_*) reweighs the lagged
samples to the trainer's policy; the step records the lag (`pipeline/lag_steps`) next to
`mismatch_kl`, so a run's history shows what the lag cost. Pinning also makes a pipelined run's data
independent of timing: which adapter a rollout used never depends on when the step before ended.

`enabled="auto"` asks the backend's plan (`backend.choices(model)["pipeline"]`, "on: ..." or "off:
..."): on where the engine keeps serving while it trains (vLLM beside a training that fits) and the
model has 1B parameters or more (on an H200 a 3B model's step ran 1.25x faster pipelined, a 135M
model's 18% slower: beside each other both sides slowed, and the small one had nothing to gain);
off on a CPU, where rollouts and training share the cores: there it gave 1.58x the steps per hour
on 2 cores (bench/cpu_pipeline.py), but what the lag costs a short run's learning is not measured yet.
True or False forces it; a backend that pauses its engine for a step still works pipelined (the
rollouts wait for the step). A `train` called while a pipeline gathers knows it (`rollouts_beside`);
RemoteBackend tells `art-nb serve`.

Interrupts keep their meaning: an interrupt inside `train` settles the step as it always does, and
the rollouts gathered beside it are cancelled (when the loop's iterator goes, or at `aclose()`);
an interrupt while the iterator waits for a gather cancels that gather. Nothing a pipeline gathered
is recorded until the body trains it, so an interrupted run leaves no half-recorded step. Resumed at
step N (a new kernel, a killed run) after a pipelined step, a pipelined loop samples its first gather
from step N-1, as the run that never stopped did, so it trains on the very data that run would have
and ends with the same weights; where step N-1 is no longer served (its checkpoint deleted), or step
N came from a synchronous step or an SFT warm start, it samples step N.
`LocalBackend.delete_checkpoints` keeps the step before the served one while a pipeline gathers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import weakref
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal, Protocol

from .store import HISTORY_FILE, read_jsonl
from .trajectories import TrajectoryGroup
from .types import ModelRef

__all__ = ["Pipeline", "pinned_step", "pipeline", "plan_says", "policy_lag", "rollouts_beside", "rollouts_run_beside"]

_log = logging.getLogger("art_nb")

Gather = Callable[[int], Awaitable[list[TrajectoryGroup]]]


class PipelinedModel(ModelRef, Protocol):
    """What the pipeline needs of a trainable model (`art_nb.TrainableModel` is one)."""

    async def get_step(self) -> int: ...

    @property
    def backend(self) -> Any: ...

    def get_inference_name(self, step: int | None = None) -> str: ...

    def openai_client(self, **kwargs: Any) -> Any: ...


# (project, name) -> the step a gather's rollouts sample from, inside that gather's task.
_PINNED: ContextVar[dict[tuple[str, str], int] | None] = ContextVar("art_nb_pinned_step", default=None)
# The pipeline whose rollouts run beside the caller's `train`, in the task that iterates it.
_BESIDE: ContextVar[weakref.ref[Pipeline] | None] = ContextVar("art_nb_rollouts_beside", default=None)
_TOLD: ContextVar[bool] = ContextVar("art_nb_rollouts_beside_remote", default=False)  # art-nb serve: the client's


def pinned_step(model: ModelRef) -> int | None:
    """The step `model`'s rollouts sample from in this context (inside a pipeline's gather), else None."""
    pinned = _PINNED.get()
    return None if pinned is None else pinned.get((model.project, model.name))


def rollouts_beside() -> bool:
    """Whether a pipeline iterated in this task is gathering the next step now (or, in `art-nb serve`,
    a client said its own is): a `train` called here runs beside those rollouts, and LocalBackend
    keeps serving through the step where it can."""
    ref = _BESIDE.get()
    running = None if ref is None else ref()
    return _TOLD.get() or (running is not None and running.gathering)


@contextlib.contextmanager
def rollouts_run_beside(told: bool) -> Iterator[None]:
    """In `art-nb serve`: a remote client's pipeline gathers while this `train` runs (`told`), as its
    request says (RemoteBackend.train sends `rollouts_beside()`)."""
    token = _TOLD.set(told)
    try:
        yield
    finally:
        _TOLD.reset(token)


def plan_says(choices: dict[str, str]) -> tuple[bool, str]:
    """Whether the backend's plan pipelines, and why: its "pipeline" choice ("on: why" / "off: why");
    off where a backend makes no such choice (it then pauses its engine for a step, or says nothing)."""
    said = choices.get("pipeline")
    if said is None:
        return False, "off: this backend's plan makes no pipeline choice"
    return said.startswith("on"), said


def policy_lag(groups: list[TrajectoryGroup], step: int) -> dict[str, float]:
    """How far behind step `step` the policy that sampled `groups` was, from the trajectories'
    `initial_policy_version` (0: on-policy); {} when none records it. Pure: the step's metrics."""
    lags = [step - t.initial_policy_version for g in groups for t in g.trajectories
            if t.initial_policy_version is not None]
    if not lags:
        return {}
    return {"pipeline/lag_steps": float(statistics.fmean(lags)), "pipeline/lag_max": float(max(lags))}


def stamp(groups: list[TrajectoryGroup], step: int) -> list[TrajectoryGroup]:
    """Record on each trajectory the adapter step it sampled from (ART's fields), unless it says already."""
    for group in groups:
        for trajectory in group.trajectories:
            if trajectory.initial_policy_version is None:
                trajectory.initial_policy_version = step
            if trajectory.final_policy_version is None:
                trajectory.final_policy_version = step
    return groups


class Pipeline:
    """The async iterator `pipeline()` returns: each step's gathered groups, in order."""

    def __init__(self, model: PipelinedModel, gather: Gather, steps: int,
                 enabled: bool | Literal["auto"] = "auto") -> None:
        self._ahead: asyncio.Task[list[TrajectoryGroup]] | None = None  # the next step's gather, running
        if enabled not in (True, False, "auto"):
            raise ValueError(f"enabled={enabled!r}: use True, False or 'auto' (the backend's plan decides)")
        if not callable(gather):
            raise TypeError("gather must be an async function of the step that returns its gathered groups, "
                            "e.g. async def gather(step): return await art.gather_trajectory_groups(...)")
        self.model, self.gather, self.steps, self.enabled = model, gather, steps, enabled
        self.on: bool | None = None  # decided at the first step
        self.reason = ""
        self._next: int | None = None  # the step the next yield is for

    def __aiter__(self) -> Pipeline:
        return self

    @property
    def gathering(self) -> bool:
        """Whether the next step's rollouts are running now."""
        return self._ahead is not None and not self._ahead.done()

    async def __anext__(self) -> list[TrajectoryGroup]:
        pin = None
        if self._next is None:
            self._next = await self.model.get_step()
            self.on, self.reason = self._decide()
            _log.info("pipeline %s", self.reason)
            if self.on and 0 < self._next < self.steps:
                pin = await _resumed_pin(self.model, self._next)
        step = self._next
        if step >= self.steps:
            await self.aclose()
            raise StopAsyncIteration
        ahead, self._ahead = self._ahead, None
        groups = await (ahead if ahead is not None else self._start(step, pin))  # a cancelled wait cancels the gather
        self._next = step + 1
        if self.on and self._next < self.steps:
            self._ahead = self._start(self._next)
            self._ahead.add_done_callback(_retrieve)  # read here if the loop never comes back for it
            _BESIDE.set(weakref.ref(self))
        return groups

    async def aclose(self) -> None:
        """Cancel the next step's gather if it runs, and wait until it has stopped."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.cancel()
            with contextlib.suppress(BaseException):
                await ahead

    def __del__(self) -> None:
        # The loop's iterator goes when its body raises (an interrupted `train`): stop the rollouts it left.
        ahead = self._ahead
        if ahead is not None and not ahead.done():
            with contextlib.suppress(RuntimeError):  # the loop is closed already: nothing runs any more
                ahead.get_loop().call_soon_threadsafe(ahead.cancel)

    def _decide(self) -> tuple[bool, str]:
        if self.enabled == "auto":
            return plan_says(self.model.backend.choices(self.model))
        return bool(self.enabled), f"{'on' if self.enabled else 'off'}: set by enabled={self.enabled}"

    def _start(self, step: int, pin: int | None = None) -> asyncio.Task[list[TrajectoryGroup]]:
        # The task holds no reference to the pipeline, so the loop's iterator can go (and __del__ stop it).
        return asyncio.ensure_future(_gather_pinned(self.model, self.gather, step, pin))


def pipeline(model: PipelinedModel, gather: Gather, steps: int, *,
             enabled: bool | Literal["auto"] = "auto") -> Pipeline:
    """Each step's groups from `await model.get_step()` up to `steps` (exclusive), `gather(step)` making
    them; pipelined (`enabled`: True, False, or "auto", the backend's plan), step N+1's rollouts run
    while the loop's body trains step N. The module docstring has the loop and what it guarantees."""
    return Pipeline(model, gather, steps, enabled)


async def _gather_pinned(model: PipelinedModel, gather: Gather, step: int, pin: int | None) -> list[TrajectoryGroup]:
    """`gather(step)` in a task of its own, its rollouts pinned to step `pin` (None: the one served now)."""
    served = await model.get_step() if pin is None else pin
    _PINNED.set({**(_PINNED.get() or {}), (model.project, model.name): served})  # this task's context only
    groups = await gather(step)
    if not isinstance(groups, list) or not all(isinstance(g, TrajectoryGroup) for g in groups):
        raise TypeError(f"gather({step}) returned {type(groups).__name__}; it must return the list of "
                        "TrajectoryGroups that art.gather_trajectory_groups gives")
    return stamp(groups, served)


async def _resumed_pin(model: PipelinedModel, start: int) -> int:
    """The step a pipelined loop resumed at `start` samples its first gather from: `start - 1` where the
    step that made `start` trained beside a gather (its history says `pipeline/beside`), as the run
    that never stopped did, so the resumed run trains on the very data it would have, and where the
    endpoint still serves it (its checkpoint kept); else `start` (a first pipelined loop after a
    synchronous one or an SFT warm start samples the adapter it starts from)."""
    history = await asyncio.to_thread(read_jsonl, Path(model.backend.model_dir(model)) / HISTORY_FILE)
    if not any(r.get("step") == start - 1 and r.get("train/pipeline/beside") for r in history):
        return start
    wanted = model.get_inference_name(start - 1)
    try:
        listed = {entry.id async for entry in model.openai_client().models.list()}
    except Exception as error:  # noqa: BLE001 - an endpoint that cannot list its models: sample the served step
        _log.info("pipeline: the endpoint's model list is unavailable (%s); resuming on-policy", error)
        return start
    return start - 1 if wanted in listed else start


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a gather's failure as seen: the loop reports it when it asks for those groups, or never
    needs them (it stopped first)."""
    if not task.cancelled():
        task.exception()
