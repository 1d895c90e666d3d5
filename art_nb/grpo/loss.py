"""The GRPO objective: per-token logprobs, and the PPO-clip and CISPO losses over them.

Shapes: a batch of B right-padded sequences of length T predicts T-1 tokens each, so logprobs,
old logprobs and masks are [B, T-1] and advantages are [B] (one per trajectory, broadcast over
its tokens). Each loss is a per-token mean within a trajectory, returned per trajectory [B],
so the caller can weigh every trajectory equally however long it is. Old logprobs outside the
mask are ignored (NaN is fine there: prompt and padding have none).

Departures from the papers, on purpose:
- PPO-clip as in GRPO (DeepSeekMath); `epsilon_high` gives the asymmetric "clip higher" of DAPO.
- CISPO (MiniMax-M1) caps the importance weight at 1 + epsilon_high (and, as ART allows, floors it
  at 1 - epsilon: with ART's default epsilon of 1.0 there is no floor), and normalises per
  trajectory rather than over all tokens of the batch.
- The KL penalty to the reference (base) model is GRPO's: the k3 estimator added to the loss
  (`kl_to_reference`), not ART's reshaping of the advantages by the per-token log ratio.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["cispo_loss", "kl_to_reference", "masked_mean", "ppo_clip_loss", "token_logprobs"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` where `mask` is set; 0 where nothing is. Values outside the mask are ignored,
    NaN included (in the forward pass; keep them finite if gradients flow through them)."""
    mask = mask.bool()
    total = torch.where(mask, x, torch.zeros_like(x)).sum(dim)
    return total / mask.sum(dim).clamp(min=1).to(x.dtype)


def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    chunk_tokens: int,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each `input_ids[:, 1:]` given its prefix, and the entropy there; both [B, T-1].

    The decoder runs once; the lm head then runs over chunks of about `chunk_tokens` tokens,
    each under activation checkpointing, so full-vocabulary logits exist for one chunk at a time,
    in the forward and in the backward pass. Logits are taken in float32. Entropy carries no
    gradient.

    `positions` ([B, T-1] bool) limits the lm head to the tokens that are trained; both outputs
    are 0 elsewhere. In multi-turn rollouts most tokens are prompt (tic-tac-toe: 418 sampled of
    7246), and a 49k-vocabulary head over every position costs about a third of the step.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # third-party: peft wrapper or bare
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.model  # third-party: older transformers
    head = base.get_output_embeddings()
    softcap = getattr(base.config, "final_logit_softcapping", None)  # third-party: Gemma 2 style

    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    hidden, targets = hidden[:, :-1], input_ids[:, 1:]

    def chunk(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = head(h).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        normalizer = torch.logsumexp(logits, dim=-1)
        logprob = logits.gather(-1, t.unsqueeze(-1)).squeeze(-1) - normalizer
        with torch.no_grad():
            entropy = normalizer - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        return logprob, entropy

    if positions is None:
        positions = torch.ones_like(targets, dtype=torch.bool)
    hidden, targets = hidden[positions], targets[positions]  # [N, H], [N]: contiguous, so the head is one mm
    save_memory = torch.is_grad_enabled() and hidden.requires_grad
    logprobs, entropies = [], []
    step = max(1, chunk_tokens)
    for start in range(0, hidden.shape[0], step):
        h, t = hidden[start : start + step], targets[start : start + step]
        lp, ent = checkpoint(chunk, h, t, use_reentrant=False) if save_memory else chunk(h, t)
        logprobs.append(lp)
        entropies.append(ent)
    logprob = torch.zeros(positions.shape, dtype=torch.float32, device=hidden.device)
    entropy = torch.zeros_like(logprob)
    if logprobs:
        logprob = logprob.masked_scatter(positions, torch.cat(logprobs))
        entropy = entropy.masked_scatter(positions, torch.cat(entropies))
    return logprob, entropy


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon: float,
    epsilon_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(r A, clip(r, 1-eps, 1+eps_high) A) per token, r = exp(logprob - old); mean per trajectory.

    Returns (loss [B], clip_fraction): the share of masked tokens whose clipped term was the
    smaller one, i.e. whose gradient the clip removed.
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(logprobs - _outside_mask_as_current(old_logprobs, logprobs, mask))
    advantages = advantages.unsqueeze(-1)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * advantages
    loss = -masked_mean(torch.minimum(unclipped, clipped), mask, dim=-1)
    clip_fraction = masked_mean((clipped < unclipped).float(), mask).detach()
    return loss, clip_fraction


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_high: float,
    epsilon: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-sg(clip(r, 1-eps, 1+eps_high)) A logprob per token; mean per trajectory.

    Unlike PPO, a clipped token keeps its gradient (through logprob); only its weight is bounded.
    `epsilon` = 1 (ART's CISPO default) puts no floor under the weight. Returns (loss [B],
    clip_fraction): the share of masked tokens whose weight was bounded.
    """
    ratio = torch.exp(logprobs - _outside_mask_as_current(old_logprobs, logprobs, mask)).detach()
    weight = torch.clamp(ratio, min=1 - epsilon, max=1 + epsilon_high)
    loss = -masked_mean(weight * advantages.unsqueeze(-1) * logprobs, mask, dim=-1)
    clip_fraction = masked_mean(((ratio > 1 + epsilon_high) | (ratio < 1 - epsilon)).float(), mask)
    return loss, clip_fraction


def kl_to_reference(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(policy || reference) per trajectory [B]: the masked mean of the k3 estimator per token,
    exp(ref - logp) - (ref - logp) - 1 (http://joschu.net/blog/kl-approx.html; GRPO, DeepSeekMath
    eq. 4). Non-negative, 0 where the two agree; the gradient flows through `logprobs` only."""
    log_ratio = _outside_mask_as_current(reference_logprobs.detach(), logprobs, mask) - logprobs
    return masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask, dim=-1)


def _outside_mask_as_current(
    old_logprobs: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Old logprobs with untrained positions set to the current ones (ratio 1 there).

    Padding and prompt positions carry NaN old logprobs; even masked out of the mean, a NaN ratio
    would turn the zero gradient there into NaN.
    """
    return torch.where(mask.bool(), old_logprobs, logprobs.detach())
