"""The GRPO core, pure torch: trajectories -> tokens and masks -> advantages -> loss -> one step.

No I/O, no engine, no HTTP: trainers call `prepare_batch` then `grpo_step`. Importing this
package imports torch, so `art_nb/__init__.py` must only import it lazily.
"""

from .advantages import PreparedBatch, group_advantages, prepare_batch
from .logprobs import token_logprobs
from .losses import masked_mean
from .step import grpo_step
from .tokens import TokenizedTrajectory, tokenize_trajectory, training_sequences

__all__ = [
    "PreparedBatch",
    "TokenizedTrajectory",
    "group_advantages",
    "grpo_step",
    "masked_mean",
    "prepare_batch",
    "token_logprobs",
    "tokenize_trajectory",
    "training_sequences",
]
