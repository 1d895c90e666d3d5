"""Capture across threads: work a rollout hands to a thread pool (`pool.submit`, `pool.map`,
`loop.run_in_executor`) records into that rollout's trajectory, exactly, with many rollouts sharing
one pool; a thread started by hand records nothing, is counted, and the step's error says so and
how to fix it (`art.utils.carry_context`). Same scripted server as tests/unit/test_capture.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
from typing import Any

import openai
import pytest

import art_nb as art
from art_nb.records import check_trainable
from tests.unit import test_capture
from tests.unit.test_capture import KEY, check_exact

pytestmark = pytest.mark.asyncio(loop_scope="module")
server, srv = test_capture.server, test_capture.srv  # its scripted server, as fixtures here


def ask(srv: Any, word: str, model: str = "agent") -> str:
    """One blocking call with the openai SDK's sync client (httpx underneath), as sync agent code makes it."""
    with openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0) as client:
        done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": word}])
    return done.choices[0].message.content or ""


def words(t: art.Trajectory) -> list[str]:
    return [call.request["messages"][0]["content"] for call in t.exchanges]


async def test_run_in_executor_without_a_copied_context_is_captured_exactly(srv: Any) -> None:
    async def rollout() -> None:
        await asyncio.get_running_loop().run_in_executor(None, ask, srv, "hi")

    t = await art.trajectory(rollout())
    assert words(t) == ["hi"]
    check_exact(t, srv)


async def test_concurrent_rollouts_sharing_one_pool_each_record_their_own_calls(srv: Any) -> None:
    # One worker: the thread is started inside the first rollout's submit and then runs every
    # rollout's work in turn, so a scope carried by the thread rather than by the item would
    # record everything into the first trajectory.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    async def rollout(word: str) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(pool, ask, srv, word)
        await asyncio.sleep(0)
        # pool.map from a thread that itself runs carried work (never block the loop: it serves the calls)
        assert await asyncio.to_thread(lambda: list(pool.map(ask, [srv, srv], [word, word]))) == ["reply 1"] * 2
        await asyncio.wrap_future(pool.submit(ask, srv, word))

    names = [f"rollout-{i}" for i in range(8)]
    group = await art.trajectory_group([art.trajectory(rollout(name)) for name in names])
    assert [words(t) for t in group.trajectories] == [[name] * 4 for name in names]
    assert all(t.calls_outside_context == 0 for t in group.trajectories)
    pool.shutdown()


async def test_pool_work_submitted_outside_every_scope_is_not_recorded_but_counted(srv: Any) -> None:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    opened, judged = asyncio.Event(), asyncio.Event()

    async def rollout() -> None:
        await asyncio.get_running_loop().run_in_executor(pool, ask, srv, "mine")  # starts the worker thread
        opened.set()
        await judged.wait()

    async def judge_outside() -> None:
        await opened.wait()
        await asyncio.wrap_future(pool.submit(ask, srv, "judge"))  # submitted from no scope
        judged.set()

    t, _ = await asyncio.gather(art.trajectory(rollout()), judge_outside())
    assert words(t) == ["mine"] and t.calls_outside_context == 1


async def test_no_capture_travels_with_pool_work(srv: Any) -> None:
    async def rollout() -> None:
        await asyncio.to_thread(ask, srv, "kept")
        with art.no_capture():
            await asyncio.get_running_loop().run_in_executor(None, ask, srv, "judge", "judge")

    t = await art.trajectory(rollout())
    assert words(t) == ["kept"] and t.calls_outside_context == 0


async def test_a_thread_started_by_hand_is_counted_and_the_steps_error_names_the_cause_and_the_fix(
        srv: Any) -> None:
    async def rollout() -> None:
        thread = threading.Thread(target=ask, args=(srv, "lost"))
        thread.start()
        await asyncio.to_thread(thread.join)
        art.current_trajectory(required=True).reward = 1.0

    group = await art.trajectory_group([art.trajectory(rollout()), art.trajectory(rollout())])
    assert [t.exchanges for t in group.trajectories] == [[], []]
    assert all(1 <= t.calls_outside_context <= 2 for t in group.trajectories)  # the other's call may count too
    with pytest.raises(ValueError) as refused:
        check_trainable([group])
    message = str(refused.value)
    assert "2 of them recorded no model call" in message and "from threads without the trajectory's context" in message
    assert "art.utils.carry_context(work)" in message and "keep the Choice" in message  # (the hand-built case)


async def test_carry_context_puts_a_hand_started_threads_calls_in_the_rollout(srv: Any) -> None:
    async def rollout() -> None:
        thread = threading.Thread(target=art.utils.carry_context(ask), args=(srv, "carried"))
        thread.start()
        await asyncio.to_thread(thread.join)

    t = await art.trajectory(rollout())
    assert words(t) == ["carried"] and t.calls_outside_context == 0
    check_exact(t, srv)


async def test_work_that_outlives_its_trajectory_records_nothing_into_it(srv: Any) -> None:
    release = threading.Event()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def late() -> str:
        release.wait(10)
        return ask(srv, "late")

    async def rollout() -> concurrent.futures.Future[str]:
        return pool.submit(late)

    with art.Trajectory() as t:
        future = await rollout()
    release.set()
    assert await asyncio.wrap_future(future) == "reply 1"
    assert t.exchanges == []  # the trajectory closed before the call: it may be training by now
    pool.shutdown()


async def test_pool_work_carries_the_scope_and_no_other_context_variable(srv: Any) -> None:
    mine = contextvars.ContextVar("mine", default="unset")

    def look() -> tuple[bool, str]:
        return art.current_trajectory() is not None, mine.get()

    async def rollout() -> None:
        mine.set("set in the rollout")
        seen = await asyncio.get_running_loop().run_in_executor(None, look)
        assert seen == (True, "unset")  # a worker thread's context is its own, as without art_nb

    await art.trajectory(rollout())
    assert await asyncio.get_running_loop().run_in_executor(None, look) == (False, "unset")


async def test_a_scope_that_recorded_nothing_is_told_where_calls_are_recorded() -> None:
    with art.Trajectory() as empty:
        pass  # e.g. every call went to another server, or ran under no_capture
    with pytest.raises(ValueError) as refused:
        check_trainable([art.TrajectoryGroup([empty])])
    assert "1 of them recorded no model call: make the model calls inside `await art.trajectory(...)`" in str(
        refused.value)
