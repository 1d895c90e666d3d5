"""One chat completion, from a validated request to the response body: the prompt (`turns`: earlier
turns this endpoint sampled as the ids it sampled, the rest rendered by the model's chat template,
`prompt`), derive sampling parameters, generate, cut each sample at its stop string,
parse tool calls, and answer in the ChatCompletion format plus what training needs:

- every choice carries `token_ids`, the completion ids exactly as sampled (EOS included when the
  engine sampled it), and the response carries `prompt_token_ids`;
- `logprobs.content[*].logprob` are the engine's temperature-1 logprobs of those ids;
- every choice also carries `token_logprobs`, those logprobs as a plain list, whether or not the
  request asked for `logprobs`: capture (`art_nb.capture`) records calls made by code that never
  asks, and training needs them.

Stop strings are applied here, on the decoded text: the content is cut *before* the first stop
string, but `token_ids` keep everything sampled up to and including the token that completed it,
because the trainer trains on ids, not on text, and those ids are what the policy produced.
"""

from __future__ import annotations

import itertools
import secrets
import time
import weakref
from typing import Any

from art_nb.web import ApiError

from ..engines.base import (
    ContextTooLongError,
    Engine,
    EngineDeadError,
    EngineError,
    GenerationRequest,
    Sample,
    SamplingParams,
)
from .constrain import grammar_for
from .schema import ChatCompletionRequest
from .toolcalls import parse_tool_calls
from .turns import remember, render_prompt

__all__ = ["completion", "generate", "render_prompt", "sampling_params"]

_MIN_LOGPROB = -9999.0
# Response ids: a random part per process and a counter; uuid4 per request read os.urandom each time
# (a system call that hands the GIL over, with the engine's thread waiting for it).
_ID_PREFIX = f"chatcmpl-{secrets.token_hex(8)}"
_ID_COUNTER = itertools.count()


def sampling_params(req: ChatCompletionRequest, prompt_len: int, max_context: int, tokenizer: Any = None
                    ) -> SamplingParams:
    room = max_context - prompt_len
    max_tokens = req.max_completion_tokens or req.max_tokens or max(room, 1)  # default: fill the context
    if max_tokens > room:
        raise ApiError(
            400,
            f"the model's context holds {max_context} tokens, but the prompt has {prompt_len} and "
            f"{max_tokens} more were requested; shorten the messages or lower max_tokens",
            "context_length_exceeded",
            param="messages",
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,  # 0 means greedy
        top_p=1.0 if req.top_p is None else req.top_p,
        n=req.n,
        stop=tuple(req.stop or ()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        top_logprobs=req.top_logprobs or 0,
        grammar=grammar_for(req, tokenizer),  # JSON response formats and forced tool calls (constrain.py)
    )


async def generate(engine: Engine, adapter: str | None, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
    """The engine's samples; its failures as the HTTP errors a client can act on."""
    try:
        return await engine.generate(GenerationRequest(prompt_ids, params, adapter=adapter))
    except ContextTooLongError as exc:
        raise ApiError(400, str(exc), "context_length_exceeded", param="messages") from exc
    except EngineDeadError as exc:
        raise ApiError(503, str(exc), "engine_dead", retry=False) from exc
    except EngineError as exc:
        raise ApiError(500, str(exc), "engine_error") from exc


def completion(
    model_name: str, prompt_ids: list[int], samples: list[Sample], req: ChatCompletionRequest, tokenizer: Any
) -> dict[str, Any]:
    """The ChatCompletion body for `samples`, with `token_ids` per choice and `prompt_token_ids`."""
    choices = [_choice(i, sample, req, tokenizer) for i, sample in enumerate(samples)]
    remember(tokenizer, req, prompt_ids, choices)  # the next turn starts from these ids (turns.py)
    completion_tokens = sum(len(c["token_ids"]) for c in choices)
    return {
        "id": f"{_ID_PREFIX}{next(_ID_COUNTER):016x}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        },
        "prompt_token_ids": prompt_ids,
    }


def _cut_at_stop(tokenizer: Any, sample: Sample, stops: list[str]) -> tuple[str, list[int], list[float], bool]:
    """(content, token_ids, logprobs, stopped) after the first stop string completes.

    The ids kept are the shortest prefix whose text contains a stop string (found by bisection:
    containing a stop string is monotone in the prefix length); the content is that text cut
    where the earliest stop string in it begins.
    """
    ids, logprobs = sample.token_ids, sample.logprobs
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not any(stop in text for stop in stops):
        return text, ids, logprobs, False
    lo, hi = 0, len(ids)  # invariant: decode(ids[:hi]) contains a stop string; decode(ids[:lo]) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if any(stop in tokenizer.decode(ids[:mid], skip_special_tokens=True) for stop in stops):
            hi = mid
        else:
            lo = mid
    text = tokenizer.decode(ids[:hi], skip_special_tokens=True)
    cut = min(text.find(stop) for stop in stops if stop in text)
    return text[:cut], ids[:hi], logprobs[:hi], True


def _choice(index: int, sample: Sample, req: ChatCompletionRequest, tokenizer: Any) -> dict[str, Any]:
    content, ids, logprobs, stopped = _cut_at_stop(tokenizer, sample, req.stop or [])
    finish_reason = "stop" if stopped else sample.finish_reason
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if req.parses_tool_calls:  # not offered_tools(): that copies every tool, and this runs per choice
        content, calls = parse_tool_calls(content)
        if calls:
            message = {"role": "assistant", "content": content or None, "tool_calls": calls}
            if finish_reason == "stop":
                finish_reason = "tool_calls"
    choice: dict[str, Any] = {
        "index": index,
        "message": message,
        "finish_reason": finish_reason,
        "logprobs": None,
        "token_ids": ids,
        "token_logprobs": _clamped(logprobs),
    }
    if req.logprobs:
        texts = _token_texts(tokenizer)
        entries = []
        for token_id, logprob in zip(ids, logprobs, strict=True):
            text = texts.get(token_id) or _token_text(texts, tokenizer, token_id)
            entries.append({
                "token": text[0],
                "logprob": max(logprob, _MIN_LOGPROB),  # JSON has no -inf
                "bytes": text[1],
                "top_logprobs": [],
            })
        if sample.top_logprobs:  # as long as the sample: zip stops at the ids kept after a stop string
            for entry, top in zip(entries, sample.top_logprobs, strict=False):
                entry["top_logprobs"] = [_alternative(texts, tokenizer, t, lp) for t, lp in top]
        choice["logprobs"] = {"content": entries, "refusal": None}
    return choice


def _alternative(texts: dict[int, tuple[str, list[int]]], tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = texts.get(token_id) or _token_text(texts, tokenizer, token_id)
    return {"token": text[0], "logprob": max(logprob, _MIN_LOGPROB), "bytes": text[1]}


def _token_text(texts: dict[int, tuple[str, list[int]]], tokenizer: Any, token_id: int) -> tuple[str, list[int]]:
    """A token's text and UTF-8 bytes, decoded and kept for the next response (`_token_texts`)."""
    token = tokenizer.decode([token_id])  # a token holding part of a UTF-8 character decodes to U+FFFD
    text = texts[token_id] = (token, list(token.encode()))
    return text


def _clamped(logprobs: list[float]) -> list[float]:
    """`logprobs` with -inf (and anything below) raised to -9999: JSON has no -inf. The list itself
    when nothing needs it (the usual case; `min` is one C loop, a comprehension 128 Python calls)."""
    if not logprobs or min(logprobs) >= _MIN_LOGPROB:
        return logprobs
    return [max(lp, _MIN_LOGPROB) for lp in logprobs]


_TOKEN_TEXTS: weakref.WeakKeyDictionary[Any, dict[int, tuple[str, list[int]]]] = weakref.WeakKeyDictionary()


def _token_texts(tokenizer: Any) -> dict[int, tuple[str, list[int]]]:
    """Per-token text and bytes, decoded once per tokenizer: one `decode` call per token of every
    response was most of the server's time per request (all of it on the event loop, beside vLLM)."""
    texts = _TOKEN_TEXTS.get(tokenizer)
    if texts is None:
        texts = _TOKEN_TEXTS[tokenizer] = {}
    return texts
