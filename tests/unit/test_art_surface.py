"""ART 0.5's public names that art_nb took last, each checked against what ART does: `art.LoRAConfig`,
`trajectory_group_batches`, `auto_trajectory`/`capture_auto_trajectory`,
`yield_trajectory`/`capture_yielded_trajectory`, `model.backend()`, the errors of `backend()` and
`openai_client()` before register, `litellm_completion_params()` without an endpoint, and
`max_exceptions=0` raising the rollout's own exception object.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

import art_nb as art
from art_nb.local import LocalBackend
from art_nb.remote.client import RemoteBackend
from art_nb.serverless import ServerlessBackend

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


def scored(reward: float) -> art.Trajectory:
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=reward)


async def rollout(reward: float, delay: float = 0.0) -> art.Trajectory:
    await asyncio.sleep(delay)
    return scored(reward)


class Boom(Exception):
    pass


async def boom() -> art.Trajectory:
    raise Boom("the environment broke")


def test_lora_config_is_arts_top_level_name_and_maps_onto_the_model_config() -> None:
    assert art.LoRAConfig is art.dev.LoRAConfig
    model = art.TrainableModel(name="a", project="p", base_model=BASE, lora_config=art.LoRAConfig(rank=4, alpha=8))
    assert (model.backend_config.lora.rank, model.backend_config.lora.alpha) == (4, 8)


async def test_batches_come_as_groups_finish_with_a_bounded_number_in_flight() -> None:
    running, most = 0, 0

    async def group(reward: float, delay: float) -> art.TrajectoryGroup:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(delay)
        running -= 1
        return art.TrajectoryGroup([scored(reward)])

    delays = [0.3, 0.05, 0.2, 0.01, 0.1, 0.15, 0.02]
    batches = [[g.rewards()[0] for g in batch] async for batch in art.trajectory_group_batches(
        (group(i, d) for i, d in enumerate(delays)), batch_size=2, max_concurrent_batches=2, pbar_desc=None)]
    assert sorted(r for batch in batches for r in batch) == list(range(7)) and [len(b) for b in batches] == [2, 2, 2, 1]
    assert batches[0] == [3, 1]  # the fastest of the first four in flight, not the first two given
    assert most == 4  # batch_size * max_concurrent_batches


async def test_batches_skip_and_take_trajectory_groups_of_rollouts() -> None:
    groups = [art.TrajectoryGroup(rollout(10 * g + i) for i in range(2)) for g in range(5)]
    batches = [batch async for batch in art.trajectory_group_batches(groups, batch_size=2, skip_batches=1,
                                                                      pbar_desc=None)]
    assert sorted(sorted(g.rewards()) for batch in batches for g in batch) == [[20, 21], [30, 31], [40, 41]]


async def test_each_batch_has_its_own_exception_budget_and_none_raises_the_rollouts_own_error() -> None:
    # One group in flight at a time, one per batch: each batch's one failure is within its budget of
    # 1 (also as a fraction: half of its 2 rollouts), though the three together are not.
    for budget in (1, 0.5):
        groups = [art.TrajectoryGroup([rollout(g), boom()]) for g in range(3)]
        batches = [batch async for batch in art.trajectory_group_batches(
            groups, batch_size=1, max_batch_exceptions=budget, max_concurrent_batches=1, pbar_desc=None)]
        assert [[(g.rewards(), len(g.exceptions)) for g in batch] for batch in batches] == [
            [([g], 1)] for g in range(3)]
    with pytest.raises(Boom, match="the environment broke") as raised:
        async for _ in art.trajectory_group_batches([art.TrajectoryGroup([boom()])], batch_size=1, pbar_desc=None):
            pass
    assert raised.value.__cause__ is None


async def test_closing_the_batches_cancels_the_groups_still_running() -> None:
    finished: list[int] = []

    async def slow(g: int) -> art.TrajectoryGroup:
        await asyncio.sleep(0 if g == 0 else 5)
        finished.append(g)
        return art.TrajectoryGroup([scored(g)])

    async with contextlib.aclosing(art.trajectory_group_batches([slow(g) for g in range(4)], batch_size=1,
                                                                pbar_desc=None)) as batches:
        async for batch in batches:
            assert batch[0].rewards() == [0]
            break
    await asyncio.sleep(0.05)
    assert finished == [0]


async def test_auto_trajectory_is_the_capture_scopes_older_spelling() -> None:
    async def agent() -> None:
        art.auto_trajectory(required=True).reward = 0.5
        assert art.auto_trajectory(require=True) is art.current_trajectory()

    t = await art.capture_auto_trajectory(agent())
    assert isinstance(t, art.Trajectory) and t.reward == 0.5
    assert art.auto_trajectory() is None
    with pytest.raises(RuntimeError, match="no trajectory scope"):
        art.auto_trajectory(required=True)


async def test_a_yielded_trajectory_is_captured_from_the_rollout_or_its_tasks() -> None:
    async def agent(reward: float) -> str:
        await asyncio.gather(asyncio.sleep(0), asyncio.create_task(yielding(reward)))
        return "something else"

    async def yielding(reward: float) -> None:
        art.yield_trajectory(scored(reward))

    assert (await art.capture_yielded_trajectory(agent(2.0))).reward == 2.0
    art.yield_trajectory(scored(1.0))  # outside a capture: nothing, as in ART
    with pytest.raises(RuntimeError, match="No trajectory yielded"):
        await art.capture_yielded_trajectory(asyncio.sleep(0))
    with pytest.raises(TypeError, match="art.Trajectory"):
        art.yield_trajectory({"reward": 1})  # type: ignore[arg-type]


def test_every_backend_called_is_itself_so_model_backend_works_as_a_method() -> None:
    for cls in (LocalBackend, RemoteBackend, ServerlessBackend):
        backend = object.__new__(cls)  # no engine, server or key needed to see what calling it gives
        assert backend() is backend


async def test_before_register_the_errors_are_arts() -> None:
    model = art.TrainableModel(name="agent", project="p", base_model=BASE)
    with pytest.raises(ValueError, match=r"^Model is not registered with the Backend\. You must call "
                                         r"`model\.register\(\)` first"):
        model.backend()
    with pytest.raises(ValueError, match=r"^OpenAI client not yet available on this trainable model\. You must "
                                         r"call `model\.register\(\)` first"):
        model.openai_client()
    with pytest.raises(ValueError, match=r"^In order to create an OpenAI client you must provide an "
                                         r"`inference_api_key` and `inference_base_url`"):
        art.Model(name="gpt-4.1", project="p").openai_client()
    with pytest.raises(RuntimeError):  # what art_nb code (and older notebooks) catch
        model.backend.model_dir(model)


def test_litellm_params_without_an_endpoint_are_arts() -> None:
    trainable = art.TrainableModel(name="agent", project="p", base_model=BASE)
    assert trainable.litellm_completion_params() == {"model": "hosted_vllm/agent", "base_url": None,
                                                     "api_key": None, "temperature": 1}
    hosted = art.Model(name="gpt-4.1", project="p")  # a comparison model LiteLLM reaches by name
    assert hosted.litellm_completion_params(step=None) == {"model": "gpt-4.1", "base_url": None, "api_key": None,
                                                           "temperature": 1}


async def _first_error(make: Any) -> BaseException:
    try:
        await make()
    except BaseException as error:  # noqa: BLE001 - the test looks at exactly what came out
        return error
    raise AssertionError("expected the rollout's error")


async def test_max_exceptions_zero_raises_the_rollouts_own_exception_object() -> None:
    raised: list[Boom] = []

    async def failing() -> art.Trajectory:
        raised.append(Boom("mine"))
        raise raised[-1]

    async def group_maker() -> art.TrajectoryGroup:
        return await art.TrajectoryGroup([failing()])

    ways = [
        lambda: art.gather_trajectory_groups([art.TrajectoryGroup([failing(), rollout(1)])], pbar_desc=None),
        lambda: art.gather_trajectory_groups([art.trajectory_group([art.trajectory(failing())])], pbar_desc=None),
        lambda: art.gather_trajectory_groups([group_maker()], pbar_desc=None),
        lambda: art.gather_trajectories([failing(), rollout(1)], pbar_desc=None),
    ]
    for way in ways:
        error = await _first_error(way)
        assert error is raised[-1] and error.__cause__ is None
