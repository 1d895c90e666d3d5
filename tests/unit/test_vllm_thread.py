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

from art_nb.local.engines.vllm.thread import Gather, VLLMThread


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


async def test_a_burst_arriving_from_idle_starts_in_one_step(thread, engine) -> None:
    """Requests that come a few ms apart (the endpoint admitting a rollout group) join before the first step."""
    thread.gather = Gather(quiet_s=0.03, cap_s=1.0)
    await asyncio.gather(*await submit_spaced(thread, engine, 8, every_s=0.005))
    assert engine.batches[0] == sorted(f"b{i}" for i in range(8))
    assert len(engine.batches) == 3


async def test_without_gather_a_burst_trickles_into_the_running_batch(thread, engine) -> None:
    """What the gather prevents: each request joins a step of its own (a prefill outside CUDA graphs on a GPU)."""
    thread.gather = Gather(0, 0)
    await asyncio.gather(*await submit_spaced(thread, engine, 8, every_s=0.005, length=30))
    assert len(engine.batches[0]) < 8


async def test_a_stream_of_requests_waits_no_longer_than_the_cap(thread, engine) -> None:
    thread.gather = Gather(quiet_s=0.05, cap_s=0.04)
    started = time.monotonic()
    first = submit(thread, engine, "first", 1)
    rest = await submit_spaced(thread, engine, 30, every_s=0.005)  # never quiet for 50 ms
    assert (await first).steps == 1
    first_step_after = engine.first_step_at - started
    assert 0.035 < first_step_after < 0.12, first_step_after  # the cap, not the end of the stream (~0.15 s)
    await asyncio.gather(*rest)


async def test_a_request_arriving_mid_batch_waits_for_quiet_then_joins(thread, engine) -> None:
    thread.gather = Gather(quiet_s=0.02, cap_s=1.0)
    long = submit(thread, engine, "long", 200)
    while len(engine.batches) < 3:
        await asyncio.sleep(0.001)
    asked = len(engine.batches)
    late = await submit_spaced(thread, engine, 3, every_s=0.004)
    await asyncio.gather(*late, long)
    joined = next(i for i, batch in enumerate(engine.batches) if "b0" in batch)
    assert engine.batches[joined] == ["b0", "b1", "b2", "long"]  # the three together, not one by one
    assert joined - asked >= 10  # ~1 ms steps: it waited for the 20 ms of quiet, the batch stepping meanwhile


async def test_what_is_asked_after_a_waiting_add_stays_behind_it(thread, engine) -> None:
    thread.gather = Gather(quiet_s=0.02, cap_s=1.0)
    first = submit(thread, engine, "a", 1)
    noted = thread.call(engine.calls.append, "between")
    first.cancel()  # the client left while its request still waited to join: the engine aborts it
    thread.abort("a", engine.abort_request)
    await noted
    await thread.call(lambda: None)
    assert engine.calls[:2] == ["add a", "between"] and engine.aborted == ["a"]


def test_gather_setting_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("ART_NB_GATHER_MS", raising=False)
    assert Gather.from_env() == Gather()
    monkeypatch.setenv("ART_NB_GATHER_MS", "0")
    off = Gather.from_env()
    assert off.due_in(first_s=0.0, last_s=0.0, now=0.0) == 0.0
    monkeypatch.setenv("ART_NB_GATHER_MS", "2, 30")
    assert Gather.from_env() == Gather(0.002, 0.03)
    assert Gather(0.002, 0.03).due_in(first_s=1.0, last_s=1.029, now=1.029) == pytest.approx(0.001)  # the cap
    assert Gather(0.002, 0.03).due_in(first_s=1.0, last_s=1.01, now=1.011) == pytest.approx(0.001)  # the quiet
    for bad in ("fast", "5,100,3", "-1"):
        monkeypatch.setenv("ART_NB_GATHER_MS", bad)
        with pytest.raises(ValueError, match="ART_NB_GATHER_MS"):
            VLLMThread()  # refused before a thread starts


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
        vllm.gather = Gather(0, 0)
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
    monkeypatch.setenv("ART_NB_GATHER_MS", "2,40")
    thread = VLLMThread()
    try:
        switch, together = thread.reasons()
        assert "0.5 ms while vLLM decodes" in switch and "Python's own while it idles" in switch
        assert "none has come for 2 ms (at most 40 ms)" in together
        monkeypatch.setenv("ART_NB_SWITCH_INTERVAL_MS", "0")
        monkeypatch.setenv("ART_NB_GATHER_MS", "0")
        thread.gather = Gather.from_env()
        assert thread.reasons() == ["Python's GIL switch interval left as it is (thread.py)",
                                    "every request joins the engine at once (ART_NB_GATHER_MS)"]
    finally:
        thread.stop()
        thread.join()
