"""The GRPO core, pure torch: trajectories -> tokens and masks -> advantages -> loss -> one step.

No I/O, no engine, no HTTP: trainers call `prepare_batch` then `grpo_step`. Importing this
package imports torch, so `art_nb/__init__.py` must only import it lazily.
"""

from .advantages import PreparedBatch, group_advantages, prepare_batch
from .loss import cispo_loss, masked_mean, ppo_clip_loss, token_logprobs
from .step import grpo_step
from .tokens import TokenizedTrajectory, tokenize_trajectory

__all__ = [
    "PreparedBatch",
    "TokenizedTrajectory",
    "cispo_loss",
    "group_advantages",
    "grpo_step",
    "masked_mean",
    "ppo_clip_loss",
    "prepare_batch",
    "token_logprobs",
    "tokenize_trajectory",
]
