"""The trainer's per-token logprobs (`token_logprobs`), and whose logprobs the loss compares.

Shapes: a batch of B right-padded sequences of length T predicts T-1 tokens each, so logprobs,
old logprobs and masks are [B, T-1]. Old logprobs outside the mask are ignored (NaN is fine there:
prompt and padding have none). The losses built on them are in `losses.py`.

What the "old policy" is, and the engine mismatch (the decision, after TRL's GRPOTrainer):
- art_nb takes one optimizer step per batch, and the engine sampled with exactly the weights the
  trainer holds before that step. So pi_old is the trainer's own policy: `grpo_step` uses the
  trainer's detached logprobs as old logprobs, the policy ratio is exactly 1 throughout the step,
  and each loss's clip never acts (its gradient is the policy gradient, weighted as the loss
  aggregates tokens). The clip only matters if one batch were reused for several updates.
- What does differ between engine and trainer is numerics (vLLM in bf16 with its own kernels, a
  batched KV-cached decode): the engine's logprob of a sampled token is not the trainer's. TRL
  keeps that apart from the policy ratio as a detached importance weight pi_trainer / pi_engine,
  truncated or masked at a cap (`losses.mismatch_weights`); so does art_nb
  (`TrainConfig.importance_sampling_correction`, on by default where the engine sent logprobs).
  Default mode "token_truncate" at 3.0, where TRL defaults to "sequence_mask": agent trajectories
  carry hundreds to thousands of sampled tokens, and the product of that many per-token ratios
  drifts far from 1 even when each is close, which would mask whole trajectories.
- With the correction off, the engine's logprobs are the old logprobs, as in ART: the ratio is then
  the mismatch itself, and each loss's clip bounds it (CISPO: weight capped at 1 + epsilon_high;
  PPO: tokens beyond 1 +- epsilon lose their gradient).
- Tokens sampled under a grammar (constrained decoding: a JSON response format, a forced tool call)
  carry the engine's logprob under the distribution it drew from, the masked one: log p - log Z, Z
  the mass the grammar left (vLLM reports it so; the transformers engine does the same). The trainer
  computes log p. They are trained, with the correction: its weight pi_trainer / pi_engine is Z <= 1,
  the importance weight from the sampling distribution back to the policy, so a token the grammar
  forced against the model's preference adds little and one the model would have written anyway
  trains fully; the cap never acts on them, and a floor with a "*_mask" mode drops forced tokens.
Per step `grpo_step` reports the mismatch: `mismatch_kl` (k3), `mismatch_logprob_abs` (mean
|engine - trainer| logprob; under a grammar it includes the mean -log Z) and the share of tokens the
cap acted on. docs/losses.md says the same for users.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["token_logprobs"]


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
