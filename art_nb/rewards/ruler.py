"""RULER (ART's `art.rewards.ruler`): an LLM judge scores a group's trajectories against each other.

GRPO only needs rewards that rank a group's trajectories, and ranking attempts side by side is
easier for a judge than scoring one alone, so RULER shows the judge the whole group and takes its
scores in [0, 1] as rewards. `ruler_score_group` is what a training loop calls (usually as
`gather_trajectory_groups(after_each=...)`): it returns a new group whose rewards are the judge's,
the old reward kept in `metrics["independent_reward"]` and the judge's in `metrics["ruler_score"]`,
as ART does.

art_nb's additions, all keyword-only and optional: the judge may be an art_nb `Model` (offline,
no key); `method` picks json (capable judges) or rating (small local ones, see ruler_prompt);
verdicts are cached on disk by content (`cache`, `cache_dir`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from ..model import Model
from ..trajectories import Trajectory, TrajectoryGroup
from . import ruler_cache
from .ruler_judge import Judge, resolve_judge
from .ruler_prompt import (
    DEFAULT_RUBRIC,
    MAX_RATING,
    TrajectoryScore,
    cache_key,
    judge_messages,
    parse_scores,
    rating_from_texts,
    rating_from_top_logprobs,
    rating_messages,
)

__all__ = ["DEFAULT_RUBRIC", "TrajectoryScore", "ruler", "ruler_score_group"]

Method = Literal["auto", "json", "rating"]

# What the judge is asked for in each mode (part of the cache key).
_RATING_MAX_TOKENS = 4
_TOP_LOGPROBS = 20  # OpenAI's maximum


def _json_schema() -> dict[str, Any]:
    item = {"type": "object", "properties": {"trajectory_id": {"type": "string"}, "explanation": {"type": "string"},
                                             "score": {"type": "number"}},
            "required": ["trajectory_id", "explanation", "score"]}
    return {"type": "json_schema", "json_schema": {"name": "ruler_scores", "schema": {
        "type": "object", "properties": {"scores": {"type": "array", "items": item}}, "required": ["scores"]}}}


def _request_params(judge: Judge, method: str, rating_samples: int) -> dict[str, Any]:
    if method == "json":  # held to the schema: by a hosted judge's server, by art_nb's (constrained decoding)
        return {"response_format": _json_schema()}
    if judge.local:  # top logprobs where the server returns them (art_nb's does), else the sampled ratings' mean
        return {"n": rating_samples, "temperature": 1.0, "max_tokens": _RATING_MAX_TOKENS, "logprobs": True,
                "top_logprobs": _TOP_LOGPROBS}
    return {"n": 1, "temperature": 0.0, "max_tokens": _RATING_MAX_TOKENS, "logprobs": True,
            "top_logprobs": _TOP_LOGPROBS}


def _texts(response: Mapping[str, Any]) -> list[str | None]:
    return [(c.get("message") or {}).get("content") for c in response.get("choices") or []]


def _first_top_logprobs(response: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    choices = response.get("choices") or []
    content = ((choices[0].get("logprobs") or {}).get("content") or []) if choices else []
    return list(content[0].get("top_logprobs") or []) if content else []


async def _judge_json(judge: Judge, message_lists: Sequence[Sequence[Mapping[str, Any]]], rubric: str,
                      tools: Sequence[Mapping[str, Any]] | None, params: dict[str, Any], debug: bool
                      ) -> list[TrajectoryScore]:
    messages, shown = judge_messages(message_lists, rubric, tools)
    response = await judge.complete(messages, params)
    texts = _texts(response)
    if not texts:
        raise ValueError(f"the judge {judge.label} returned no choices")
    if debug:
        print(f"[RULER] {judge.label} replied:\n{texts[0]}")
    return parse_scores(texts[0], shown)


async def _rate_one(judge: Judge, messages: list[dict[str, str]], index: int, params: dict[str, Any],
                    debug: bool) -> TrajectoryScore:
    response = await judge.complete(messages, params)
    texts = _texts(response)
    if debug:
        print(f"[RULER] {judge.label} on trajectory {index}: {texts}")
    expected = rating_from_top_logprobs(_first_top_logprobs(response))
    if expected is not None:
        how = "expected rating over the judge's top logprobs"
    else:
        sampled = rating_from_texts(texts)
        if sampled is None:
            raise ValueError(f"the judge {judge.label} gave no rating from 0 to {MAX_RATING} for trajectory "
                             f"{index}: {[t[:80] if t else t for t in texts]}")
        expected, count = sampled
        how = f"mean of {count} of {len(texts)} sampled ratings"
    return TrajectoryScore(trajectory_id=str(index), score=expected,
                           explanation=f"rated {expected * MAX_RATING:.1f}/{MAX_RATING} ({how})")


async def _judge_ratings(judge: Judge, message_lists: Sequence[Sequence[Mapping[str, Any]]], rubric: str,
                         tools: Sequence[Mapping[str, Any]] | None, params: dict[str, Any], debug: bool
                         ) -> list[TrajectoryScore]:
    _, shown = judge_messages(message_lists, rubric, tools)
    return list(await asyncio.gather(*(
        _rate_one(judge, rating_messages(message_lists, rubric, i, tools), i, params, debug)
        for i in range(1, shown + 1))))


async def ruler(
    message_lists: list[list[dict[str, Any]]],
    judge_model: str | Model = "openai/o3",
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str | None = DEFAULT_RUBRIC,
    tools: list[dict[str, Any]] | None = None,
    *,
    debug: bool = False,
    method: Method = "auto",
    rating_samples: int = 8,
    cache: bool = True,
    cache_dir: str | Path | None = None,
) -> list[TrajectoryScore]:
    """Score each conversation in `message_lists` from 0 to 1, relative to the others (ART's `ruler`).

    `judge_model`: a model name (litellm, or an OpenAI-compatible endpoint: see ruler_judge) or an
    art_nb `Model` (a TrainableModel judges with its base weights). `extra_litellm_params` go into
    the judge's request (`base_url`/`api_key` configure the endpoint instead). `rubric=None` is
    DEFAULT_RUBRIC. `tools`: the tools the agent had, shown to the judge.

    `method`: "json" asks for all scores at once as JSON (ART's prompt); "rating" asks for one rating
    per trajectory, read from top logprobs or the mean of `rating_samples` sampled replies; "auto"
    is rating for an art_nb Model, json otherwise. `cache`: a verdict found under `cache_dir`
    (default `ruler_cache.default_cache_dir()`) for the same judge, rubric, conversations and
    request is returned without asking the judge. Raises ValueError when the judge's reply cannot
    be read as scores.
    """
    if not message_lists:
        return []
    if method not in ("auto", "json", "rating"):
        raise ValueError(f'method is {method!r}; use "auto", "json" or "rating"')
    if rating_samples < 1:
        raise ValueError(f"rating_samples is {rating_samples}; sample at least one rating")
    rubric = DEFAULT_RUBRIC if rubric is None else rubric
    judge = resolve_judge(judge_model, extra_litellm_params)
    mode = ("rating" if judge.local else "json") if method == "auto" else method
    params = _request_params(judge, mode, rating_samples)
    directory = Path(cache_dir) if cache_dir is not None else ruler_cache.default_cache_dir()
    key = cache_key(judge.label, mode, rubric, message_lists, tools,
                    {**params, **{k: v for k, v in (extra_litellm_params or {}).items() if k != "api_key"}})
    scores = ruler_cache.load(directory, key) if cache else None
    if scores is not None:
        if debug:
            print(f"[RULER] cached verdict of {judge.label}: {[s.score for s in scores]}")
    else:
        ask = _judge_ratings if mode == "rating" else _judge_json
        scores = await ask(judge, message_lists, rubric, tools, params, debug)
        if cache:
            ruler_cache.save(directory, key, judge.label, scores)
    if len(scores) == 1 and len(message_lists) > 1:  # all identical: one verdict for every copy
        return [scores[0].model_copy(update={"trajectory_id": str(i)}) for i in range(1, len(message_lists) + 1)]
    return scores


def _copy(trajectory: Trajectory) -> Trajectory:
    """A copy whose rewards, metrics and logs can change without touching the caller's trajectory."""
    return trajectory.model_copy(update={
        "messages_and_choices": list(trajectory.messages_and_choices), "metrics": dict(trajectory.metrics),
        "metadata": dict(trajectory.metadata), "logs": list(trajectory.logs),
        "additional_histories": [h.model_copy(deep=True) for h in trajectory.additional_histories]})


async def ruler_score_group(
    group: TrajectoryGroup,
    judge_model: str | Model = "openai/o3",
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str | None = DEFAULT_RUBRIC,
    *,
    swallow_exceptions: bool = False,
    debug: bool = False,
    **options: Any,
) -> TrajectoryGroup | None:
    """A new group whose rewards are RULER's scores (ART's `ruler_score_group`).

    Each trajectory keeps its old reward in `metrics["independent_reward"]`, gets the judge's score
    in `metrics["ruler_score"]` and as `reward`, and the judge's explanation in its logs; the group's
    exceptions, metadata, metrics and logs carry over; `group` itself is not changed. The tools the
    trajectories had (when they agree) are shown to the judge. `swallow_exceptions=True` returns
    None when judging fails (the group is then dropped from training, as in ART); `options` are
    `ruler`'s keyword-only arguments (method, rating_samples, cache, cache_dir).
    """
    unknown = set(options) - {"method", "rating_samples", "cache", "cache_dir"}
    if unknown:
        raise TypeError(f"ruler_score_group got unexpected arguments {sorted(unknown)}")
    if any(t.additional_histories for t in group.trajectories):
        raise ValueError("RULER scores one conversation per trajectory; additional_histories are not supported")
    trajectories = [_copy(t) for t in group.trajectories]
    tool_sets = [t.conversation_tools() for t in trajectories]  # captured calls carry theirs
    tools = tool_sets[0] if tool_sets and all(ts == tool_sets[0] for ts in tool_sets) else None
    try:
        scores = await ruler([t.messages() for t in trajectories], judge_model, extra_litellm_params, rubric,
                             tools, debug=debug, **options)
    except Exception as error:  # not BaseException: an interrupt still stops the cell
        if swallow_exceptions:
            print(f"[RULER] group not scored, dropped: {type(error).__name__}: {error}")
            return None
        raise
    for trajectory, score in zip(trajectories, scores, strict=True):
        trajectory.metrics["independent_reward"] = trajectory.reward
        trajectory.metrics["ruler_score"] = score.score
        trajectory.reward = score.score
        trajectory.log(f"RULER explanation: {score.explanation}")
    return TrajectoryGroup(trajectories, exceptions=list(group.exceptions), metadata=dict(group.metadata),
                           metrics=dict(group.metrics), logs=list(group.logs))
