"""POST /v1/completions, OpenAI's legacy text completions: a raw prompt continued, no chat template.

The prompt is text (tokenised as vLLM does, with the tokenizer's own special tokens such as a BOS
added, and control-token text in it taken as control tokens: the client writes the whole prompt)
or token ids, given as they are. One prompt per request: each request is one sequence training
can take (`art.trajectory` records it like a chat call); send several requests for several
prompts, they share the engine's batch anyway. `n` samples of it are choices, as in chat.

What comes back is OpenAI's `text_completion` with what training needs beside it, as on the chat
endpoint: `prompt_token_ids` on the response, `token_ids` and `token_logprobs` on each choice.
`logprobs: k` gives the legacy logprobs object (`tokens`, `token_logprobs`, `top_logprobs` with k
alternatives, `text_offset`) of the sampled tokens. `echo` puts the prompt in front of each choice's
text (as sent, or its ids decoded); with `logprobs` it would need the prompt's logprobs, which the engines do not
compute, so that pair is refused, as are `suffix`, `best_of` other than `n`, penalties and a bias.
A stop string cuts the text before it, keeping the ids that spelled it, as chat does.

`stream=True` sends the finished completion as `text_completion` chunks (`prompt_token_ids` on the
first), then `data: [DONE]`.
"""

from __future__ import annotations

import itertools
import secrets
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from art_nb.web import ApiError

from ..engines.base import Sample, SamplingParams
from .pipeline import _cut_at_stop
from .schema import MAX_STOP, MAX_STOP_CHARS

__all__ = ["CompletionRequest", "completion_body", "completion_chunks", "completion_params", "prompt_ids"]

_MIN_LOGPROB = -9999.0  # JSON has no -inf (as pipeline.py)
_ID_PREFIX = f"cmpl-{secrets.token_hex(8)}"
_ID_COUNTER = itertools.count()
_MAX_PROMPT_IDS = 1 << 20


class CompletionRequest(BaseModel):
    """The body of POST /v1/completions; unknown fields are ignored, as for chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(max_length=512)
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for this endpoint
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=256)
    stop: str | list[str] | None = Field(None, description=f"at most {MAX_STOP} strings of {MAX_STOP_CHARS} characters")
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    suffix: str | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request (got {len(prompt)}): each request is one sequence to "
                                 "train on; send one request per prompt, they are batched together anyway")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        if isinstance(prompt, list) and (len(prompt) > _MAX_PROMPT_IDS or not all(0 <= i < 2**31 for i in prompt)):
            raise ValueError(f"token ids are integers from 0 to 2**31 - 1, at most {_MAX_PROMPT_IDS:,} of them")
        return prompt

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"at most {MAX_STOP} non-empty stop strings of at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("not served: the engines only continue a prompt; put the text after the gap in the prompt")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("penalties are not supported: they would skew the logprobs training uses")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value and any(value.values()):
            raise ValueError("not supported: a bias would skew the logprobs training uses")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value not in (None, 1, info.data.get("n")):
            raise ValueError("only best_of == n is served (ranking samples by logprob server-side would hide the "
                             "others from training); sample n and pick in the rollout")
        return value

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs needs the prompt's logprobs, which the engines do not compute; "
                             "ask for one of them")
        return self


def prompt_ids(tokenizer: Any, req: CompletionRequest) -> list[int]:
    """The prompt's ids: token ids as given (checked against the vocabulary), or the text tokenised."""
    if isinstance(req.prompt, str):
        return list(tokenizer(req.prompt, add_special_tokens=True)["input_ids"])
    vocab = len(tokenizer)
    if any(i >= vocab for i in req.prompt):
        raise ApiError(400, f"prompt: a token id is outside the vocabulary (0 to {vocab - 1})", param="prompt")
    return list(req.prompt)


def completion_params(req: CompletionRequest, prompt_len: int, max_context: int) -> SamplingParams:
    max_tokens = req.max_tokens or 16
    if prompt_len + max_tokens > max_context:
        raise ApiError(400, f"the model's context holds {max_context} tokens, but the prompt has {prompt_len} and "
                       f"{max_tokens} more were requested; shorten the prompt or lower max_tokens",
                       "context_length_exceeded", param="prompt")
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, n=req.n, stop=tuple(req.stop or ()), seed=req.seed,
        top_logprobs=req.logprobs or 0,
    )


def completion_body(model_name: str, prompt: list[int], samples: list[Sample], req: CompletionRequest,
                    tokenizer: Any) -> dict[str, Any]:
    """The `text_completion` body for `samples`, with `token_ids` per choice and `prompt_token_ids`."""
    echo = "" if not req.echo else req.prompt if isinstance(req.prompt, str) else tokenizer.decode(req.prompt)
    choices = []
    for index, sample in enumerate(samples):
        text, ids, logprobs, stopped = _cut_at_stop(tokenizer, sample, req.stop or [])
        choices.append({
            "index": index, "text": echo + text, "finish_reason": "stop" if stopped else sample.finish_reason,
            "logprobs": _legacy_logprobs(tokenizer, ids, logprobs, sample) if req.logprobs is not None else None,
            "token_ids": ids, "token_logprobs": [max(lp, _MIN_LOGPROB) for lp in logprobs],
        })
    completion_tokens = sum(len(c["token_ids"]) for c in choices)
    return {
        "id": f"{_ID_PREFIX}{next(_ID_COUNTER):016x}", "object": "text_completion", "created": int(time.time()),
        "model": model_name, "choices": choices,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                  "total_tokens": len(prompt) + completion_tokens},
        "prompt_token_ids": prompt,
    }


def _legacy_logprobs(tokenizer: Any, ids: list[int], logprobs: list[float], sample: Sample) -> dict[str, Any]:
    """OpenAI's legacy logprobs object; `top_logprobs` maps each alternative's text to its logprob."""
    texts = {i: tokenizer.decode([i]) for i in {*ids, *(t for top in sample.top_logprobs or () for t, _ in top)}}
    tokens = [texts[i] for i in ids]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else []
    top = None
    if sample.top_logprobs:  # as long as the sample: zip stops at the ids kept after a stop string
        top = [{texts[t]: max(lp, _MIN_LOGPROB) for t, lp in alternatives}
               for alternatives, _ in zip(sample.top_logprobs, ids, strict=False)]
    return {"tokens": tokens, "token_logprobs": [max(lp, _MIN_LOGPROB) for lp in logprobs], "top_logprobs": top,
            "text_offset": offsets}


def completion_chunks(body: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """The chunks that stream `body`: per choice its text (with ids and logprobs), then its finish."""
    base = {"id": body["id"], "object": "text_completion", "created": body["created"], "model": body["model"]}
    chunks: list[dict[str, Any]] = []
    for choice in body["choices"]:
        chunks.append({**base, "choices": [{**choice, "finish_reason": None}]})
        chunks.append({**base, "choices": [{"index": choice["index"], "text": "", "logprobs": None,
                                            "finish_reason": choice["finish_reason"]}]})
    chunks[0]["prompt_token_ids"] = body["prompt_token_ids"]
    if include_usage:
        chunks.append({**base, "choices": [], "usage": body["usage"]})
    return chunks
