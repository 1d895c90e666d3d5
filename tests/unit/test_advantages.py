"""group_advantages and prepare_batch, against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_choice
from hypothesis import given, settings
from hypothesis import strategies as st

from art_nb.config import TrainConfig
from art_nb.grpo.advantages import group_advantages, prepare_batch
from art_nb.records import mean_and_std, summarize
from art_nb.trajectories import Trajectory, TrajectoryGroup


def test_group_advantages_use_the_population_std():
    # mean 2, deviations (-2, -1, 0, 3), population variance 14/4 = 3.5, std 1.8708287
    rewards = torch.tensor([0.0, 1.0, 2.0, 5.0])
    expected = torch.tensor([-1.0690450, -0.5345225, 0.0, 1.6035675])
    torch.testing.assert_close(group_advantages(rewards, eps=0.0), expected)
    pair = torch.tensor([1.0, 0.0])
    torch.testing.assert_close(group_advantages(pair, eps=0.0), torch.tensor([1.0, -1.0]))
    # eps keeps a near-constant group finite: 0.5 / (0.5 + 1e-6)
    torch.testing.assert_close(group_advantages(torch.tensor([1.0, 0.0]))[0], torch.tensor(0.999998))


def test_group_advantages_unscaled_are_centred_rewards():
    rewards = torch.tensor([0.0, 1.0, 2.0, 5.0])
    torch.testing.assert_close(group_advantages(rewards, scale=False), torch.tensor([-2.0, -1.0, 0.0, 3.0]))


def trajectory(tokenizer, reward: float, answer: str | None = "Four.") -> Trajectory:
    messages = [{"role": "user", "content": "Two plus two?"}]
    if answer is not None:
        messages.append(make_choice(tokenizer, answer))
    return Trajectory(messages_and_choices=messages, reward=reward)


def test_prepare_batch_skips_and_counts(chatml_tokenizer):
    tok = chatml_tokenizer
    groups = [
        TrajectoryGroup([trajectory(tok, 1.0), trajectory(tok, 0.0)]),
        TrajectoryGroup([trajectory(tok, 0.5), trajectory(tok, 0.5)]),  # zero variance
        TrajectoryGroup([trajectory(tok, 3.0)]),  # a group of one: zero variance
        TrajectoryGroup([]),  # empty: ignored
        TrajectoryGroup([trajectory(tok, 1.0), trajectory(tok, 0.0), trajectory(tok, 0.0, answer=None)]),
    ]
    batch = prepare_batch(groups, tok, TrainConfig(), max_seq_len=4096)

    counts = (batch.groups, batch.zero_variance_groups, batch.skipped_trajectories, batch.truncated)
    assert counts == (2, 2, 1, 0)
    assert [item.group_index for item in batch.items] == [0, 0, 4, 4]
    # group 4: rewards (1, 0, 0), mean 1/3, population std sqrt(2/9) -> (sqrt 2, -1/sqrt 2, -1/sqrt 2)
    advantages = [item.advantage for item in batch.items]
    assert advantages == pytest.approx([1.0, -1.0, 1.4142136, -0.7071068], abs=1e-5)
    # rewards of every trajectory given: (1, 0, .5, .5, 3, 1, 0, 0): mean .75, squared deviations sum to 7
    assert batch.reward_mean == pytest.approx(0.75)
    assert batch.reward_std == pytest.approx((7 / 8) ** 0.5)


def test_prepare_batch_unscaled_and_truncated(chatml_tokenizer):
    tok = chatml_tokenizer
    groups = [TrajectoryGroup([trajectory(tok, 2.0), trajectory(tok, 0.0, answer="Four, or maybe five.")])]
    full = prepare_batch(groups, tok, TrainConfig(scale_rewards=False), max_seq_len=4096)
    assert [item.advantage for item in full.items] == pytest.approx([1.0, -1.0])

    shortest = min(len(item.input_ids) for item in full.items)
    cut = prepare_batch(groups, tok, TrainConfig(scale_rewards=False), max_seq_len=shortest - 2)
    assert cut.truncated == 2 and len(cut.items) == 2
    assert all(len(item.input_ids) == shortest - 2 for item in cut.items)


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=12), st.booleans())
@settings(max_examples=300, deadline=None)
def test_any_finite_rewards_give_finite_advantages(rewards, scale):
    """Rewards of +-1e200 overflowed the old code (OverflowError squaring them, or inf std)."""
    advantages = group_advantages(torch.tensor(rewards, dtype=torch.float64), scale=scale)
    assert torch.isfinite(advantages).all(), (rewards, advantages)
    mean, std = mean_and_std(rewards)
    assert math.isfinite(mean) and math.isfinite(std)


def test_huge_rewards_keep_their_meaning(chatml_tokenizer):
    tok = chatml_tokenizer
    groups = [TrajectoryGroup([trajectory(tok, 1e200), trajectory(tok, -1e200)])]
    batch = prepare_batch(groups, tok, TrainConfig(), max_seq_len=4096)
    assert [item.advantage for item in batch.items] == pytest.approx([1.0, -1.0])
    assert batch.reward_mean == 0.0 and batch.reward_std == pytest.approx(1e200)
    summary = summarize([TrajectoryGroup([trajectory(tok, 1e308), trajectory(tok, 1e308)])])
    assert summary["reward"] == pytest.approx(1e308) and summary["reward_std"] == 0.0


def test_token_ids_outside_the_vocabulary_are_refused_before_the_model(chatml_tokenizer):
    """On a GPU an out-of-range id is a device assert that kills the process; it must never get there."""
    tok = chatml_tokenizer
    bad = trajectory(tok, 0.0)
    bad.messages_and_choices[-1].token_ids = [5, len(tok) + 7, 6]  # type: ignore[union-attr]
    groups = [TrajectoryGroup([trajectory(tok, 1.0), bad])]
    with pytest.raises(ValueError, match=r"groups\[0\]\.trajectories\[1\] has token id \d+, outside the model's "
                                         r"vocabulary \[0, \d+\)"):
        prepare_batch(groups, tok, TrainConfig(), max_seq_len=4096, vocab_size=len(tok))
    assert prepare_batch(groups[:0] + [TrajectoryGroup([trajectory(tok, 1.0), trajectory(tok, 0.0)])], tok,
                         TrainConfig(), max_seq_len=4096, vocab_size=len(tok)).items
