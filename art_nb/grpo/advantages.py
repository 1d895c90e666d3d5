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

With `TrainConfig.mask_truncated_completions` (TRL's name, DAPO's overlong filtering) a sequence
whose last Choice stopped at the token limit (finish_reason "length") or that `max_seq_len` cut is
left out of the loss, after the advantages of its group were computed with it, and counted
(`masked_truncated`): its reward judged an unfinished answer, not the answer the policy would give.

A trajectory trains as one sequence per conversation: its own, each of its `additional_histories`, and
for captured calls whose history parts (grpo/captured.py), one per part (`parted_histories` counts
those extra sequences); all of them get the trajectory's advantage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import TrainConfig
from ..records import mean_and_std
from ..trajectories import Choice, History, Trajectory, TrajectoryGroup
from .tokens import TokenizedTrajectory, training_sequences

__all__ = ["PreparedBatch", "group_advantages", "prepare_batch"]


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """`(r - mean) / (std + eps)` with the population std, or just `r - mean` when not `scale`.

    Computed on rewards divided by their largest magnitude, so any finite rewards give finite
    advantages: squaring a reward of 1e200 overflows float64 (std inf, advantages 0 or NaN).
    The result is the same formula; only `eps` is in reward units, divided likewise.
    """
    size = rewards.abs().max()
    if not torch.isfinite(size) or size == 0:
        size = torch.ones((), dtype=rewards.dtype)
    unit = rewards / size
    centered = unit - unit.mean()
    if not scale:  # r - mean itself can exceed float64 (1.7e308 - -1.7e308): the nearest finite value
        biggest = torch.finfo(rewards.dtype).max
        return (centered * size).clamp(-biggest, biggest)
    return centered / (unit.std(correction=0) + eps / size)


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
    masked_truncated: int = 0  # sequences left out by mask_truncated_completions
    parted_histories: int = 0  # extra sequences of captured trajectories whose history parted (grpo/captured.py)
    reward_mean: float = 0.0
    reward_std: float = 0.0
    max_seq_len: int = 0  # the tokenisation limit; dr_grpo's default constant

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
            "masked_truncated": float(self.masked_truncated),
            "parted_histories": float(self.parted_histories),
            "reward_mean": self.reward_mean,  # not "reward": the history keeps the rollouts' own train/reward
            "reward_std": self.reward_std,
        }


def prepare_batch(
    groups: list[TrajectoryGroup], tokenizer: Any, config: TrainConfig, max_seq_len: int,
    vocab_size: int | None = None,
) -> PreparedBatch:
    """Advantages per group, then tokens per trajectory, for every group that has a signal.

    Reward statistics cover every trajectory given (they describe the rollouts, not the update).
    `vocab_size` (the model's embedding rows): token ids outside it are refused here, naming the
    trajectory, before they reach the model (on a GPU an out-of-range id is a device assert that
    takes the whole process down; on CPU an IndexError mid-step).
    """
    batch = PreparedBatch(max_seq_len=max_seq_len)
    rewards = [t.reward for group in groups for t in group.trajectories]
    if rewards:
        batch.reward_mean, batch.reward_std = mean_and_std(rewards)
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
            # The main conversation, then each additional history: one sequence each, same advantage.
            for k, history in enumerate([trajectory, *trajectory.additional_histories]):
                where = f"groups[{index}].trajectories[{j}]" + (f".additional_histories[{k - 1}]" if k else "")
                try:
                    items = training_sequences(tokenizer, history, max_seq_len)
                except Exception as error:  # e.g. a chat template that rejects the conversation
                    raise ValueError(f"{where} could not be tokenized for training: "
                                     f"{type(error).__name__}: {error}") from error
                batch.parted_histories += len(items) - 1
                for part, item in enumerate(items):
                    if vocab_size is not None:
                        _check_vocabulary(item.input_ids, vocab_size, where)
                    batch.truncated += item.truncated
                    batch.retokenized_choices += item.retokenized_choices
                    batch.template_fallbacks += item.template_fallbacks
                    if item.trainable_tokens == 0:
                        batch.skipped_trajectories += k == 0 and part == 0  # a history without a Choice is context
                        continue
                    last = part == len(items) - 1  # the trajectory's last reply ends the last part
                    if config.mask_truncated_completions and (item.truncated or last and _stopped_at_length(history)):
                        batch.masked_truncated += 1
                        continue
                    item.advantage = advantage
                    item.group_index = index
                    batch.items.append(item)
                    used = True
        batch.groups += used
    return batch


def _check_vocabulary(ids: list[int], vocab_size: int, where: str) -> None:
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{where} has token id {bad}, outside the model's vocabulary [0, {vocab_size}): "
                         "token ids must come from this model's tokenizer (keep the Choice the endpoint returned)")


def _stopped_at_length(history: Trajectory | History) -> bool:
    """Whether the conversation's last Choice ended at the token limit rather than on its own."""
    choices = [item for item in history.conversation() if isinstance(item, Choice)]  # captured calls too
    return bool(choices) and choices[-1].finish_reason == "length"
