"""The vLLM thread's step loop, around a stand-in for vLLM's LLMEngine (no vLLM here).

What VLLMEngine relies on: the thread steps by itself while requests are open and takes submitted
calls between steps in order (a request joins the running batch), hands a step's finished outputs
back in one hop per event loop, blocks when idle, holds a `when_idle` call until the batch drains,
aborts what was cancelled, and after `step()` raises fails every waiter and every later request.
The same guarantees on the real engine: tests/vllm_cpu/engine_check.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from art_nb.local.engines.vllm.thread import VLLMThread


@dataclass
class Output:
    request_id: str
    finished: bool
    steps: int  # the engine's step count when it finished


class FakeEngine:
    """Each request needs `length` steps; records which requests each step ran."""

    def __init__(self) -> None:
        self.left: dict[str, int] = {}
        self.batches: list[list[str]] = []
        self.aborted: list[str] = []
        self.calls: list[str] = []  # add/abort/other calls and steps, in the order the thread made them
        self.fail_at: int | None = None
        self.step_gate: threading.Event | None = None  # set: steps proceed; cleared: the next step waits
        self.first_step_at: float | None = None  # time.monotonic() of the first step

    def add_request(self, request_id: str, length: int) -> None:
        self.calls.append(f"add {request_id}")
        self.left[request_id] = length

    def abort_request(self, request_ids: list[str]) -> None:
        self.calls.append(f"abort {request_ids}")
        self.aborted += request_ids
        for request_id in request_ids:
            self.left.pop(request_id, None)

    def step(self) -> list[Output]:
        if self.step_gate is not None:
            self.step_gate.wait(5)
        if self.fail_at is not None and len(self.batches) + 1 >= self.fail_at:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if self.first_step_at is None:
            self.first_step_at = time.monotonic()
        self.batches.append(sorted(self.left))
        self.calls.append("step")
        time.sleep(0.001)  # a decode step takes time: lets a request submitted meanwhile join mid-batch
        done = []
        for request_id in list(self.left):
            self.left[request_id] -= 1
            if self.left[request_id] == 0:
                del self.left[request_id]
                done.append(Output(request_id, True, len(self.batches)))
        return done


class Dead(RuntimeError):
    pass


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def thread(engine: FakeEngine):
    state: dict[str, Any] = {"dead": None}
    vllm = VLLMThread()
    vllm.attach(lambda: engine.step(), dead=lambda: Dead(state["dead"]) if state["dead"] else None,
                died=lambda exc: state.update(dead=f"vLLM stopped ({exc})"))
    vllm.state = state  # type: ignore[attr-defined]
    yield vllm
    vllm.stop()
    vllm.join()


def submit(thread: VLLMThread, engine: FakeEngine, request_id: str, length: int) -> asyncio.Future[Any]:
    future = asyncio.get_running_loop().create_future()
    thread.add(request_id, lambda: engine.add_request(request_id, length), future)
    return future


async def test_steps_while_open_and_a_request_joins_the_running_batch(thread, engine) -> None:
    long = submit(thread, engine, "long", 40)
    while len(engine.batches) < 5:
        await asyncio.sleep(0.001)
    late = submit(thread, engine, "late", 3)
    done_late, done_long = await late, await long
    assert done_long.steps == 40 and [b for b in engine.batches if b != ["long"]] == [["late", "long"]] * 3
    assert done_late.steps < 40  # it finished mid-way, not after the long one: it joined the batch


async def submit_spaced(thread: VLLMThread, engine: FakeEngine, count: int, every_s: float,
                        length: int = 3) -> list[asyncio.Future[Any]]:
    futures = []
    for i in range(count):
        futures.append(submit(thread, engine, f"b{i}", length))
        await asyncio.sleep(every_s)
    return futures


async def test_requests_join_as_they_come_not_held_for_a_burst(thread, engine) -> None:
    """Each request joins at the next step: holding a burst's adds until it was complete gained no wall time on
    the GPU (bench/results/h200/README.md), so the first step does not wait for the last request."""
    started = time.monotonic()
    futures = await submit_spaced(thread, engine, 8, every_s=0.005, length=30)
    assert engine.first_step_at is not None and engine.first_step_at - started < 0.02
    await asyncio.gather(*futures)
    assert len(engine.batches[0]) < 8  # the later ones joined the running batch


async def test_one_hop_per_step_for_all_the_outputs_it_finished(thread, engine) -> None:
    loop = asyncio.get_running_loop()
    hops: list[Any] = []
    original = loop.call_soon_threadsafe

    def counting(callback: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(callback)
        return original(callback, *args, **kwargs)

    engine.step_gate = threading.Event()  # all eight are queued before the first step runs
    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        futures = [submit(thread, engine, f"r{i}", 6) for i in range(8)]
        engine.step_gate.set()
        outputs = await asyncio.gather(*futures)
    finally:
        del loop.call_soon_threadsafe
    assert {o.steps for o in outputs} == {6} and len(engine.batches) == 6
    assert len(hops) == 1, f"{len(hops)} hops back to the loop for one step's 8 outputs"


async def test_idle_thread_blocks_and_calls_run_in_submission_order(thread, engine) -> None:
    await asyncio.sleep(0.05)
    assert engine.batches == []  # nothing open: no step, no spin
    first = submit(thread, engine, "a", 2)
    noted = thread.call(engine.calls.append, "between")
    second = submit(thread, engine, "b", 1)
    await asyncio.gather(first, noted, second)
    assert engine.calls[:3] == ["add a", "between", "add b"]


async def test_when_idle_call_waits_for_the_batch_and_keeps_what_follows_behind_it(thread, engine) -> None:
    running = submit(thread, engine, "running", 10)
    while not engine.batches:
        await asyncio.sleep(0.001)
    slept = thread.call(engine.calls.append, "sleep", when_idle=True)
    after = submit(thread, engine, "after", 1)
    await asyncio.gather(running, slept, after)
    assert engine.calls.index("sleep") > max(i for i, c in enumerate(engine.calls) if c == "step" and i < engine.calls.index("add after"))
    assert engine.calls.index("add after") == engine.calls.index("sleep") + 1
    assert [b for b in engine.batches if "running" in b] == [["running"]] * 10  # "after" never joined it


async def test_cancelled_request_is_aborted_and_others_go_on(thread, engine) -> None:
    doomed = submit(thread, engine, "doomed", 1000)
    kept = submit(thread, engine, "kept", 20)
    while len(engine.batches) < 3:
        await asyncio.sleep(0.001)
    doomed.cancel()
    thread.abort("doomed", engine.abort_request)
    assert (await kept).steps == 20
    assert engine.aborted == ["doomed"] and len(engine.batches) == 20


async def test_abort_of_a_finished_request_is_not_sent(thread, engine) -> None:
    await submit(thread, engine, "quick", 1)
    thread.abort("quick", engine.abort_request)
    await thread.call(lambda: None)
    assert engine.aborted == []


async def test_a_failing_step_fails_every_waiter_and_later_requests(thread, engine) -> None:
    engine.fail_at = 4
    futures = [submit(thread, engine, f"r{i}", 50) for i in range(3)]
    results = await asyncio.gather(*futures, return_exceptions=True)
    assert all(isinstance(r, Dead) and "illegal memory access" in str(r) for r in results), results
    assert "illegal memory access" in thread.state["dead"]
    with pytest.raises(Dead):
        await submit(thread, engine, "later", 1)
    assert "add later" not in engine.calls  # a dead engine is not handed new requests
    assert await thread.call(lambda: "still runs") == "still runs"  # calls (shutdown) still run


async def test_stop_fails_open_requests_and_refuses_new_calls(thread, engine) -> None:
    engine.step_gate = threading.Event()
    waiting = submit(thread, engine, "open", 5)
    thread.state["dead"] = "the engine was closed"
    thread.stop()
    engine.step_gate.set()
    with pytest.raises(Dead, match="closed"):
        await waiting
    thread.join()
    with pytest.raises(Dead, match="closed"):
        await thread.call(lambda: None)
    with pytest.raises(Dead, match="closed"):
        await submit(thread, engine, "too late", 1)


def test_each_waiter_hears_back_on_its_own_loop(thread, engine) -> None:
    """The backend's loop thread and a benchmark's loop may both be asking."""
    got: dict[str, tuple[int, int]] = {}

    def ask(name: str) -> None:
        async def run() -> None:
            output = await submit(thread, engine, name, 5)
            got[name] = (threading.get_ident(), output.steps)
        asyncio.run(run())
        got[name] = (got[name][0] == threading.get_ident(), got[name][1])  # type: ignore[assignment]

    threads = [threading.Thread(target=ask, args=(f"loop{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got == {"loop0": (True, got["loop0"][1]), "loop1": (True, got["loop1"][1])}


async def test_gil_switch_interval_is_short_while_a_vllm_thread_steps_and_python_s_otherwise(monkeypatch, engine) -> None:
    """Short while vLLM decodes (its thread gets the GIL back soon after each GPU wait); Python's own while it
    is idle, so the endpoint's and the client's threads take in a burst without handing the GIL over every
    0.5 ms."""
    import sys

    monkeypatch.delenv("ART_NB_SWITCH_INTERVAL_MS", raising=False)
    before = sys.getswitchinterval()
    first, second = VLLMThread(), VLLMThread()
    other_engine = FakeEngine()
    for vllm, its_engine in ((first, engine), (second, other_engine)):
        vllm.attach(its_engine.step, dead=lambda: None, died=lambda exc: None)
    try:
        assert sys.getswitchinterval() == pytest.approx(before)  # alive, idle
        engine.step_gate = threading.Event()
        running = submit(first, engine, "a", 3)
        while not engine.calls:
            await asyncio.sleep(0.001)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        other = asyncio.get_running_loop().create_future()
        second.add("b", lambda: other_engine.add_request("b", 1), other)
        engine.step_gate.set()
        await asyncio.gather(running, other)
        await asyncio.sleep(0.05)
        assert sys.getswitchinterval() == pytest.approx(before)  # both idle again
    finally:
        for vllm in (first, second):
            vllm.stop()
            vllm.join()
    assert sys.getswitchinterval() == pytest.approx(before)


def test_switch_interval_env_zero_leaves_python_alone(monkeypatch) -> None:
    import sys

    monkeypatch.setenv("ART_NB_SWITCH_INTERVAL_MS", "0")
    before = sys.getswitchinterval()
    thread = VLLMThread()
    engine = FakeEngine()
    thread.attach(lambda: engine.step(), dead=lambda: None, died=lambda exc: None)
    engine.step_gate = threading.Event()
    loop = asyncio.new_event_loop()
    try:
        thread.add("a", lambda: engine.add_request("a", 1), loop.create_future())
        while not engine.calls:
            time.sleep(0.001)
        assert sys.getswitchinterval() == pytest.approx(before)  # stepping, yet Python's own
    finally:
        engine.step_gate.set()
        thread.stop()
        thread.join()
        loop.close()


def test_the_engine_stream_is_the_default_one_unless_asked_and_a_bad_choice_is_refused(monkeypatch) -> None:
    from art_nb.local.engines.vllm.stream import STREAM_ENV, EngineStream

    monkeypatch.delenv(STREAM_ENV, raising=False)
    default = EngineStream()
    assert default.choice == "default" and default.reason is None
    with default.issuing(), default.crossing():  # no-ops: nothing to switch to
        pass
    monkeypatch.setenv(STREAM_ENV, "High")
    high = EngineStream()
    assert high.choice == "high"
    assert high.reason is None  # no CUDA here: the thread stays on the (CPU) default, and says nothing
    monkeypatch.setenv(STREAM_ENV, "separate")
    with pytest.raises(ValueError, match="ART_NB_VLLM_STREAM='separate': expected one of default, own, high"):
        VLLMThread()  # refused before a thread starts or the switch interval is claimed


def test_the_thread_says_what_it_changes_for_vllm(monkeypatch) -> None:
    monkeypatch.delenv("ART_NB_SWITCH_INTERVAL_MS", raising=False)
    thread = VLLMThread()
    try:
        (switch,) = thread.reasons()
        assert "0.5 ms while vLLM decodes" in switch and "Python's own while it idles" in switch
        monkeypatch.setenv("ART_NB_SWITCH_INTERVAL_MS", "0")
        assert thread.reasons() == ["Python's GIL switch interval left as it is (thread.py)"]
    finally:
        thread.stop()
        thread.join()
