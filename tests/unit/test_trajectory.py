import math

import pytest
from openai.types.chat.chat_completion import Choice
from pydantic import ValidationError

from art_nb import Trajectory, TrajectoryGroup


def make_choice(content: str = "<move>B2</move>", token_ids=(5, 6, 7)) -> Choice:
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": content},
            "logprobs": None,
            "token_ids": list(token_ids),
        }
    )


def test_messages_turn_choices_into_assistant_dicts():
    t = Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, make_choice("yo")], reward=1)
    assert t.messages() == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert len(t.choices()) == 1
    assert t.choices()[0].model_extra["token_ids"] == [5, 6, 7]


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_rejected_with_a_reason(reward):
    with pytest.raises(ValidationError, match="finite"):
        Trajectory(messages_and_choices=[], reward=reward)


def test_unknown_role_names_the_message_index():
    with pytest.raises(ValidationError, match=r"messages_and_choices\[1\].*'robot'"):
        Trajectory(messages_and_choices=[{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}])


def test_non_dict_message_is_rejected():
    with pytest.raises(ValidationError, match=r"messages_and_choices\[0\] is a int"):
        Trajectory(messages_and_choices=[3])


def test_tool_results_are_taken_as_art_takes_them():
    """An answered call, a result answering no call ("n/a" in ART's tool-use notebook) and one with no id."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for result in ({"role": "tool", "tool_call_id": "call_1", "content": "42"},
                   {"role": "tool", "tool_call_id": "n/a", "content": "42"}, {"role": "tool", "content": "42"}):
        t = Trajectory(messages_and_choices=[{"role": "user", "content": "x"},
                                             {"role": "assistant", "content": None, "tool_calls": [call]}, result])
        assert t.messages()[2]["content"] == "42"


def test_unknown_field_is_rejected():
    with pytest.raises(ValidationError):
        Trajectory(messages_and_choices=[], reward=0, rewardz=1)


async def test_group_keeps_awaitables_pending():
    async def rollout():
        return Trajectory(reward=1)

    coro = rollout()
    group = TrajectoryGroup([Trajectory(reward=0), coro])
    assert len(group) == 1 and len(group.pending) == 1
    assert (await group.pending[0]).reward == 1


def test_group_rejects_other_things():
    with pytest.raises(TypeError, match="int"):
        TrajectoryGroup([1])
