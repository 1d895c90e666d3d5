"""Group-relative advantages, and the batch the GRPO step trains on.

GRPO has no value model: a trajectory's advantage is its reward relative to the other
trajectories of the same group (same scenario), `A = (r - mean) / (std + eps)`. The std is the
population std (divide by n), so a group's advantages always have unit RMS whatever its size:
a group of two with rewards 0 and 1 gets -1 and +1.

A group whose rewards are all equal (a group of one included) carries no signal, all its
advantages are zero, so it is skipped before anything is tokenised, and counted. So is a group with
no trajectories at all (every rollout of it failed), a trajectory with nothing to train on (no
Choice, or cut off before it by `max_seq_len`), a truncated sequence, and each Choice that had to
be re-tokenised because the endpoint sent no token ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import TrainConfig
from ..trajectory import TrajectoryGroup
from .tokens import TokenizedTrajectory, tokenize_trajectory

__all__ = ["group_advantages", "PreparedBatch", "prepare_batch"]


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """`(r - mean) / (std + eps)` with the population std, or just `r - mean` when not `scale`."""
    centered = rewards - rewards.mean()
    if not scale:
        return centered
    return centered / (rewards.std(correction=0) + eps)


@dataclass
class PreparedBatch:
    """Tokenised trajectories with their advantages, and what was left out and why."""

    items: list[TokenizedTrajectory] = field(default_factory=list)
    groups: int = 0  # groups that contributed at least one item
    zero_variance_groups: int = 0
    empty_groups: int = 0  # no trajectories: every rollout of the group failed
    truncated: int = 0
    skipped_trajectories: int = 0  # in groups with signal, but no trainable tokens
    retokenized_choices: int = 0  # Choices without `token_ids`, trained on their re-tokenised text
    template_fallbacks: int = 0  # turns realigned because the chat template rewrote history
    reward_mean: float = 0.0
    reward_std: float = 0.0

    def metrics(self) -> dict[str, float]:
        """Batch counters, named as they appear in the training history."""
        return {
            "groups": float(self.groups),
            "zero_variance_groups": float(self.zero_variance_groups),
            "empty_groups": float(self.empty_groups),
            "truncated": float(self.truncated),
            "skipped_trajectories": float(self.skipped_trajectories),
            "retokenized_choices": float(self.retokenized_choices),
            "template_fallbacks": float(self.template_fallbacks),
            "reward_mean": self.reward_mean,  # not "reward": the history keeps the rollouts' own train/reward
            "reward_std": self.reward_std,
        }


def prepare_batch(
    groups: list[TrajectoryGroup], tokenizer: Any, config: TrainConfig, max_seq_len: int
) -> PreparedBatch:
    """Advantages per group, then tokens per trajectory, for every group that has a signal.

    Reward statistics cover every trajectory given (they describe the rollouts, not the update).
    """
    batch = PreparedBatch()
    rewards = [t.reward for group in groups for t in group.trajectories]
    if rewards:
        batch.reward_mean = sum(rewards) / len(rewards)
        batch.reward_std = math.sqrt(sum((r - batch.reward_mean) ** 2 for r in rewards) / len(rewards))
    for index, group in enumerate(groups):
        if not group.trajectories:
            batch.empty_groups += 1
            continue
        if len(set(group.rewards())) == 1:
            batch.zero_variance_groups += 1
            continue
        advantages = group_advantages(
            torch.tensor(group.rewards(), dtype=torch.float64), scale=config.scale_rewards
        )
        used = False
        for j, (trajectory, advantage) in enumerate(zip(group.trajectories, advantages.tolist())):
            try:
                item = tokenize_trajectory(tokenizer, trajectory, max_seq_len)
            except Exception as error:  # e.g. a chat template that rejects the conversation
                raise ValueError(
                    f"groups[{index}].trajectories[{j}] could not be tokenized for training: "
                    f"{type(error).__name__}: {error}"
                ) from error
            batch.truncated += item.truncated
            batch.retokenized_choices += item.retokenized_choices
            batch.template_fallbacks += item.template_fallbacks
            if item.trainable_tokens == 0:
                batch.skipped_trajectories += 1
                continue
            item.advantage = advantage
            item.group_index = index
            batch.items.append(item)
            used = True
        batch.groups += used
    return batch
