"""Captured calls -> training sequences, from the server's own token ids, with no re-rendering.

The recorded ids are the truth: call 0 contributes its prompt ids (not trained) and its sampled ids
(trained, with the server's logprobs); each later call must *extend* what came before, i.e. its
prompt ids start with the previous prompt + sampled ids, and only the new tail (tool results, the
next user turn, template scaffold such as "<|im_end|>\\n<|im_start|>user\\n") is added, as prompt.
So the trainable tokens are exactly the sampled ones (`retokenized_choices == 0` always) and every
token between them is what the server put in front of the model.

When ids differ but the decoded text is the same (the client sent back the sampled text, and the
server's tokenizer split it differently, e.g. "Hel"+"lo" re-encoded as "Hello"), the history is still
append-only as text: the earlier ids stay as sampled and the new call's ids continue from the first
token boundary where its text has covered the earlier text. Counted as `template_fallbacks`. Only
where the reply came back as the endpoint returned it: one the client changed parts the history
(below), even when its text still extends it (CodeAgent writing its stop string back).

A call whose prompt does not extend the history parts it: the calls before it are one sequence and
the calls from it on the next (`captured_sequences`), each exactly as sampled, so every sampled token
is trained once, after exactly the prompt it was sampled from; a train step gives every part the
trajectory's advantage, as it does ART's `additional_histories`. That is how agents that do not keep
one growing conversation train: a client that edits, reorders or truncates the conversation or swaps
its system prompt (smolagents asks for its final answer under a system prompt of its own), or sends
a reply back changed (smolagents' CodeAgent appends its closing code tag, its ToolCallingAgent sends a
call back as its own "Calling tools:" text); with `ModelConfig(assistant_turns="rendered")`, also a
chat template that rewrites earlier turns (by default art_nb's endpoint gives a turn it sampled back
as the sampled ids, local/server/turns.py). Each part after the first says where and why it parted
(`CapturedSequence.parted`: the call, the two texts where they differ, and the cause where the
requests show it); `captured_sequence`, for one sequence only, refuses such calls with that text.

Refused, with a message that names the call:
- a call with several choices that is not followed by a call continuing exactly one of them (a
  branch; choices with the very same ids count as one); for the last call only `n=1` is accepted;
- calls to different models in one trajectory (use `art.no_capture()` around the other model).

A reply cut at a stop string (`stop=[...]` in the request) is the one accepted rewrite: the server
keeps in `token_ids` every id up to the one that completed the stop string, but cuts the text where
the stop string begins, and the client sends back that cut text. When the next call's prompt extends
the history only once the sampled ids are shortened to the longest prefix whose text lies inside the
kept text, the trained segment ends there (those ids, with their logprobs, were sampled exactly in
that context); the ids that spelled the stop string are dropped, and the kept text they left
uncovered is prompt from the next call's ids. Counted as `stop_trimmed`. Nothing else is trimmed: an
edit inside the kept text is still refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ..capture import CapturedCall, CapturedChoice

__all__ = ["CaptureRefused", "CapturedSequence", "captured_sequence", "captured_sequences"]

_SHOW = 60  # characters of context shown either side of a divergence


class CaptureRefused(ValueError):
    """The captured calls cannot be trained on exactly (as one sequence, where one was asked for); the
    message says why and where."""


@dataclass
class CapturedSequence:
    """Parallel lists (tokens.py makes them a TokenizedTrajectory); `realigned`: boundaries found by text."""

    input_ids: list[int]
    assistant_mask: list[bool]
    engine_logprobs: list[float]
    realigned: int
    stop_trimmed: int = 0  # replies whose ids after a stop string's start were dropped (module docstring)
    parted: str | None = None  # why this sequence starts anew at its first call (None: the trajectory's first)


def captured_sequence(tokenizer: Any, calls: list[CapturedCall]) -> CapturedSequence:
    """`calls` as one training sequence; CaptureRefused where a call parts the history (module docstring)."""
    first, *parts = captured_sequences(tokenizer, calls)
    if parts:
        raise CaptureRefused(parts[0].parted)
    return first


def captured_sequences(tokenizer: Any, calls: list[CapturedCall]) -> list[CapturedSequence]:
    """The training sequences for `calls`: one, and one more at each call that parts the history (see the
    module docstring); raises CaptureRefused."""
    _one_model(calls)
    done: list[CapturedSequence] = []
    ids: list[int] = []
    mask: list[bool] = []
    logprobs: list[float] = []
    realigned = trimmed = 0
    parted: str | None = None
    chosen: CapturedChoice | None = None  # the previous call's chosen sample, last in `ids`
    for k, call in enumerate(calls):
        prompt = call.prompt_token_ids
        start = 0
        if chosen is not None:  # k > 0
            try:
                start, by_text, drop = _joined(tokenizer, calls, k, chosen, ids)
            except _Parted as part:  # the calls from k on are a sequence of their own
                done.append(CapturedSequence(ids, mask, logprobs, realigned, trimmed, parted))
                ids, mask, logprobs, realigned, trimmed, parted = [], [], [], 0, 0, str(part)
                start, by_text, drop = 0, 0, 0
            if drop:
                del ids[len(ids) - drop:], mask[len(mask) - drop:], logprobs[len(logprobs) - drop:]
                trimmed += 1
            realigned += by_text
        ids += prompt[start:]
        mask += [False] * (len(prompt) - start)
        logprobs += [math.nan] * (len(prompt) - start)
        chosen = _chosen(tokenizer, calls, k, ids)
        ids += chosen.token_ids
        mask += [True] * len(chosen.token_ids)
        logprobs += chosen.logprobs if chosen.logprobs is not None else [math.nan] * len(chosen.token_ids)
    return [*done, CapturedSequence(ids, mask, logprobs, realigned, trimmed, parted)]


class _Parted(Exception):
    """Call k's prompt does not extend the history: its text says where and why."""


def _joined(tokenizer: Any, calls: list[CapturedCall], k: int, chosen: CapturedChoice,
            ids: list[int]) -> tuple[int, int, int]:
    """How call k's prompt continues `ids` (which end with call k-1's `chosen` sample): (where its new part
    starts, 1 if found by text, how many of the sample's last ids to drop: those after a stop string's
    start); _Parted when it does not continue them, even so."""
    sampled = chosen.token_ids
    parting = _Parting(calls, k, chosen, len(ids) - len(sampled))
    prompt = calls[k].prompt_token_ids
    try:
        return (*_continuation(tokenizer, ids, prompt, parting), 0)
    except _Parted:
        keep = _kept_before_stop(tokenizer, sampled, _stops(calls[k - 1]))
        if keep is None:
            raise
    drop = len(sampled) - keep
    try:
        return (*_continuation(tokenizer, ids[: len(ids) - drop], prompt, parting), drop)
    except _Parted as part:
        raise _Parted(f"{part}\n{_STOP_HINT.format(k=k - 1)}") from None


_STOP_HINT = ("Call {k} asked for stop strings and its reply was cut at one, yet the history does not extend even "
              "without the ids after the stop string's start: the client changed the kept text itself, or added to "
              "it (CodeAgent writes its stop string back after the code).")


def _stops(call: CapturedCall) -> list[str]:
    """The request's stop strings (OpenAI takes one string or a list)."""
    stop = call.request.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    return [s for s in stops if isinstance(s, str) and s]


def _kept_before_stop(tokenizer: Any, sampled: list[int], stops: list[str]) -> int | None:
    """How many of `sampled` lie inside the text the server kept when it cut the reply at the first stop
    string (as server/pipeline.py does, on text decoded without special tokens); None when no stop
    string occurs in it, so there is nothing the server cut."""
    text = tokenizer.decode(sampled, skip_special_tokens=True)
    found = [text.find(s) for s in stops if s in text]
    if not found:
        return None
    kept = text[: min(found)]
    # From the longest prefix down: a prefix ending inside a multi-byte character decodes to U+FFFD,
    # so "is a prefix of kept" is not monotone in the length.
    return next(n for n in range(len(sampled), -1, -1)
                if kept.startswith(tokenizer.decode(sampled[:n], skip_special_tokens=False)))


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
    following, stops = calls[k + 1].prompt_token_ids, _stops(calls[k])

    def continued(c: CapturedChoice) -> bool:
        if _extends(tokenizer, history + c.token_ids, following):
            return True
        keep = _kept_before_stop(tokenizer, c.token_ids, stops) if stops else None
        return keep is not None and _extends(tokenizer, history + c.token_ids[:keep], following)

    matches = [c for c in choices if continued(c)]
    exact = [c for c in matches if following[: len(history) + len(c.token_ids)] == history + c.token_ids]
    if len({tuple(c.token_ids) for c in exact}) == 1:  # continued by its very ids; identical samples are one
        matches = exact[:1]
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


@dataclass(frozen=True)
class _Parting:
    """What a refusal of call k needs to say why: the calls, and where call k-1's chosen reply starts."""

    calls: list[CapturedCall]
    k: int
    reply: CapturedChoice
    reply_start: int  # index in the history's ids


def _continuation(tokenizer: Any, history: list[int], prompt: list[int], parting: _Parting) -> tuple[int, int]:
    """(where in `prompt` the new part starts, 1 if found by text rather than by ids). By text only where
    the client sent the reply back as it got it: a reply it changed (text appended, say) parts the history
    even when the old text is still a prefix, since its ids then differ from what the model sampled."""
    if prompt[: len(history)] == history:
        return len(history), 0
    common = next((i for i, (a, b) in enumerate(zip(history, prompt)) if a != b), min(len(history), len(prompt)))
    old_text = tokenizer.decode(history, skip_special_tokens=False)
    new_text = tokenizer.decode(prompt, skip_special_tokens=False)
    if new_text.startswith(old_text) and not _sent_back_changed(parting):
        for n in range(common, len(prompt) + 1):
            covered = tokenizer.decode(prompt[:n], skip_special_tokens=False)
            if covered == old_text:
                return n, 1
            if len(covered) > len(old_text):
                break
    at = next((i for i, (a, b) in enumerate(zip(old_text, new_text)) if a != b), min(len(old_text), len(new_text)))
    in_reply = at >= len(tokenizer.decode(history[: parting.reply_start], skip_special_tokens=False))
    raise _Parted(_divergence(parting.k, old_text, new_text, at, _cause(parting, in_reply)))


def _divergence(k: int, old: str, new: str, at: int, cause: str | None) -> str:
    lo = max(0, at - _SHOW)
    return (f"captured call {k}'s prompt does not extend the history before it (call {k - 1}'s prompt + the "
            f"tokens it sampled), so no single sequence holds both exactly: a train step trains the calls from "
            f"call {k} on as a sequence of their own. They part at character {at}:\n"
            f"  history so far: {old[lo:at + _SHOW]!r}\n"
            f"  call {k}'s prompt:  {new[lo:at + _SHOW]!r}\n" + (cause or (
                "Usual cause: the agent edited, reordered or truncated its conversation, or changed its system prompt "
                "(art_nb's endpoint gives back a turn it sampled as the sampled ids only while the client sends that "
                "turn and everything before it unchanged); with ModelConfig(assistant_turns='rendered'), also a chat "
                "template that rewrites earlier turns (e.g. drops earlier <think> blocks).")))


def _cause(parting: _Parting, in_reply: bool) -> str | None:
    """The client's doing that the two requests show, in words; None when they show none."""
    k, before, now = parting.k, parting.calls[parting.k - 1].request, parting.calls[parting.k].request
    if not in_reply and _system_prompt(before) != _system_prompt(now):
        return (f"Cause: the agent swapped its system prompt: call {k} was sent under another system prompt than call "
                f"{k - 1} (now {_system_prompt(now)[:_SHOW]!r}), so its prompt cannot start with the history. "
                "smolagents' agents do this when they reach max_steps: `provide_final_answer` asks for the final "
                "answer under a system prompt of its own (make such a call inside `with art.no_capture():` to leave "
                "it out of the trajectory).")
    if in_reply and _sent_back_changed(parting):
        return (f"Cause: the agent sent call {k - 1}'s reply back changed: call {k}'s messages do not hold it as the "
                "endpoint returned it, so what the model saw next does not follow the reply it sampled. "
                "smolagents does this: CodeAgent appends its closing code tag to a reply without one, and "
                "ToolCallingAgent sends a tool call back as its own 'Calling tools:' text instead of the reply.")
    return None


def _sent_back_changed(parting: _Parting) -> bool:
    """Whether call k's chat messages lack call k-1's reply as the endpoint returned it (a Responses call,
    which may hold its history server-side, is not judged)."""
    messages = parting.calls[parting.k].request.get("messages")
    if not isinstance(messages, list):
        return False
    sent = [_canonical(m) for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
    return _canonical(parting.reply.message) not in sent


def _text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)


def _system_prompt(request: dict[str, Any]) -> str:
    """A chat request's leading system (or developer) message, or a Responses request's `instructions`."""
    messages = request.get("messages")
    if not isinstance(messages, list):
        return _text(request.get("instructions"))
    first = messages[0] if messages and isinstance(messages[0], dict) else {}
    return _text(first.get("content")) if first.get("role") in ("system", "developer") else ""


def _canonical(message: dict[str, Any]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """A reply as a client may send it back unchanged: content without surrounding whitespace, tool
    calls by name and parsed arguments (key order and spacing aside), as the endpoint matches turns."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = (call.get("function") or {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass
        calls.append((str(function.get("name")), json.dumps(arguments, sort_keys=True)))
    return _text(message.get("content")).strip(), tuple(calls)
