"""The loss menu, pure torch: per-token objectives, how they are summed, and the engine-mismatch weight.

A GRPO-family loss is three independent choices, named as in TRL's `GRPOConfig` and ART's
`dev.TrainConfig` where those have a name:

1. The per-token objective over the policy ratio r = pi_theta / pi_old:
   - clip (PPO, as in GRPO): -min(r A, clip(r, 1 - eps, 1 + eps_high) A);
   - CISPO (MiniMax-M1): -sg(clip(r, 1 - eps, 1 + eps_high)) A log pi_theta.
2. The level of that ratio (`importance_sampling_level`): "token", r_t = exp(logp_t - old_t); or
   "sequence" (GSPO), one ratio per trajectory, exp of the mean per-token log ratio over its trained
   tokens, through which the gradient flows (d s / d logp_t = s / n).
3. How per-token losses add up to the batch loss (`trajectory_divisors`):
   - "trajectory" (GRPO, DeepSeekMath): mean over each trajectory's tokens, then over trajectories;
   - "token" (DAPO, TRL "dapo"): sum over every trained token of the batch / their number, so a
     long trajectory weighs by its length;
   - "constant" (Dr. GRPO, TRL "dr_grpo"): sum over tokens / (trajectories x a fixed length), no
     length normalisation at all.

The menu (`TrainConfig.loss`) picks one of each; `art_nb.config.LOSSES` is the table of which,
with each loss's defaults.

Departures from the papers, on purpose:
- PPO-clip as in GRPO (DeepSeekMath); `epsilon_high` gives the asymmetric "clip higher" of DAPO.
- CISPO (MiniMax-M1) caps the importance weight at 1 + epsilon_high (and, as ART allows, floors it
  at 1 - epsilon: with ART's default epsilon of 1.0 there is no floor), and normalises per
  trajectory rather than over all tokens of the batch.
- The KL penalty to the reference (base) model is GRPO's: the k3 estimator added to each token's
  loss (`kl_per_token`), not ART's reshaping of the advantages by the per-token log ratio.

`mismatch_weights` is the separate, detached correction for the inference engine and the trainer
disagreeing numerically about the same weights (TRL's `vllm_importance_sampling_correction`):
w = pi_trainer / pi_engine per token ("token_*") or per trajectory ("sequence_*", the product over
its tokens), truncated at a cap ("*_truncate") or zeroed beyond it ("*_mask").

Shapes as in `logprobs.py`: [B, T] per token with a bool mask, advantages [B] (one per trajectory,
broadcast over its tokens).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from ..config import Aggregation, Objective, RatioLevel

__all__ = [
    "Aggregation",
    "IsMode",
    "cispo_token_loss",
    "clip_token_loss",
    "kl_per_token",
    "masked_mean",
    "mismatch_weights",
    "policy_log_ratio",
    "token_loss",
    "trajectory_divisors",
]

IsMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` where `mask` is set; 0 where nothing is. Values outside the mask are ignored,
    NaN included (in the forward pass; keep them finite if gradients flow through them)."""
    mask = mask.bool()
    total = torch.where(mask, x, torch.zeros_like(x)).sum(dim)
    return total / mask.sum(dim).clamp(min=1).to(x.dtype)


def policy_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: RatioLevel
) -> torch.Tensor:
    """log r per token [B, T]: logp - old ("token"), or each row's masked mean of it ("sequence", GSPO).

    Old logprobs outside the mask are ignored (NaN is fine there): the ratio is 1 at those positions,
    so their zero gradient stays zero rather than NaN.
    """
    mask = mask.bool()
    log_ratio = logprobs - torch.where(mask, old_logprobs, logprobs.detach())
    if level == "token":
        return log_ratio
    if level == "sequence":
        return masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    raise ValueError(f"importance_sampling_level={level!r}: use 'token' or 'sequence'")


def clip_token_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, epsilon: float, epsilon_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(r A, clip(r, 1-eps, 1+eps_high) A) per token, and where the clip removed the gradient."""
    ratio = torch.exp(log_ratio)
    advantages = advantages.unsqueeze(-1)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def cispo_token_loss(
    log_ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, epsilon: float, epsilon_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-sg(clip(r, 1-eps, 1+eps_high)) A logp per token, and where the weight was bounded.

    Unlike the clip objective, a bounded token keeps its gradient (through logp); only its weight is
    capped. `epsilon` = 1 (ART's CISPO default) puts no floor under the weight.
    """
    ratio = torch.exp(log_ratio).detach()
    weight = torch.clamp(ratio, min=1 - epsilon, max=1 + epsilon_high)
    bounded = (ratio > 1 + epsilon_high) | (ratio < 1 - epsilon)
    return -weight * advantages.unsqueeze(-1) * logprobs, bounded


def token_loss(
    objective: Objective,
    log_ratio: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    epsilon: float,
    epsilon_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token loss of `objective` (a loss's `LossSpec.objective`), and where its clip acted."""
    if objective == "clip":
        return clip_token_loss(log_ratio, advantages, epsilon, epsilon_high)
    if objective == "cispo":
        return cispo_token_loss(log_ratio, logprobs, advantages, epsilon, epsilon_high)
    raise ValueError(f"objective={objective!r}: use 'clip' or 'cispo'")


def kl_per_token(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(policy || reference) at each token [B, T] by the k3 estimator, exp(ref - logp) - (ref - logp) - 1
    (http://joschu.net/blog/kl-approx.html; GRPO, DeepSeekMath eq. 4): non-negative, 0 where the two
    agree and outside the mask (NaN reference logprobs there included). The gradient flows through
    `logprobs` only."""
    log_ratio = torch.where(mask.bool(), reference_logprobs.detach(), logprobs.detach()) - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def trajectory_divisors(
    aggregation: Aggregation, tokens: torch.Tensor, trajectories: int, batch_tokens: int, constant: int
) -> torch.Tensor:
    """What each trajectory's summed token loss is divided by so the batch loss is their plain sum.

    `tokens` [B]: trained tokens of each trajectory in this microbatch; `trajectories` and
    `batch_tokens`: counts over the whole batch (every microbatch), so splitting a batch into
    microbatches never changes the loss. "trajectory": n_i x N (each trajectory weighs 1/N, its
    tokens 1/(n_i N)); "token": the batch's trained tokens (DAPO); "constant": N x `constant` (Dr. GRPO).
    """
    tokens = tokens.to(torch.float32)
    if aggregation == "trajectory":
        return tokens.clamp(min=1) * trajectories
    if aggregation == "token":
        return torch.full_like(tokens, float(max(batch_tokens, 1)))
    if aggregation == "constant":
        return torch.full_like(tokens, float(trajectories * constant))
    raise ValueError(f"aggregation={aggregation!r}: use 'trajectory', 'token' or 'constant'")


def mismatch_weights(
    trainer_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    known: torch.Tensor,
    mode: IsMode,
    cap: float | None,
    floor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached weights pi_trainer / pi_engine [B, T], and where the bound acted [B, T] bool.

    `known` marks trained tokens whose engine logprob exists; elsewhere the weight is 1 (no engine
    logprob: nothing to correct) and unbounded. Sequence modes use the product over a row's known
    tokens (the likelihood ratio of the whole sampled trajectory) for every token of a row that has one. "*_truncate"
    clamps the weight to [floor, cap]; "*_mask" sets weights outside it to 0 (the token, or the whole
    trajectory, leaves the loss). None for either bound means no bound on that side.
    """
    known = known.bool()
    diff = torch.where(known, trainer_logprobs.detach() - torch.nan_to_num(engine_logprobs), 0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True).expand_as(diff)
        known = known.any(-1, keepdim=True).expand_as(known)  # the whole row shares its trajectory's weight
    elif not mode.startswith("token"):
        raise ValueError(f"importance_sampling_mode={mode!r}: use token_truncate, token_mask, "
                         "sequence_truncate or sequence_mask")
    weight = torch.exp(diff)
    low = -math.inf if floor is None else floor
    high = math.inf if cap is None else cap
    outside = ((weight < low) | (weight > high)) & known
    if mode.endswith("truncate"):
        weight = weight.clamp(min=low, max=high)
    elif mode.endswith("mask"):
        weight = torch.where(outside, torch.zeros_like(weight), weight)
    else:
        raise ValueError(f"importance_sampling_mode={mode!r}: use token_truncate, token_mask, "
                         "sequence_truncate or sequence_mask")
    weight = torch.where(known, weight, torch.ones_like(weight))
    return weight.detach(), outside
