"""masked_mean, PPO-clip, CISPO and the KL to the reference against values worked out by hand.

Both trajectories have ratios (1, 1.5, 0.5) on their three tokens; the second masks its third.
Each objective is checked as a per-trajectory mean of its token losses (the "trajectory"
aggregation of grpo/losses.py), the shape GRPO's paper writes it in.
"""

from __future__ import annotations

import math

import pytest
import torch

from art_nb.grpo.losses import kl_per_token, masked_mean, policy_log_ratio, token_loss

MASK = torch.tensor([[True, True, True], [True, True, False]])
ADVANTAGES = torch.tensor([1.0, -2.0])
LOG_RATIO = torch.log(torch.tensor([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]]))


def logprobs() -> torch.Tensor:
    return torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5]], requires_grad=True)


def old(lp: torch.Tensor) -> torch.Tensor:
    out = (lp - LOG_RATIO).detach()
    out[1, 2] = math.nan  # masked: must not leak into the loss
    return out


def per_trajectory(objective: str, lp: torch.Tensor, old_lp: torch.Tensor, epsilon: float,
                   epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each trajectory's mean token loss [B], and the share of masked tokens whose clip acted."""
    per_token, clipped = token_loss(objective, policy_log_ratio(lp, old_lp, MASK, "token"), lp, ADVANTAGES,
                                    epsilon, epsilon_high)
    return masked_mean(per_token, MASK, dim=-1), masked_mean(clipped.float(), MASK)


def kl_to_reference(lp: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each trajectory's mean KL to the reference [B]."""
    return masked_mean(kl_per_token(lp, reference, mask), mask, dim=-1)


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, math.nan]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 4.5]))
    torch.testing.assert_close(masked_mean(x, mask), torch.tensor(3.0))
    torch.testing.assert_close(masked_mean(x, torch.zeros_like(mask), dim=-1), torch.tensor([0.0, 0.0]))


def test_ppo_clip_loss_by_hand():
    lp = logprobs()
    loss, clip_fraction = per_trajectory("clip", lp, old(lp), epsilon=0.2, epsilon_high=0.2)
    # row 0, A=+1: min(r, clip(r, .8, 1.2)) = (1, 1.2, .5) -> mean .9
    # row 1, A=-2: min(-2r, -2 clip(r)) = (-2, -3) on its two tokens -> mean -2.5
    torch.testing.assert_close(loss, torch.tensor([-0.9, 2.5]))
    assert clip_fraction.item() == pytest.approx(1 / 5)  # only row 0's r=1.5 is cut
    loss.sum().backward()
    # d/dlp of -mean(r A) is -r A / n where the unclipped term is active, 0 where the clip is
    torch.testing.assert_close(lp.grad, torch.tensor([[-1 / 3, 0.0, -1 / 6], [1.0, 1.5, 0.0]]))


def test_ppo_clip_higher():
    lp = logprobs()
    loss, clip_fraction = per_trajectory("clip", lp, old(lp), epsilon=0.2, epsilon_high=0.6)
    # row 0: clip(1.5, .8, 1.6) = 1.5 -> min = (1, 1.5, .5) -> mean 1.0; row 1 unchanged
    torch.testing.assert_close(loss, torch.tensor([-1.0, 2.5]))
    assert clip_fraction.item() == 0.0


def test_cispo_loss_by_hand():
    lp = logprobs()
    loss, clip_fraction = per_trajectory("cispo", lp, old(lp), epsilon=1.0, epsilon_high=0.2)
    # weights min(r, 1.2) = (1, 1.2, .5), never clipped from below
    # row 0: -((1)(-1) + (1.2)(-2) + (.5)(-.5)) / 3 = 3.65 / 3;  row 1: -((-2)(-1) + (1.2)(-2)(-2)) / 2 = -3.4
    torch.testing.assert_close(loss, torch.tensor([3.65 / 3, -3.4]))
    assert clip_fraction.item() == pytest.approx(2 / 5)
    loss.sum().backward()
    # the capped token keeps its gradient, scaled by the capped weight: -w A / n
    torch.testing.assert_close(lp.grad, torch.tensor([[-1 / 3, -0.4, -1 / 6], [1.0, 1.2, 0.0]]))


def test_losses_agree_on_policy():
    """With ratio 1 everywhere both reduce to the policy gradient -A grad(logprob)."""
    lp = logprobs()
    ppo, _ = per_trajectory("clip", lp, lp.detach(), epsilon=0.2, epsilon_high=0.2)
    (ppo_grad,) = torch.autograd.grad(ppo.sum(), lp)
    cispo, _ = per_trajectory("cispo", lp, lp.detach(), epsilon=1.0, epsilon_high=0.2)
    (cispo_grad,) = torch.autograd.grad(cispo.sum(), lp)
    torch.testing.assert_close(ppo_grad, cispo_grad)


def test_cispo_floor_from_epsilon():
    lp = logprobs()
    loss, clip_fraction = per_trajectory("cispo", lp, old(lp), epsilon=0.4, epsilon_high=0.2)
    # weights clip(r, .6, 1.2) = (1, 1.2, .6): row 0's r=.5 is raised to the floor
    # row 0: -((1)(-1) + (1.2)(-2) + (.6)(-.5)) / 3 = 3.7 / 3;  row 1 as without a floor: -3.4
    torch.testing.assert_close(loss, torch.tensor([3.7 / 3, -3.4]))
    assert clip_fraction.item() == pytest.approx(3 / 5)  # two capped above, one floored
    # ART's CISPO default (epsilon 1.0) has no floor: the same as leaving it out
    default, _ = per_trajectory("cispo", lp, old(lp), epsilon=1.0, epsilon_high=0.2)
    torch.testing.assert_close(default, torch.tensor([3.65 / 3, -3.4]))


def test_kl_to_reference_by_hand():
    lp = logprobs()
    # reference logprobs: d = ref - logp = (0, ln 2, -ln 2) on row 0, (ln 2, 0, NaN-masked) on row 1
    reference = lp.detach() + torch.log(torch.tensor([[1.0, 2.0, 0.5], [2.0, 1.0, 1.0]]))
    reference[1, 2] = math.nan  # masked: must not leak
    kl = kl_to_reference(lp, reference, MASK)
    # k3 per token: e^d - d - 1 -> 0, 1 - ln 2, ln 2 - 0.5; row 1: 1 - ln 2, 0
    ln2 = math.log(2)
    torch.testing.assert_close(kl, torch.tensor([(1 - ln2 + ln2 - 0.5) / 3, (1 - ln2) / 2]))
    kl.sum().backward()
    # d/dlogp of e^(ref - logp) - (ref - logp) - 1 is 1 - e^d, over each row's masked tokens
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1 / 3, 0.5 / 3], [-1 / 2, 0.0, 0.0]]))
    assert torch.all(kl_to_reference(lp, lp.detach(), MASK) == 0)  # same model: no KL
