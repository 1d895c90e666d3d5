"""Trajectory -> a token sequence with a trainable mask, token-exact (captured calls whose history
parts: one per part, `training_sequences`).

The sequence is what the chat template renders for the conversation, with one exception: every
`Choice` contributes exactly the token ids the engine sampled (its `token_ids` extra field), not a
re-tokenisation of its text. Those ids are the only trainable tokens, and they carry the engine's
logprobs so the loss can form importance ratios without a second forward pass.

How the walk works. Text between choices is taken as a delta of template renders: the prompt before
choice k is `render(messages[:k], add_generation_prompt=True)` minus what was rendered before. After
a choice, the template's end-of-turn text (ChatML: "<|im_end|>\\n") is appended, less whatever the
sampled ids already contain (a sampled eos id already is "<|im_end|>"). Prompt text is tokenised in
one piece per gap so token boundaries match what the engine tokenised. Messages after the last
choice are dropped: a causal model's logprobs of earlier tokens cannot depend on them.

Fallbacks, each counted on the result:
- a Choice without `token_ids` is re-tokenised from the template's rendering of it
  (`retokenized_choices`); its logprobs are unknown (NaN), so the trainer uses its own.
- a template that rewrites history (e.g. strips earlier reasoning) is not prefix-stable; the new
  text is then realigned on the longest tail of the previous render found in the new one
  (`template_fallbacks`). Earlier tokens stay as sampled; later choices see that history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..tool_prompt import template_inputs
from ..trajectories import Choice, History, Trajectory, template_message
from .captured import CapturedSequence, captured_sequence, captured_sequences

__all__ = ["TokenizedTrajectory", "sampled_token_ids", "tokenize_trajectory", "training_sequences"]

_PROBE = "\u2063art_nb_probe\u2063"  # content no template alters, to locate the end-of-turn text


@dataclass
class TokenizedTrajectory:
    """One training sequence. Lists are parallel; `assistant_mask[i]` marks a sampled token."""

    input_ids: list[int]
    assistant_mask: list[bool]
    engine_logprobs: list[float]
    advantage: float = 0.0
    group_index: int = 0
    truncated: bool = False
    retokenized_choices: int = 0
    template_fallbacks: int = 0
    parted: str | None = None  # captured calls only: why this sequence starts anew (grpo/captured.py)

    def __post_init__(self) -> None:
        if not len(self.input_ids) == len(self.assistant_mask) == len(self.engine_logprobs):
            raise ValueError(
                f"input_ids ({len(self.input_ids)}), assistant_mask ({len(self.assistant_mask)}) and "
                f"engine_logprobs ({len(self.engine_logprobs)}) must have the same length"
            )

    @property
    def trainable_tokens(self) -> int:
        """Sampled tokens that have a prefix to be predicted from (the first token never does)."""
        return sum(self.assistant_mask[1:])


def sampled_token_ids(choice: Choice) -> list[int] | None:
    """The ids the engine sampled for this choice, or None when the endpoint did not send them."""
    ids = (choice.model_extra or {}).get("token_ids")
    if ids is None:
        ids = getattr(choice, "token_ids", None)  # third-party: a declared field in some openai releases
    return [int(i) for i in ids] if ids is not None else None


def tokenize_trajectory(tokenizer: Any, trajectory: Trajectory | History, max_seq_len: int) -> TokenizedTrajectory:
    """Token ids, trainable mask and engine logprobs for one conversation (see module docstring): a
    trajectory's main one, or one of its `additional_histories`. A trajectory of captured calls
    (`with Trajectory()`, `art.trajectory(...)`) takes the exact path of `grpo.captured`.

    A trajectory without a Choice yields its prompt tokens with nothing trainable; the caller
    counts and skips it. Sequences longer than `max_seq_len` are cut and marked `truncated`.
    """
    if isinstance(trajectory, Trajectory) and trajectory.exchanges:  # the server's ids, no re-rendering
        return _from_captured(captured_sequence(tokenizer, trajectory.exchanges), max_seq_len)
    items = trajectory.messages_and_choices
    messages = trajectory.messages()
    walk = _Walk(tokenizer, trajectory.tools)
    if not any(isinstance(item, Choice) for item in items):
        walk.add_prompt(walk.render(messages, generation_prompt=False))
    for k, choice in enumerate(items):
        if not isinstance(choice, Choice):
            continue
        before = walk.render(messages[:k], generation_prompt=True)
        walk.pending += walk.delta(before)
        walk.flush()
        after = walk.render(messages[: k + 1], generation_prompt=False)
        turn = after[len(before) :] if after.startswith(before) else None
        end_of_turn = walk.end_of_turn(messages[:k])
        ids = sampled_token_ids(choice)
        if ids is None:
            walk.add_retokenized(choice, turn, end_of_turn)
        else:
            walk.add_sampled(ids, _choice_logprobs(choice, len(ids)))
            walk.pending += _unsampled_tail(tokenizer, ids, turn, end_of_turn)
        walk.rendered = after
    walk.flush()
    return walk.result(max_seq_len)


def training_sequences(tokenizer: Any, trajectory: Trajectory | History, max_seq_len: int) -> list[TokenizedTrajectory]:
    """What a train step makes of one conversation: `tokenize_trajectory`'s one sequence, except for captured
    calls whose history parts (an agent that swaps its system prompt or sends a reply back changed, as
    smolagents' do): one sequence per part, each exactly as sampled (grpo/captured.py)."""
    if isinstance(trajectory, Trajectory) and trajectory.exchanges:
        return [_from_captured(seq, max_seq_len) for seq in captured_sequences(tokenizer, trajectory.exchanges)]
    return [tokenize_trajectory(tokenizer, trajectory, max_seq_len)]


def _from_captured(seq: CapturedSequence, max_seq_len: int) -> TokenizedTrajectory:
    return TokenizedTrajectory(
        input_ids=seq.input_ids[:max_seq_len], assistant_mask=seq.assistant_mask[:max_seq_len],
        engine_logprobs=seq.engine_logprobs[:max_seq_len], truncated=len(seq.input_ids) > max_seq_len,
        template_fallbacks=seq.realigned, parted=seq.parted)


class _Walk:
    """The sequence under construction, plus the template text it corresponds to so far."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        self.input_ids: list[int] = []
        self.mask: list[bool] = []
        self.logprobs: list[float] = []
        self.rendered = ""  # template render that the built sequence stands for
        self.pending = ""  # prompt text not yet tokenised
        self.retokenized = 0
        self.fallbacks = 0

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        if not messages:  # a trajectory that opens with a Choice; templates reject empty conversations
            return ""
        # Tools as the endpoint showed them: the template's own rendering, or art_nb's Hermes-style text
        shown, tools = template_inputs(self.tokenizer, [template_message(m) for m in messages], self.tools)
        return self.tokenizer.apply_chat_template(shown, tools=tools, add_generation_prompt=generation_prompt,
                                                  tokenize=False)

    def encode(self, text: str) -> list[int]:
        # Rendered templates already contain their special tokens (BOS included where the template
        # writes it), so the tokenizer must not add its own.
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def delta(self, new: str) -> str:
        """Text `new` adds to what has been rendered so far."""
        if new.startswith(self.rendered):
            return new[len(self.rendered) :]
        self.fallbacks += 1
        return _realign(self.rendered, new)

    def end_of_turn(self, history: list[dict[str, Any]]) -> str:
        """What the template writes after an assistant message's content (ChatML: '<|im_end|>\\n')."""
        probe = self.render([*history, {"role": "assistant", "content": _PROBE}], generation_prompt=False)
        at = probe.rfind(_PROBE)
        return probe[at + len(_PROBE) :] if at >= 0 else ""

    def add_prompt(self, text: str) -> None:
        ids = self.encode(text)
        self.input_ids += ids
        self.mask += [False] * len(ids)
        self.logprobs += [math.nan] * len(ids)

    def flush(self) -> None:
        self.add_prompt(self.pending)
        self.pending = ""

    def add_sampled(self, ids: list[int], logprobs: list[float]) -> None:
        self.input_ids += ids
        self.mask += [True] * len(ids)
        self.logprobs += logprobs

    def add_retokenized(self, choice: Choice, turn: str | None, end_of_turn: str) -> None:
        """Train on the template's rendering of a choice whose sampled ids were not sent."""
        self.retokenized += 1
        if turn is None:
            turn = (choice.message.content or "") + end_of_turn
        content, tail = turn, ""
        if end_of_turn and turn.endswith(end_of_turn):
            content, tail = turn[: -len(end_of_turn)], end_of_turn
        ids = self.encode(content)
        # A choice that stopped on its own sampled the end-of-turn token: train on it too.
        tail_ids = self.encode(tail)
        if choice.finish_reason in ("stop", "tool_calls") and tail_ids:
            first = tail_ids[0]
            first_text = self.tokenizer.decode([first], skip_special_tokens=False)
            if first in set(self.tokenizer.all_special_ids) and tail.startswith(first_text):
                ids.append(first)
                tail = tail[len(first_text) :]
        self.add_sampled(ids, [math.nan] * len(ids))
        self.pending += tail

    def result(self, max_seq_len: int) -> TokenizedTrajectory:
        truncated = len(self.input_ids) > max_seq_len
        return TokenizedTrajectory(
            input_ids=self.input_ids[:max_seq_len],
            assistant_mask=self.mask[:max_seq_len],
            engine_logprobs=self.logprobs[:max_seq_len],
            truncated=truncated,
            retokenized_choices=self.retokenized,
            template_fallbacks=self.fallbacks,
        )


def _choice_logprobs(choice: Choice, n: int) -> list[float]:
    """Engine logprobs of the sampled ids; NaN when absent or not one per token."""
    content = choice.logprobs.content if choice.logprobs is not None else None
    if not content or len(content) != n:
        return [math.nan] * n
    return [float(entry.logprob) for entry in content]


def _unsampled_tail(tokenizer: Any, ids: list[int], turn: str | None, end_of_turn: str) -> str:
    """Template text that closes the turn and that the sampled ids did not already produce."""
    sampled = tokenizer.decode(ids, skip_special_tokens=False)
    if turn is not None and turn.startswith(sampled):
        return turn[len(sampled) :]
    # The message was post-processed (stripped, tool calls parsed): match the end-of-turn text
    # against the last sampled tokens instead, so a sampled eos is not written twice.
    for n in range(min(len(ids), len(end_of_turn)), 0, -1):
        tail = tokenizer.decode(ids[-n:], skip_special_tokens=False)
        if tail and end_of_turn.startswith(tail):
            return end_of_turn[len(tail) :]
    return end_of_turn


def _realign(previous: str, new: str) -> str:
    """The part of `new` after what `previous` covered, when `new` rewrote earlier turns.

    Finds the longest tail of `previous` that occurs in the diverging part of `new` and returns
    what follows its first occurrence. (If a suffix occurs, every shorter one does: binary search.)
    """
    common = 0
    for a, b in zip(previous, new):
        if a != b:
            break
        common += 1
    old, rest = previous[common:], new[common:]
    lo, hi = 0, len(old)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if old[len(old) - mid :] in rest:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return rest
    return rest[rest.index(old[len(old) - lo :]) + lo :]
