"""A trajectory whose assistant turns are message dicts (not the Choice the endpoint returned)
has 0 trainable tokens. A step where nothing could train for that reason is refused; a step where only
some trajectories lack a Choice trains the rest and says so in the history, text report, dashboard and
summary."""

from __future__ import annotations

import json

import pytest
from conftest import make_choice

from art_nb.records import UNTRAINABLE_FIX, check_trainable
from art_nb.trajectories import Trajectory, TrajectoryGroup

PROMPT = [{"role": "user", "content": "Say a colour."}]


def played(tokenizer, text: str, reward: float) -> Trajectory:
    return Trajectory(messages_and_choices=[*PROMPT, make_choice(tokenizer, text)], reward=reward)


def pasted(text: str, reward: float) -> Trajectory:
    """The pasted-ART mistake: the assistant turn rebuilt as a dict from the Choice's text."""
    return Trajectory(messages_and_choices=[*PROMPT, {"role": "assistant", "content": text}], reward=reward)


def test_a_step_of_dict_turns_only_is_refused_with_the_fix(chatml_tokenizer):
    groups = [TrajectoryGroup([pasted("red", 1.0), pasted("blue", 0.0)])]
    with pytest.raises(ValueError, match="0 trainable tokens") as raised:
        check_trainable(groups)
    assert "Keep the Choice the endpoint returned" in str(raised.value)
    assert "2 of 2" in str(raised.value)


def test_dict_turns_are_refused_even_when_every_group_scored_the_same(chatml_tokenizer):
    # Nothing could ever train from such rollouts; waiting for reward variance would only hide it.
    with pytest.raises(ValueError, match="0 trainable tokens"):
        check_trainable([TrajectoryGroup([pasted("red", 1.0), pasted("blue", 1.0)])])


def test_choices_only_in_groups_without_signal_are_refused(chatml_tokenizer):
    groups = [TrajectoryGroup([played(chatml_tokenizer, "red", 1.0), played(chatml_tokenizer, "red", 1.0)]),
              TrajectoryGroup([pasted("red", 1.0), pasted("blue", 0.0)])]
    with pytest.raises(ValueError, match="of the groups whose rewards differ"):
        check_trainable(groups)


def test_zero_variance_with_choices_is_a_normal_no_op(chatml_tokenizer):
    groups = [TrajectoryGroup([played(chatml_tokenizer, "red", 1.0), played(chatml_tokenizer, "blue", 1.0)])]
    assert check_trainable(groups) == 0


def test_some_dict_turns_are_counted_not_refused(chatml_tokenizer):
    groups = [TrajectoryGroup([played(chatml_tokenizer, "red", 1.0), pasted("blue", 0.0)]),
              TrajectoryGroup([played(chatml_tokenizer, "red", 1.0), played(chatml_tokenizer, "blue", 0.0)])]
    assert check_trainable(groups) == 1


def test_a_choice_in_an_additional_history_makes_the_trajectory_trainable(chatml_tokenizer):
    from art_nb.trajectories import History

    sub = History(messages_and_choices=[*PROMPT, make_choice(chatml_tokenizer, "red")])
    trajectory = pasted("blue", 1.0)
    trajectory.additional_histories = [sub]
    assert check_trainable([TrajectoryGroup([trajectory, played(chatml_tokenizer, "red", 0.0)])]) == 0


def test_an_empty_step_is_not_refused():
    assert check_trainable([]) == 0 and check_trainable([TrajectoryGroup([])]) == 0


# ---- where the count is shown ------------------------------------------------------------------------


def history_lines(untrainable: float) -> list[dict]:
    return [
        {"step": 0, "split": "train", "time": 1, "train/reward": 0.5, "train/reward_min": 0.0, "train/reward_max": 1.0},
        {"step": 0, "split": "train", "time": 2, "train/loss": 0.1, "train/zero_variance_groups": 0.0,
         "train/groups": 2.0, "train/untrainable_trajectories": untrainable, "train/time/train": 0.4},
    ]


def test_history_with_untrainable_trajectories_warns_in_the_text_report():
    from art_nb.notebook.state import RunState

    state = RunState("m")
    state.load_history(history_lines(3.0))
    row = state.ordered()[0]
    assert row.untrainable == 3
    assert row.warning() == f"3 trajectories with 0 trainable tokens: {UNTRAINABLE_FIX}"
    assert state.text().splitlines()[2].endswith(f"! 3 trajectories with 0 trainable tokens: {UNTRAINABLE_FIX}")

    clean = RunState("m")
    clean.load_history(history_lines(0.0))
    assert clean.ordered()[0].warning() is None and "!" not in clean.text()


def test_the_summary_lists_the_warning(tmp_path):
    pytest.importorskip("matplotlib")
    from art_nb.notebook.summary import summary_from_model_dir

    model_dir = tmp_path / "p" / "models" / "m"
    model_dir.mkdir(parents=True)
    (model_dir / "history.jsonl").write_text("".join(json.dumps(line) + "\n" for line in history_lines(1.0)))
    summary = summary_from_model_dir(model_dir)
    assert summary.steps[0]["untrainable_trajectories"] == 1
    assert f"- step 0: 1 trajectory with 0 trainable tokens: {UNTRAINABLE_FIX}" in summary.markdown()


def test_the_dashboard_shows_the_warning_when_the_step_finishes(tmp_path):
    pytest.importorskip("ipywidgets")
    from art_nb import events
    from art_nb.notebook.dashboard import Dashboard

    model_dir = tmp_path / "p" / "models" / "m"
    model_dir.mkdir(parents=True)
    board = Dashboard(model_dir=model_dir)
    try:
        events.emit("log", model="m", step=0, split="train", metrics={"reward": 0.5})
        assert "0 trainable tokens" not in board._facts.value
        events.emit("train_finished", model="m", step=1, checkpoint="/ck/0001",
                    metrics={"groups": 1.0, "zero_variance_groups": 0.0, "untrainable_trajectories": 2.0,
                             "time/train": 0.3})
        assert f"step 0: <b>2 trajectories with 0 trainable tokens: {UNTRAINABLE_FIX}</b>" in board._facts.value
    finally:
        board.close()
