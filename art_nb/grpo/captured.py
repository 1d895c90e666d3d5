"""Captured calls -> one training sequence, from the server's own token ids, with no re-rendering.

The recorded ids are the truth: call 0 contributes its prompt ids (not trained) and its sampled ids
(trained, with the server's logprobs); each later call must *extend* what came before, i.e. its
prompt ids start with the previous prompt + sampled ids, and only the new tail (tool results, the
next user turn, template scaffold such as "<|im_end|>\\n<|im_start|>user\\n") is added, as prompt.
So the trainable tokens are exactly the sampled ones (`retokenized_choices == 0` always) and every
token between them is what the server put in front of the model.

When ids differ but the decoded text is the same (the client sent back the sampled text, and the
server's tokenizer split it differently, e.g. "Hel"+"lo" re-encoded as "Hello"), the history is still
append-only as text: the earlier ids stay as sampled and the new call's ids continue from the first
token boundary where its text has covered the earlier text. Counted as `template_fallbacks`.

Refused, with a message that names the call and shows where the histories part:
- a call whose prompt does not extend the history (a chat template that rewrites earlier turns,
  e.g. Qwen3 dropping earlier `<think>` blocks; a client that edits or truncates the conversation);
  pick one branch (`trajectory.exchanges = trajectory.exchanges[k:]`) to train on what is left;
- a call with several choices that is not followed by a call continuing exactly one of them (a
  branch); for the last call only `n=1` is accepted;
- calls to different models in one trajectory (use `art.no_capture()` around the other model).
"""

from __future__ import annotations

import math
from typing import Any

from dataclasses import dataclass

from ..capture import CapturedCall, CapturedChoice

__all__ = ["CaptureRefused", "CapturedSequence", "captured_sequence"]

_SHOW = 60  # characters of context shown either side of a divergence


class CaptureRefused(ValueError):
    """The captured calls cannot be trained on exactly as one sequence; the message says why and where."""


@dataclass
class CapturedSequence:
    """Parallel lists (tokens.py makes them a TokenizedTrajectory); `realigned`: boundaries found by text."""

    input_ids: list[int]
    assistant_mask: list[bool]
    engine_logprobs: list[float]
    realigned: int


def captured_sequence(tokenizer: Any, calls: list[CapturedCall]) -> CapturedSequence:
    """The training sequence for `calls` (see the module docstring); raises CaptureRefused."""
    _one_model(calls)
    ids: list[int] = []
    mask: list[bool] = []
    logprobs: list[float] = []
    realigned = 0
    for k, call in enumerate(calls):
        prompt = call.prompt_token_ids
        start = 0
        if k > 0:
            start, by_text = _continuation(tokenizer, ids, prompt, k)
            realigned += by_text
        ids += prompt[start:]
        mask += [False] * (len(prompt) - start)
        logprobs += [math.nan] * (len(prompt) - start)
        choice = _chosen(tokenizer, calls, k, ids)
        ids += choice.token_ids
        mask += [True] * len(choice.token_ids)
        logprobs += choice.logprobs if choice.logprobs is not None else [math.nan] * len(choice.token_ids)
    return CapturedSequence(ids, mask, logprobs, realigned)


def _one_model(calls: list[CapturedCall]) -> None:
    if not calls:
        return
    first = calls[0].model_family
    for k, call in enumerate(calls):
        if call.model_family != first:
            raise CaptureRefused(
                f"captured call {k} went to model {call.model!r} but call 0 went to {calls[0].model!r}: one "
                "trajectory trains one model; wrap calls to the other model in `with art.no_capture():`")


def _chosen(tokenizer: Any, calls: list[CapturedCall], k: int, history: list[int]) -> CapturedChoice:
    """The choice of call k the conversation went on with."""
    choices = calls[k].choices
    if len(choices) == 1:
        return choices[0]
    if k + 1 == len(calls):
        raise CaptureRefused(f"captured call {k} (the last) sampled {len(choices)} choices (n={len(choices)}): "
                             "that is a branch, and one sequence trains one history; call with n=1, or keep "
                             "the calls of one branch (`trajectory.exchanges = [...]`)")
    following = calls[k + 1].prompt_token_ids
    matches = [c for c in choices if _extends(tokenizer, history + c.token_ids, following)]
    if len(matches) != 1:
        raise CaptureRefused(f"captured call {k} sampled {len(choices)} choices and call {k + 1} continues "
                             f"{len(matches)} of them: a branch; keep the calls of one branch "
                             "(`trajectory.exchanges = [...]`)")
    return matches[0]


def _extends(tokenizer: Any, history: list[int], prompt: list[int]) -> bool:
    if prompt[: len(history)] == history:
        return True
    return tokenizer.decode(prompt, skip_special_tokens=False).startswith(
        tokenizer.decode(history, skip_special_tokens=False))


def _continuation(tokenizer: Any, history: list[int], prompt: list[int], k: int) -> tuple[int, int]:
    """(where in `prompt` the new part starts, 1 if found by text rather than by ids)."""
    if prompt[: len(history)] == history:
        return len(history), 0
    common = next((i for i, (a, b) in enumerate(zip(history, prompt)) if a != b), min(len(history), len(prompt)))
    old_text = tokenizer.decode(history, skip_special_tokens=False)
    new_text = tokenizer.decode(prompt, skip_special_tokens=False)
    if new_text.startswith(old_text):
        for n in range(common, len(prompt) + 1):
            covered = tokenizer.decode(prompt[:n], skip_special_tokens=False)
            if covered == old_text:
                return n, 1
            if len(covered) > len(old_text):
                break
    raise CaptureRefused(_divergence(k, old_text, new_text))


def _divergence(k: int, old: str, new: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    lo = max(0, at - _SHOW)
    return (f"captured call {k}'s prompt does not extend the history before it (call {k - 1}'s prompt + the "
            f"tokens it sampled), so no single sequence holds both exactly. They part at character {at}:\n"
            f"  history so far: {old[lo:at + _SHOW]!r}\n"
            f"  call {k}'s prompt:  {new[lo:at + _SHOW]!r}\n"
            "Usual cause: the chat template rewrites earlier turns (e.g. drops earlier <think> blocks), or the "
            "agent edited or truncated its conversation. To train on one branch, keep only the calls that extend "
            f"each other, e.g. `trajectory.exchanges = trajectory.exchanges[{k}:]`.")
