"""One GRPO optimizer step over a prepared batch.

The batch is split into microbatches of at most `config.microbatch_tokens` padded tokens
(sequences sorted by length so little is padding); gradients accumulate so that the loss is the
one `config.loss` defines over the whole batch (losses.py), whatever microbatch a trajectory lands
in: each microbatch's loss is divided by counts taken over the batch.

Old logprobs (the denominator of the policy ratio) are the trainer's own, detached: the engine
sampled with the weights the trainer holds before this step. Where the engine sent logprobs, a
separate detached weight pi_trainer / pi_engine, bounded as `config.importance_sampling_mode`
says, corrects for the two disagreeing numerically (logprobs.py's docstring has the reasoning). With
`importance_sampling_correction=False` the engine's logprobs are the old logprobs instead, as in ART.

A step whose loss or gradient norm is not finite changes nothing: gradients are dropped, the
optimizer does not step, and `skipped_nonfinite` is 1 so the caller can count such steps. With a
`GradScaler` (float16 training, where small gradients underflow) the loss is scaled before each
backward pass and the gradients unscaled before clipping; an overflow skips the step the same way
and the scaler lowers its scale for the next one.

The caller can abandon a step (`should_stop`, polled before each microbatch and before the
optimizer steps: an interrupted cell should not wait for the whole batch) and watch it
(`on_progress`, one event per microbatch, from whatever thread runs the step). `before_update` is
called once the gradient is ready and before the weights or optimizer state change: the backend
waits there for the previous checkpoint, whose optimizer state is still being read in the
background, so that write overlaps this step's forward and backward passes instead of delaying them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import LOSSES, TrainConfig
from ..types import ProgressCallback
from .advantages import PreparedBatch
from .logprobs import token_logprobs
from .losses import kl_per_token, masked_mean, mismatch_weights, policy_log_ratio, token_loss, trajectory_divisors
from .tokens import TokenizedTrajectory

__all__ = ["grpo_step", "microbatches"]


def grpo_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    batch: PreparedBatch,
    config: TrainConfig,
    device: Any = "cpu",
    should_stop: Callable[[], bool] | None = None,
    on_progress: ProgressCallback | None = None,
    reference: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    scaler: torch.amp.GradScaler | None = None,
    before_update: Callable[[], bool] | None = None,
) -> dict[str, float]:
    """Forward/backward every microbatch, clip the gradient, step once. Returns step metrics.

    `config.kl_penalty_coef` > 0 adds that times the KL to the reference model to each trajectory's
    loss (`losses.kl_per_token`). The reference is `model` itself inside `reference()`: the trainer's
    `peft_model.disable_adapter`, so the base model costs one extra forward per microbatch under
    no_grad and no memory for a second copy. `reference_kl` in the metrics is its mean per token.

    Metrics: loss, entropy (mean over trained tokens), grad_norm, clip_fraction (share of trained
    tokens clipped), tokens_trained (0 when skipped), trajectories, mismatch_kl (KL from engine to
    trainer, k3 estimator, over trained tokens that have engine logprobs), mismatch_logprob_abs
    (mean |engine - trainer| logprob there), is_bounded_fraction (share of those tokens whose
    mismatch weight the cap or floor truncated or masked), is_weight_mean, reference_kl (KL to the
    reference, 0 unless kl_penalty_coef > 0), skipped_nonfinite, and grad_scale with a `scaler`.
    An empty batch returns zeros and does not step.

    `should_stop()` True before a microbatch or before the optimizer steps abandons the step:
    gradients dropped, weights and optimizer untouched, `stopped` = 1 in the metrics. After each
    microbatch's backward pass `on_progress` gets {"phase": "train", "done": k, "total": n,
    "tokens": trained tokens so far}; the last event of a completed step has done == total.
    `before_update()` runs after the last backward pass, before anything that changes the weights,
    the optimizer or the loss scaler; False abandons the step as `should_stop` does.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    items = batch.items
    totals = _Totals()
    if config.kl_penalty_coef > 0 and reference is None:
        raise ValueError("kl_penalty_coef > 0 needs the reference model's logprobs, and this trainer gave no way "
                         "to disable its adapter; set kl_penalty_coef=0")
    groups = microbatches(items, config.microbatch_tokens or 4096)
    totals.batch_tokens = sum(item.trainable_tokens for item in items)
    constant = config.max_completion_length or batch.max_seq_len or max(
        (item.trainable_tokens for item in items), default=1)
    for done, group in enumerate(groups, start=1):
        if should_stop is not None and should_stop():
            return _abandoned(optimizer, totals, len(items))
        mb = _collate(group, device)
        reference_logprobs = None
        if config.kl_penalty_coef > 0:
            assert reference is not None
            with torch.no_grad(), reference():
                reference_logprobs, _ = token_logprobs(
                    model, mb.input_ids, mb.attention_mask, config.logprob_chunk_tokens, positions=mb.mask)
        logprobs, entropy = token_logprobs(
            model, mb.input_ids, mb.attention_mask, config.logprob_chunk_tokens, positions=mb.mask
        )
        known = torch.isfinite(mb.engine_logprobs) & mb.mask
        loss, clipped, weights, bounded = _microbatch_loss(
            logprobs, mb, known, config, len(items), totals.batch_tokens, constant, reference_logprobs, totals)
        if not torch.isfinite(loss):
            totals.nonfinite = True
            break
        (scaler.scale(loss) if scaler is not None else loss).backward()
        totals.add(loss, entropy, clipped, logprobs.detach(), mb, known, weights, bounded)
        if on_progress is not None:
            on_progress({"phase": "train", "done": done, "total": len(groups), "tokens": totals.tokens})

    if not items:
        return totals.metrics(grad_norm=0.0, skipped=False, trajectories=0)
    if before_update is not None and not before_update():
        return _abandoned(optimizer, totals, len(items))
    grad_norm = math.nan
    if not totals.nonfinite:
        if scaler is not None:
            scaler.unscale_(optimizer)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm))
    skipped = not math.isfinite(grad_norm)
    if not skipped and should_stop is not None and should_stop():
        if scaler is not None:
            scaler.update()  # unscale_ ran: the scaler must close this step before the next one
        return _abandoned(optimizer, totals, len(items))
    if not skipped:
        scaler.step(optimizer) if scaler is not None else optimizer.step()
    if scaler is not None and not totals.nonfinite:
        scaler.update()  # an overflow (skipped) halves the scale; enough clean steps double it
    optimizer.zero_grad(set_to_none=True)
    metrics = totals.metrics(grad_norm=grad_norm, skipped=skipped, trajectories=len(items))
    if scaler is not None:
        metrics["grad_scale"] = float(scaler.get_scale())
    return metrics


def _microbatch_loss(
    logprobs: torch.Tensor,
    mb: _Microbatch,
    known: torch.Tensor,
    config: TrainConfig,
    trajectories: int,
    batch_tokens: int,
    constant: int,
    reference_logprobs: torch.Tensor | None,
    totals: _Totals,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This microbatch's share of the batch loss, and per token: clipped, mismatch weight, bounded."""
    assert config.epsilon is not None  # TrainConfig sets each loss's default
    epsilon_high = config.epsilon if config.epsilon_high is None else config.epsilon_high
    if config.importance_sampling_correction:
        old = logprobs.detach()  # pi_old is this trainer's policy: the engine sampled these weights
        weights, bounded = mismatch_weights(logprobs, mb.engine_logprobs, known, config.importance_sampling_mode,
                                            config.importance_sampling_cap, config.importance_sampling_floor)
    else:
        old = torch.where(known, mb.engine_logprobs, logprobs.detach())
        weights, bounded = torch.ones_like(logprobs), torch.zeros_like(known)
    spec = LOSSES[config.loss]
    level = "sequence" if config.importance_sampling_level == "sequence" else "token"
    log_ratio = policy_log_ratio(logprobs, old, mb.mask, level)
    per_token, clipped = token_loss(spec.objective, log_ratio, logprobs, mb.advantages, config.epsilon, epsilon_high)
    per_token = per_token * weights
    if reference_logprobs is not None:
        reference_kl = kl_per_token(logprobs, reference_logprobs, mb.mask)
        per_token = per_token + config.kl_penalty_coef * reference_kl
        totals.reference_kl += float(torch.where(mb.mask, reference_kl.detach(), 0.0).sum())
    divisors = trajectory_divisors(spec.aggregation, mb.mask.sum(-1), trajectories, batch_tokens, constant)
    loss = (torch.where(mb.mask, per_token, 0.0).sum(-1) / divisors).sum()
    return loss, clipped, weights, bounded


def _abandoned(optimizer: torch.optim.Optimizer, totals: _Totals, trajectories: int) -> dict[str, float]:
    """The metrics of a step stopped before the optimizer stepped: nothing was trained."""
    optimizer.zero_grad(set_to_none=True)
    metrics = totals.metrics(grad_norm=math.nan, skipped=False, trajectories=trajectories)
    return {**metrics, "tokens_trained": 0.0, "stopped": 1.0}


def microbatches(items: list[TokenizedTrajectory], max_tokens: int) -> list[list[TokenizedTrajectory]]:
    """Groups of items whose padded size (count x longest) stays within `max_tokens`.

    A sequence longer than `max_tokens` goes alone. Longest first, so lengths within a group
    are close and padding is small.
    """
    groups: list[list[TokenizedTrajectory]] = []
    for item in sorted(items, key=lambda i: len(i.input_ids), reverse=True):
        if groups and (len(groups[-1]) + 1) * len(groups[-1][0].input_ids) <= max_tokens:
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


@dataclass
class _Microbatch:
    input_ids: torch.Tensor  # [B, T], right-padded
    attention_mask: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T-1] bool: the predicted token was sampled
    engine_logprobs: torch.Tensor  # [B, T-1], NaN where unknown
    advantages: torch.Tensor  # [B]


def _collate(items: list[TokenizedTrajectory], device: Any) -> _Microbatch:
    length = max(len(i.input_ids) for i in items)
    input_ids = torch.zeros(len(items), length, dtype=torch.long)
    attention = torch.zeros(len(items), length, dtype=torch.long)
    mask = torch.zeros(len(items), length, dtype=torch.bool)
    engine = torch.full((len(items), length), math.nan, dtype=torch.float32)
    for row, item in enumerate(items):
        n = len(item.input_ids)
        input_ids[row, :n] = torch.tensor(item.input_ids)
        attention[row, :n] = 1
        mask[row, :n] = torch.tensor(item.assistant_mask)
        engine[row, :n] = torch.tensor(item.engine_logprobs, dtype=torch.float32)
    return _Microbatch(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        mask=mask[:, 1:].to(device),
        engine_logprobs=engine[:, 1:].to(device),
        advantages=torch.tensor([i.advantage for i in items], dtype=torch.float32, device=device),
    )


class _Totals:
    """Sums over microbatches, turned into per-step metrics at the end."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.tokens = 0
        self.entropy = 0.0
        self.clipped = 0.0
        self.kl = 0.0
        self.kl_tokens = 0
        self.reference_kl = 0.0  # sum over trained tokens of the KL to the reference (0 when not asked)
        self.mismatch_abs = 0.0  # sum over tokens with engine logprobs of |engine - trainer|
        self.is_weight = 0.0  # sum of the mismatch weights there
        self.is_bounded = 0  # tokens whose weight the cap/floor acted on
        self.batch_tokens = 0  # trained tokens of the whole batch (DAPO's divisor)
        self.nonfinite = False

    def add(
        self,
        loss: torch.Tensor,
        entropy: torch.Tensor,
        clipped: torch.Tensor,
        logprobs: torch.Tensor,
        mb: _Microbatch,
        known: torch.Tensor,
        weights: torch.Tensor,
        bounded: torch.Tensor,
    ) -> None:
        tokens = int(mb.mask.sum())
        self.loss += float(loss.detach())
        self.tokens += tokens
        self.entropy += float(masked_mean(entropy, mb.mask)) * tokens
        self.clipped += float((clipped & mb.mask).sum())
        self.is_weight += float(torch.where(known, weights, 0.0).sum())
        self.is_bounded += int((bounded & known).sum())
        # k3 estimate of KL(engine || trainer) from the engine's samples: r - 1 - log r,
        # r = p_trainer / p_engine (http://joschu.net/blog/kl-approx.html). Non-negative per token,
        # and 0 when the two agree.
        log_ratio = logprobs - torch.nan_to_num(mb.engine_logprobs)
        log_ratio = torch.where(known, log_ratio, torch.zeros_like(log_ratio))
        self.kl += float((torch.exp(log_ratio) - 1 - log_ratio).sum())
        self.mismatch_abs += float(log_ratio.abs().sum())
        self.kl_tokens += int(known.sum())

    def metrics(self, grad_norm: float, skipped: bool, trajectories: int) -> dict[str, float]:
        return {
            "loss": math.nan if self.nonfinite else self.loss,
            "entropy": self.entropy / max(self.tokens, 1),
            "grad_norm": grad_norm,
            "clip_fraction": self.clipped / max(self.tokens, 1),
            "tokens_trained": 0.0 if skipped else float(self.tokens),
            "trajectories": float(trajectories),
            "mismatch_kl": self.kl / max(self.kl_tokens, 1),
            "mismatch_logprob_abs": self.mismatch_abs / max(self.kl_tokens, 1),
            "is_weight_mean": self.is_weight / self.kl_tokens if self.kl_tokens else 1.0,
            "is_bounded_fraction": self.is_bounded / max(self.kl_tokens, 1),
            "reference_kl": self.reference_kl / max(self.tokens, 1),
            "skipped_nonfinite": float(skipped),
        }
