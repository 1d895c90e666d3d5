"""masked_mean, PPO-clip and CISPO against values worked out by hand.

Both trajectories have ratios (1, 1.5, 0.5) on their three tokens; the second masks its third.
"""

from __future__ import annotations

import math

import pytest
import torch

from art_nb.grpo.loss import cispo_loss, masked_mean, ppo_clip_loss

MASK = torch.tensor([[True, True, True], [True, True, False]])
ADVANTAGES = torch.tensor([1.0, -2.0])
LOG_RATIO = torch.log(torch.tensor([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]]))


def logprobs() -> torch.Tensor:
    return torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5]], requires_grad=True)


def old(lp: torch.Tensor) -> torch.Tensor:
    out = (lp - LOG_RATIO).detach()
    out[1, 2] = math.nan  # masked: must not leak into the loss
    return out


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, math.nan]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 4.5]))
    torch.testing.assert_close(masked_mean(x, mask), torch.tensor(3.0))
    torch.testing.assert_close(masked_mean(x, torch.zeros_like(mask), dim=-1), torch.tensor([0.0, 0.0]))


def test_ppo_clip_loss_by_hand():
    lp = logprobs()
    loss, clip_fraction = ppo_clip_loss(lp, old(lp), ADVANTAGES, MASK, epsilon=0.2)
    # row 0, A=+1: min(r, clip(r, .8, 1.2)) = (1, 1.2, .5) -> mean .9
    # row 1, A=-2: min(-2r, -2 clip(r)) = (-2, -3) on its two tokens -> mean -2.5
    torch.testing.assert_close(loss, torch.tensor([-0.9, 2.5]))
    assert clip_fraction.item() == pytest.approx(1 / 5)  # only row 0's r=1.5 is cut
    loss.sum().backward()
    # d/dlp of -mean(r A) is -r A / n where the unclipped term is active, 0 where the clip is
    torch.testing.assert_close(lp.grad, torch.tensor([[-1 / 3, 0.0, -1 / 6], [1.0, 1.5, 0.0]]))


def test_ppo_clip_higher():
    lp = logprobs()
    loss, clip_fraction = ppo_clip_loss(lp, old(lp), ADVANTAGES, MASK, epsilon=0.2, epsilon_high=0.6)
    # row 0: clip(1.5, .8, 1.6) = 1.5 -> min = (1, 1.5, .5) -> mean 1.0; row 1 unchanged
    torch.testing.assert_close(loss, torch.tensor([-1.0, 2.5]))
    assert clip_fraction.item() == 0.0


def test_cispo_loss_by_hand():
    lp = logprobs()
    loss, clip_fraction = cispo_loss(lp, old(lp), ADVANTAGES, MASK, epsilon_high=0.2)
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
    ppo, _ = ppo_clip_loss(lp, lp.detach(), ADVANTAGES, MASK, epsilon=0.2)
    (ppo_grad,) = torch.autograd.grad(ppo.sum(), lp)
    cispo, _ = cispo_loss(lp, lp.detach(), ADVANTAGES, MASK, epsilon_high=0.2)
    (cispo_grad,) = torch.autograd.grad(cispo.sum(), lp)
    torch.testing.assert_close(ppo_grad, cispo_grad)
