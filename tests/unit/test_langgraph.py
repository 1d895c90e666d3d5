"""art_nb.langgraph without a model: where `init_chat_model` points, what `wrap_rollout` returns and
how it hands recorded calls over, in and out of a `with TrajectoryGroup()` block. A LangGraph agent on
the real tiny model, trained, is tests/integration/test_langgraph_real.py."""

from __future__ import annotations

import pytest

import art_nb as art
from art_nb.capture import CapturedCall, CapturedChoice
from art_nb.langgraph import init_chat_model, wrap_rollout

pytest.importorskip("langchain_openai")

URL = "http://127.0.0.1:9/v1"


def served(name: str = "agent") -> art.Model:
    return art.Model(name=name, inference_base_url=URL, inference_api_key="sk-local")


def a_call() -> CapturedCall:
    """What capture records for one completion (as if the rollout had called the endpoint)."""
    return CapturedCall(model="agent@0", prompt_token_ids=[1, 2], choices=[CapturedChoice(
        token_ids=[3, 4], message={"role": "assistant", "content": "hi"})],
        request={"messages": [{"role": "user", "content": "hello"}]})


def test_init_chat_model_points_at_the_model_and_samples_at_temperature_one() -> None:
    chat = init_chat_model(served(), max_tokens=32, timeout_seconds=30)
    assert (chat.model_name, chat.openai_api_base, chat.temperature) == ("agent", URL, 1.0)
    assert chat.openai_api_key.get_secret_value() == "sk-local" and chat.max_tokens == 32
    assert chat.request_timeout == 30
    assert init_chat_model(served(), temperature=0.2).temperature == 0.2
    mine = object()
    assert init_chat_model(chat_model=mine) is mine  # ART's escape hatch, returned as it is


def test_init_chat_model_says_what_it_needs() -> None:
    with pytest.raises(RuntimeError, match=r"wrap_rollout\(model, rollout\)"):
        init_chat_model("agent@0")
    with pytest.raises(RuntimeError, match="register"):
        init_chat_model(art.Model(name="unregistered"))


async def test_a_wrapped_rollout_points_a_named_chat_model_at_its_model_and_gets_the_calls() -> None:
    async def rollout(model: art.Model, scenario: str) -> art.Trajectory:
        chat = init_chat_model(model.get_inference_name())
        art.current_trajectory(required=True).exchanges.append(a_call())  # what capture does for a real call
        return art.Trajectory(messages_and_choices=[{"role": "user", "content": "written by hand"}],
                              metadata={"scenario": scenario, "url": chat.openai_api_base, "name": chat.model_name})

    traj = await wrap_rollout(served(), rollout)(served(), "s1")
    assert traj.metadata == {"scenario": "s1", "url": URL, "name": "agent"}
    assert traj.exchanges == [a_call()] and traj.messages_and_choices == []  # the calls replaced the hand-written
    assert [m["content"] for m in traj.messages()] == ["hello", "hi"]
    with pytest.raises(RuntimeError, match="wrap_rollout"):
        init_chat_model("agent")  # the model was the wrapped rollout's only


async def test_a_rollout_that_returns_nothing_gets_the_scopes_trajectory() -> None:
    async def rollout() -> None:
        art.current_trajectory(required=True).reward = 0.5

    traj = await wrap_rollout(served(), rollout)()
    assert traj.reward == 0.5 and "duration" in traj.metrics


async def test_inside_a_group_block_the_returned_trajectory_takes_the_scopes_place() -> None:
    async def rollout(ok: bool) -> art.Trajectory:
        if not ok:
            raise ValueError("the agent broke")
        return art.Trajectory(reward=1.0)

    with art.TrajectoryGroup() as group:
        traj = await wrap_rollout(served(), rollout)(True)
        with pytest.raises(ValueError, match="broke"):
            await wrap_rollout(served(), rollout)(False)
    assert group.trajectories == [traj] and group.trajectories[0] is traj


async def test_what_a_wrapped_rollout_must_return() -> None:
    async def wrong() -> str:
        return "done"

    with pytest.raises(TypeError, match="return an art_nb Trajectory"):
        await wrap_rollout(served(), wrong)()
    with pytest.raises(TypeError, match="pass the art_nb Model"):
        wrap_rollout("agent", wrong)  # type: ignore[arg-type]
