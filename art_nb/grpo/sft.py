"""Supervised fine-tuning (SFT), pure torch: demonstrations -> labelled tokens -> one optimizer step per batch.

What trains. Every assistant turn of a trajectory is a label: a `Choice` with the token ids the
engine sampled contributes exactly those ids (as in GRPO), and a plain assistant dict (a written
demonstration) contributes the template's rendering of its content plus the end-of-turn token,
since a model that is to stop after the answer must learn to emit it. Everything else (system
prompt, user and tool turns, the `<|im_start|>assistant\\n` scaffold, the newline after
`<|im_end|>`) is context with no loss. `assistant_turns="last"` (ART's option) keeps only the final
assistant turn as a label; earlier ones stay in the sequence as context. The walk itself is
`tokens.tokenize_trajectory`'s, so what SFT trains on is laid out token for token as a GRPO step
and the served prompt would lay it out.

Departures from ART, on purpose: ART finds assistant spans by searching the token ids for the
template's instruction/response markers; here the spans come from rendering the conversation turn
by turn, which needs no per-model marker table. A trajectory longer than `max_seq_len` is dropped
and counted (as ART does), not cut: a cut answer would teach the model to stop mid-sentence.

The loss is ART's: the mean negative log-likelihood over every label token of the batch (all
tokens of the batch weigh the same, so a long demonstration counts more than a short one), one
AdamW step per batch with its own learning rate, gradient norm clipped. Microbatches bound memory
(`step.microbatches`); the sum over microbatches equals the full-batch mean. A batch whose loss or
gradient is not finite changes nothing and is counted (`skipped_nonfinite`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..sft_config import TrainSFTConfig
from ..trajectories import Choice, Trajectory
from ..types import ProgressCallback
from .logprobs import token_logprobs
from .step import _collate, microbatches
from .tokens import TokenizedTrajectory, tokenize_trajectory

__all__ = ["SFTBatch", "prepare_sft_batches", "sft_step", "tokenize_sft"]


@dataclass
class _LabelView:
    """A conversation as `tokenize_trajectory` walks it, with every assistant dict standing in as an
    unsampled Choice (so it is trained), while templates still render the original messages."""

    messages_and_choices: list[Any]
    original: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None

    def messages(self) -> list[dict[str, Any]]:
        return self.original


def _as_label(item: Any) -> Any:
    """An assistant dict as a Choice without sampled ids: the walk then trains on its rendering."""
    if isinstance(item, Choice) or item.get("role") != "assistant":
        return item
    content = item.get("content")
    return Choice.model_validate({
        "index": 0,
        "finish_reason": "tool_calls" if item.get("tool_calls") else "stop",  # both end on the eos token
        "message": {"role": "assistant", "content": content if isinstance(content, str) else None},
    })


def tokenize_sft(tokenizer: Any, trajectory: Trajectory, max_seq_len: int,
                 assistant_turns: str = "all") -> TokenizedTrajectory:
    """Token ids and label mask (`assistant_mask`) of one demonstration; see the module docstring.

    The result is marked `truncated` (and has every token) when it is longer than `max_seq_len`:
    the caller drops it. With `assistant_turns="last"` only the last run of label tokens is kept.
    """
    messages = trajectory.messages()
    view = _LabelView([_as_label(item) for item in trajectory.conversation()], messages, trajectory.conversation_tools())
    tokenized = tokenize_trajectory(tokenizer, view, max_seq_len=10**9)  # type: ignore[arg-type]  # duck-typed view
    tokenized.truncated = len(tokenized.input_ids) > max_seq_len
    if assistant_turns == "last":
        tokenized.assistant_mask = _last_run_only(tokenized.assistant_mask)
    elif assistant_turns != "all":
        raise ValueError(f"assistant_turns={assistant_turns!r}: use 'all' or 'last'")
    return tokenized


def _last_run_only(mask: list[bool]) -> list[bool]:
    """`mask` with every run of True but the last one cleared (turns are separated by scaffold tokens)."""
    end = max((i for i, on in enumerate(mask) if on), default=-1)
    if end < 0:
        return list(mask)
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return [start <= i <= end for i in range(len(mask))]


@dataclass
class SFTBatch:
    """The tokenised demonstrations of one optimizer step, and its learning rate."""

    items: list[TokenizedTrajectory]
    learning_rate: float
    dropped_too_long: int = 0
    without_labels: int = 0

    @property
    def label_tokens(self) -> int:
        """Tokens with a loss: labels that have a prefix to be predicted from."""
        return sum(item.trainable_tokens for item in self.items)


def prepare_sft_batches(trajectories: Sequence[Trajectory], tokenizer: Any, config: TrainSFTConfig,
                        max_seq_len: int) -> list[SFTBatch]:
    """Split `trajectories` into batches of `config.resolved_batch_size` (in order, as ART does),
    give each its learning rate, and tokenise them. Demonstrations too long or with no assistant
    turn are counted on their batch and left out of it."""
    size = config.resolved_batch_size
    chunks = [list(trajectories[i : i + size]) for i in range(0, len(trajectories), size)]
    batches = []
    for chunk, rate in zip(chunks, config.schedule(len(trajectories)), strict=True):
        batch = SFTBatch(items=[], learning_rate=rate)
        for trajectory in chunk:
            item = tokenize_sft(tokenizer, trajectory, max_seq_len, config.assistant_turns)
            if item.truncated:
                batch.dropped_too_long += 1
            elif item.trainable_tokens == 0:
                batch.without_labels += 1
            else:
                batch.items.append(item)
        batches.append(batch)
    return batches


def sft_step(model: Any, optimizer: torch.optim.Optimizer, batch: SFTBatch, config: TrainSFTConfig, *,
             microbatch_tokens: int, logprob_chunk_tokens: int, device: Any = "cpu",
             should_stop: Callable[[], bool] | None = None,
             on_progress: ProgressCallback | None = None) -> dict[str, float]:
    """One optimizer step on `batch`: mean token NLL over its labels, clipped, at its learning rate.

    Metrics: loss (the mean NLL before the step), grad_norm, learning_rate, tokens_trained (0 when
    skipped or stopped), trajectories, skipped_nonfinite, stopped. An empty batch does not step.
    `should_stop()` is polled before each microbatch and before the optimizer steps (True leaves
    weights and optimizer untouched); `on_progress` gets {"phase": "sft", "done", "total", "tokens"}.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    metrics = {"loss": 0.0, "grad_norm": 0.0, "learning_rate": batch.learning_rate, "tokens_trained": 0.0,
               "trajectories": float(len(batch.items)), "skipped_nonfinite": 0.0, "stopped": 0.0}
    labels = batch.label_tokens
    if labels == 0:
        return metrics
    groups = microbatches(batch.items, microbatch_tokens)
    total, nonfinite = 0.0, False
    for done, group in enumerate(groups, start=1):
        if should_stop is not None and should_stop():
            return _abandoned(optimizer, metrics)
        mb = _collate(group, device)
        logprobs, _ = token_logprobs(model, mb.input_ids, mb.attention_mask, logprob_chunk_tokens, positions=mb.mask)
        loss = -(logprobs * mb.mask).sum() / labels  # this microbatch's share of the batch mean
        if not torch.isfinite(loss):
            nonfinite = True
            break
        loss.backward()
        total += float(loss.detach())
        if on_progress is not None:
            on_progress({"phase": "sft", "done": done, "total": len(groups), "tokens": int(mb.mask.sum())})
    grad_norm = math.nan if nonfinite else float(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm))
    metrics.update(loss=math.nan if nonfinite else total, grad_norm=grad_norm)
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return {**metrics, "skipped_nonfinite": 1.0}
    if should_stop is not None and should_stop():
        return _abandoned(optimizer, metrics)
    for param_group in optimizer.param_groups:
        param_group["lr"] = batch.learning_rate
        param_group["weight_decay"] = config.weight_decay
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {**metrics, "tokens_trained": float(labels)}


def _abandoned(optimizer: torch.optim.Optimizer, metrics: dict[str, float]) -> dict[str, float]:
    optimizer.zero_grad(set_to_none=True)
    return {**metrics, "tokens_trained": 0.0, "stopped": 1.0}
