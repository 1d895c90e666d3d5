"""The loss menu's pieces (grpo/losses.py) against values worked out by hand.

Same tensors as test_losses.py: two trajectories with policy ratios (1, 1.5, 0.5) on their three
tokens, the second masking its third.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from art_nb.config import LOSSES
from art_nb.grpo.losses import (
    clip_token_loss,
    mismatch_weights,
    policy_log_ratio,
    token_loss,
    trajectory_divisors,
)
from art_nb.porting import train_config
from tests.unit.test_losses import (  # the same hand-checked batch
    ADVANTAGES,
    MASK,
    logprobs,
    old,
)


def batch_loss(per_token: torch.Tensor, aggregation: str, constant: int = 4) -> torch.Tensor:
    divisors = trajectory_divisors(aggregation, MASK.sum(-1), trajectories=2, batch_tokens=5, constant=constant)
    return (torch.where(MASK, per_token, 0.0).sum(-1) / divisors).sum()


def ppo_menu_loss(aggregation: str, level: str = "token", epsilon: float = 0.2, advantages=ADVANTAGES):
    lp = logprobs()
    per_token, clipped = clip_token_loss(policy_log_ratio(lp, old(lp), MASK, level), advantages, epsilon, epsilon)
    loss = batch_loss(per_token, aggregation)
    loss.backward()
    return loss, lp.grad, clipped


def test_trajectory_aggregation_is_grpo():
    loss, grad, _ = ppo_menu_loss("trajectory")
    # per-trajectory means -0.9 and 2.5 (test_losses.py), averaged over the two trajectories
    assert loss.item() == pytest.approx((-0.9 + 2.5) / 2)
    torch.testing.assert_close(grad, torch.tensor([[-1 / 3, 0.0, -1 / 6], [1.0, 1.5, 0.0]]) / 2)


def test_dapo_divides_by_the_batch_tokens():
    loss, grad, _ = ppo_menu_loss("token")
    # token losses (-1, -1.2, -0.5) and (2, 3): sum 2.3 over 5 tokens
    assert loss.item() == pytest.approx(2.3 / 5)
    # each active token's gradient is -r A / 5 whatever its trajectory's length
    torch.testing.assert_close(grad, torch.tensor([[-0.2, 0.0, -0.1], [0.4, 0.6, 0.0]]))


def test_dr_grpo_divides_by_a_constant():
    loss, grad, _ = ppo_menu_loss("constant")  # 2 trajectories x constant 4
    assert loss.item() == pytest.approx(2.3 / 8)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 0.0, -0.5], [2.0, 3.0, 0.0]]) / 8)


def test_gspo_ratio_is_the_geometric_mean_per_sequence():
    loss, grad, clipped = ppo_menu_loss("trajectory", level="sequence")
    s0, s1 = 0.75 ** (1 / 3), 1.5**0.5  # exp(mean log ratio): (1 x 1.5 x 0.5)^(1/3), (1 x 1.5)^(1/2)
    # row 0 (A=+1): s0 = 0.909 is inside [0.8, 1.2]; row 1 (A=-2): min(-2 s1, -2 x 1.2) = -2 s1
    assert loss.item() == pytest.approx((-s0 + 2 * s1) / 2)
    # d s / d logp_t = s / n, times -A, over 2 trajectories: every token of a row gets the same gradient
    torch.testing.assert_close(grad, torch.tensor([[-s0 / 3, -s0 / 3, -s0 / 3], [s1, s1, 0.0]]) / 2)
    assert not clipped.any()


def test_gspo_clip_acts_on_whole_sequences():
    # epsilon 0.05: row 0 (A=-1) min(-s0, -0.95) is the clipped term; row 1 (A=+2) min(2 s1, 2.1) too
    loss, grad, clipped = ppo_menu_loss("trajectory", level="sequence", epsilon=0.05,
                                        advantages=torch.tensor([-1.0, 2.0]))
    assert loss.item() == pytest.approx((0.95 - 2.1) / 2)
    assert torch.all(grad == 0)  # the clip removed both trajectories' gradient, every token of them
    assert clipped[MASK].all()


def test_sequence_ratio_ignores_masked_old_logprobs():
    lp = logprobs()
    ratio = policy_log_ratio(lp, old(lp), MASK, "sequence")
    assert torch.isfinite(ratio).all()
    torch.testing.assert_close(ratio[1].detach(), torch.full((3,), math.log(1.5) / 2))


def test_divisors_are_per_batch_counts():
    tokens = torch.tensor([3, 2])
    torch.testing.assert_close(trajectory_divisors("trajectory", tokens, 4, 20, 10), torch.tensor([12.0, 8.0]))
    torch.testing.assert_close(trajectory_divisors("token", tokens, 4, 20, 10), torch.tensor([20.0, 20.0]))
    torch.testing.assert_close(trajectory_divisors("constant", tokens, 4, 20, 10), torch.tensor([40.0, 40.0]))
    with pytest.raises(ValueError, match="'trajectory', 'token' or 'constant'"):
        trajectory_divisors("seq", tokens, 4, 20, 10)  # type: ignore[arg-type]


# ---- the engine/trainer mismatch weight ------------------------------------------------------------

TRAINER = torch.zeros(2, 3)
# pi_trainer / pi_engine per token: (0.5, 2, 4) and (5, 1, unknown)
ENGINE = -torch.log(torch.tensor([[0.5, 2.0, 4.0], [5.0, 1.0, 1.0]]))
ENGINE[1, 2] = math.nan
KNOWN = torch.tensor([[True, True, True], [True, True, False]])


@pytest.mark.parametrize(("mode", "expected", "bounded"), [
    ("token_truncate", [[0.5, 2.0, 3.0], [3.0, 1.0, 1.0]], [[0, 0, 1], [1, 0, 0]]),
    ("token_mask", [[0.5, 2.0, 0.0], [0.0, 1.0, 1.0]], [[0, 0, 1], [1, 0, 0]]),
    # products 0.5 x 2 x 4 = 4 and 5 x 1 = 5, both above the cap; the whole row shares it
    ("sequence_truncate", [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]], [[1, 1, 1], [1, 1, 1]]),
    ("sequence_mask", [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [[1, 1, 1], [1, 1, 1]]),
])
def test_mismatch_weight_modes(mode, expected, bounded):
    weights, outside = mismatch_weights(TRAINER, ENGINE, KNOWN, mode, cap=3.0)
    torch.testing.assert_close(weights, torch.tensor(expected))
    assert outside.tolist() == torch.tensor(bounded, dtype=torch.bool).tolist()
    assert not weights.requires_grad


def test_mismatch_weight_floor_and_no_cap():
    weights, outside = mismatch_weights(TRAINER, ENGINE, KNOWN, "token_truncate", cap=None, floor=0.6)
    torch.testing.assert_close(weights, torch.tensor([[0.6, 2.0, 4.0], [5.0, 1.0, 1.0]]))
    assert outside.tolist() == [[True, False, False], [False, False, False]]
    weights, _ = mismatch_weights(TRAINER, ENGINE, KNOWN, "sequence_mask", cap=10.0, floor=1.0)
    torch.testing.assert_close(weights, torch.tensor([[4.0, 4.0, 4.0], [5.0, 5.0, 5.0]]))


def test_mismatch_weight_is_one_without_engine_logprobs():
    weights, outside = mismatch_weights(TRAINER, torch.full((2, 3), math.nan), torch.zeros(2, 3, dtype=torch.bool),
                                        "sequence_mask", cap=3.0)
    assert torch.all(weights == 1) and not outside.any()
    with pytest.raises(ValueError, match="token_truncate"):
        mismatch_weights(TRAINER, ENGINE, KNOWN, "tokens", cap=3.0)  # type: ignore[arg-type]


# ---- the table (art_nb.config.LOSSES) --------------------------------------------------------------

@pytest.mark.parametrize("name", list(LOSSES))
def test_every_loss_of_the_table_is_computed_by_the_pieces(name):
    spec = LOSSES[name]
    lp = logprobs()
    per_token, _ = token_loss(spec.objective, policy_log_ratio(lp, old(lp), MASK, spec.ratio_level), lp, ADVANTAGES,
                              spec.epsilon, spec.epsilon_high or spec.epsilon)
    assert torch.isfinite(batch_loss(per_token, spec.aggregation)).item()
    with pytest.raises(ValueError, match="'clip' or 'cispo'"):
        token_loss("sapo", per_token, lp, ADVANTAGES, 0.2, 0.2)  # type: ignore[arg-type]


def test_aliases_name_one_loss_each_and_port_to_it():
    aliases = [alias for spec in LOSSES.values() for alias in spec.aliases]
    assert len(aliases) == len(set(aliases)) and not set(aliases) & set(LOSSES)
    for name, spec in LOSSES.items():
        for alias in spec.aliases:
            assert train_config(None, {"loss_type": alias}, "t").loss == name


def test_the_docs_list_the_losses_of_the_table():
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "losses.md").read_text()
    listed = re.findall(r'^\| `"(\w+)"` \|', docs, flags=re.MULTILINE)
    assert listed == list(LOSSES), f"docs/losses.md lists {listed}; art_nb.config.LOSSES has {list(LOSSES)}"
