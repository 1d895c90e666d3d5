"""RULER's pure parts: what the judge is shown, and how its answers become scores in [0, 1].

No I/O here, so every rule is tested in milliseconds. Two ways to ask:

- **json** (ART's way, for capable judges): one request shows the shared start of the conversations
  once (`<context>`), then every trajectory's remainder numbered from 1, and asks for
  `{"scores": [{"trajectory_id", "explanation", "score"}]}`. `parse_scores` reads that even when it
  comes wrapped in a code fence or prose, and says what is wrong when it cannot.
- **rating** (for small local judges, which do not write reliable JSON): the same page, then one
  question per trajectory, "rate trajectory i from 0 to 10, the number only". The score is the
  expected rating: from the judge's top logprobs over the tokens "0".."10" where the endpoint gives
  them, else the mean of several sampled answers (`rating_from_texts`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from textwrap import dedent
from typing import Any

from pydantic import BaseModel, Field, ValidationError, field_validator

__all__ = [
    "DEFAULT_RUBRIC", "MAX_RATING", "TrajectoryScore", "cache_key", "common_prefix_len", "judge_messages",
    "parse_scores", "rating_from_texts", "rating_from_top_logprobs", "rating_messages",
]

DEFAULT_RUBRIC = dedent("""\
    - A trajectory that reaches its goal scores clearly above one that does not.
    - Between two that reach it, the one that gets there more directly (fewer wasted or wrong steps) scores higher.
    - Small differences in quality give small differences in score; large differences give large ones.
    - Progress towards the goal without reaching it earns partial credit.
""")
"""The rubric used when none is given. It names no task: the judge reads the goal from the
trajectories themselves (their system and user messages)."""

MAX_RATING = 10
_RATING = re.compile(r"(?<![\d.])(10|[0-9])(?![\d])")


class TrajectoryScore(BaseModel):
    """The judge's verdict on one trajectory (ART's `TrajectoryScore`); `score` is clamped to [0, 1]."""

    trajectory_id: str = Field(description="the trajectory's number in the judge's prompt, from 1")
    explanation: str = Field("", description="why, in a sentence")
    score: float = Field(description="from 0 (worst) to 1 (best)")

    @field_validator("trajectory_id", mode="before")
    @classmethod
    def _id_text(cls, value: Any) -> str:
        return str(value)

    @field_validator("score")
    @classmethod
    def _in_unit_range(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"score is {value}; a score is a number from 0 to 1")
        return min(1.0, max(0.0, value))


def common_prefix_len(message_lists: Sequence[Sequence[Mapping[str, Any]]]) -> int:
    """How many leading messages every trajectory shares (shown to the judge once, as context)."""
    if not message_lists:
        return 0
    for n, message in enumerate(message_lists[0]):
        if not all(len(ms) > n and ms[n] == message for ms in message_lists):
            return n
    return len(message_lists[0])


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def _page(message_lists: Sequence[Sequence[Mapping[str, Any]]], tools: Sequence[Mapping[str, Any]] | None
          ) -> tuple[str, int]:
    """The judge's reading: shared context, tools, numbered trajectories; and how many were shown
    (one when all are identical: the judge then scores that one and every copy gets its score)."""
    prefix = common_prefix_len(message_lists)
    identical = all(len(ms) == prefix for ms in message_lists)
    parts = []
    if tools:
        parts.append(f"<tools>\n{_dump(list(tools))}\n</tools>")
    if identical:
        shown = [list(message_lists[0])]
    else:
        if prefix:
            parts.append(f"<context>\n{_dump(list(message_lists[0][:prefix]))}\n</context>")
        shown = [list(ms[prefix:]) for ms in message_lists]
    body = "\n\n".join(f'<trajectory id="{i}">\n{_dump(ms)}\n</trajectory>' for i, ms in enumerate(shown, 1))
    parts.append("Trajectories:\n\n" + body)
    return "\n\n".join(parts), len(shown)


def _instructions(rubric: str) -> str:
    return ("Each trajectory below is an agent's attempt at the same goal. Work out the goal from them, "
            "then judge every attempt against the others.\n\nGrading standards:\n" + rubric.strip())


def judge_messages(message_lists: Sequence[Sequence[Mapping[str, Any]]], rubric: str,
                   tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[list[dict[str, str]], int]:
    """The json-mode request: (messages, how many trajectories the judge must score)."""
    page, shown = _page(message_lists, tools)
    system = (_instructions(rubric) + "\n\nAnswer with JSON only: "
              '{"scores": [{"trajectory_id": "1", "explanation": "<one sentence>", "score": <0 to 1>}, ...]}, '
              f"one entry for each of the {shown} trajectories.")
    return [{"role": "system", "content": system}, {"role": "user", "content": page}], shown


def rating_messages(message_lists: Sequence[Sequence[Mapping[str, Any]]], rubric: str, index: int,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[dict[str, str]]:
    """The rating-mode request for trajectory `index` (from 1): the whole page, then one question."""
    page, shown = _page(message_lists, tools)
    if not 1 <= index <= shown:
        raise ValueError(f"trajectory {index} is not on the page (1..{shown})")
    return [{"role": "system", "content": _instructions(rubric)}, *_RATING_EXAMPLE,
            {"role": "user", "content": f"{page}\n\n{_question(index)}"}]


def _question(index: int) -> str:
    return (f"Rate trajectory {index} from 0 (worst) to {MAX_RATING} (best) against the others. "
            "Reply with the number only.")


# Two worked turns before the real question: a small model copies their form (a bare number) far
# more often than it follows the instruction alone.
_EXAMPLE_PAGE = ('Trajectories:\n\n<trajectory id="1">\n[{"role": "user", "content": "Capital of France?"}, '
                 '{"role": "assistant", "content": "Paris."}]\n</trajectory>\n\n<trajectory id="2">\n'
                 '[{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Bananas."}]'
                 "\n</trajectory>")
_RATING_EXAMPLE = [
    {"role": "user", "content": f"{_EXAMPLE_PAGE}\n\n{_question(1)}"}, {"role": "assistant", "content": "9"},
    {"role": "user", "content": _question(2)}, {"role": "assistant", "content": "1"},
]


def _json_object(content: str) -> Any:
    """The JSON a judge meant: the whole reply, or the outermost {...} / [...] inside fences or prose."""
    text = content.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    for open_, close in (("{", "}"), ("[", "]")):
        start, end = text.find(open_), text.rfind(close)
        if 0 <= start < end:
            try:
                return json.loads(text[start:end + 1])
            except json.JSONDecodeError:
                continue
    raise ValueError(f"the judge's reply is not JSON: {content[:200]!r}")


def parse_scores(content: str | None, expected: int) -> list[TrajectoryScore]:
    """The judge's json-mode reply as `expected` scores, in trajectory order.

    Accepts {"scores": [...]} or a bare list; entries are put in order by `trajectory_id` when the
    ids are exactly 1..expected, else taken in the order given. Raises ValueError naming the problem
    (not JSON, wrong count, a missing or non-numeric score).
    """
    data = _json_object(content or "")
    items = data.get("scores") if isinstance(data, dict) else data
    if not isinstance(items, list):
        # A malformed reply is bad data, not a caller's wrong type: ValueError, like every other parse failure.
        raise ValueError(f'the judge\'s JSON has no "scores" list: {str(content)[:200]!r}')  # noqa: TRY004
    if len(items) != expected:
        raise ValueError(f"expected {expected} scores from the judge, got {len(items)}")
    try:
        scores = [TrajectoryScore.model_validate({"trajectory_id": n, **item} if isinstance(item, dict) else item)
                  for n, item in enumerate(items, 1)]
    except ValidationError as error:
        raise ValueError(f"the judge's scores are malformed: {error.errors()[0]['msg']} in "
                         f"{str(content)[:200]!r}") from None
    by_id = {s.trajectory_id.strip(): s for s in scores}
    ids = [str(n) for n in range(1, expected + 1)]
    if sorted(by_id) == sorted(ids):
        return [by_id[i].model_copy(update={"trajectory_id": i}) for i in ids]
    return [s.model_copy(update={"trajectory_id": str(n)}) for n, s in enumerate(scores, 1)]


def rating_from_texts(texts: Sequence[str | None]) -> tuple[float, int] | None:
    """(mean rating / MAX_RATING, how many replies held a rating) over sampled replies; None when
    none did. A reply's rating is its first whole number from 0 to MAX_RATING."""
    ratings = []
    for text in texts:
        match = _RATING.search(text or "")
        if match:
            ratings.append(int(match.group(1)))
    if not ratings:
        return None
    return sum(ratings) / len(ratings) / MAX_RATING, len(ratings)


def rating_from_top_logprobs(top: Sequence[Mapping[str, Any]]) -> float | None:
    """The expected rating / MAX_RATING under the judge's first-token distribution, renormalised over
    the candidate tokens "0".."10" found in `top` (OpenAI's [{"token", "logprob"}, ...]); None when
    no candidate is there."""
    weights: dict[int, float] = {}
    for entry in top:
        token = str(entry.get("token", "")).strip()
        if token.isdigit() and int(token) <= MAX_RATING and str(int(token)) == token:
            weights[int(token)] = weights.get(int(token), 0.0) + math.exp(float(entry["logprob"]))
    total = sum(weights.values())
    if total <= 0:
        return None
    return sum(r * w for r, w in weights.items()) / total / MAX_RATING


def cache_key(judge: str, method: str, rubric: str, message_lists: Sequence[Sequence[Mapping[str, Any]]],
              tools: Sequence[Mapping[str, Any]] | None, params: Mapping[str, Any]) -> str:
    """A content hash of everything that decides the verdict: the judge, how it is asked, the rubric,
    the conversations, the tools and the request parameters."""
    blob = json.dumps({"v": 1, "judge": judge, "method": method, "rubric": rubric,
                       "messages": message_lists, "tools": tools, "params": params},
                      sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
