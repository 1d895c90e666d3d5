"""RULER's prompt, parsing, caching and error handling, with a fake judge (no model, no network)."""

from __future__ import annotations

import importlib
import json
import math

import pytest

import art_nb as art
from art_nb.rewards import ruler_score_group
from art_nb.rewards.ruler_judge import Judge, resolve_judge
from art_nb.rewards.ruler_prompt import (
    DEFAULT_RUBRIC,
    common_prefix_len,
    judge_messages,
    parse_scores,
    rating_from_texts,
    rating_from_top_logprobs,
    rating_messages,
)

ruler_mod = importlib.import_module("art_nb.rewards.ruler")  # the package exports the function `ruler`

SYSTEM = {"role": "system", "content": "You count with digits."}
USER = {"role": "user", "content": "Count to 3."}


def convo(answer: str) -> list[dict]:
    return [SYSTEM, USER, {"role": "assistant", "content": answer}]


def group(*answers: str) -> art.TrajectoryGroup:
    return art.TrajectoryGroup([art.Trajectory(messages_and_choices=convo(a), reward=float(i), metrics={"k": i})
                                for i, a in enumerate(answers)], exceptions=[RuntimeError("lost")])


class FakeJudge:
    """Records each request; answers with `reply(messages, params)` (a content string or a list of them)."""

    def __init__(self, reply, local: bool = False) -> None:
        self.reply, self.local, self.requests = reply, local, []

    def judge(self) -> Judge:
        async def create(messages, params):
            self.requests.append((messages, params))
            contents = self.reply(messages, params)
            contents = contents if isinstance(contents, list) else [contents]
            return {"choices": [{"index": i, "message": {"role": "assistant", "content": c}}
                                for i, c in enumerate(contents)]}
        return Judge(label="fake:judge", local=self.local, create=create)


@pytest.fixture
def fake(monkeypatch):
    def install(reply, local: bool = False) -> FakeJudge:
        fake = FakeJudge(reply, local)
        monkeypatch.setattr(ruler_mod, "resolve_judge", lambda judge_model, extra=None: fake.judge())
        return fake
    return install


def scores_json(*scores: float) -> str:
    return json.dumps({"scores": [{"trajectory_id": str(i), "explanation": f"e{i}", "score": s}
                                  for i, s in enumerate(scores, 1)]})


# ---- prompt ----------------------------------------------------------------------------------------

def test_common_prefix_is_shown_once_and_trajectories_are_numbered():
    lists = [convo("1, 2, 3"), convo("one, two")]
    assert common_prefix_len(lists) == 2
    messages, shown = judge_messages(lists, DEFAULT_RUBRIC, tools=[{"type": "function", "function": {"name": "f"}}])
    assert shown == 2 and [m["role"] for m in messages] == ["system", "user"]
    page = messages[1]["content"]
    assert page.count("Count to 3.") == 1 and page.index("<context>") < page.index('<trajectory id="1">')
    assert '<trajectory id="2">' in page and "one, two" in page and '"name": "f"' in page
    assert DEFAULT_RUBRIC.strip() in messages[0]["content"] and "JSON" in messages[0]["content"]


def test_identical_trajectories_are_shown_whole_once():
    messages, shown = judge_messages([convo("1"), convo("1"), convo("1")], "be good")
    assert shown == 1 and "<context>" not in messages[1]["content"] and "Count to 3." in messages[1]["content"]
    assert common_prefix_len([convo("1"), convo("1")[:2]]) == 2


def test_rating_question_names_one_trajectory():
    messages = rating_messages([convo("1"), convo("2")], "rubric", 2)
    assert messages[-1]["content"].rstrip().endswith("Reply with the number only.")
    assert "Rate trajectory 2 from 0" in messages[-1]["content"] and "Count to 3." in messages[-1]["content"]
    # worked turns first: a small judge copies their bare-number answers
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[2]["content"].isdigit() and messages[4]["content"].isdigit()
    with pytest.raises(ValueError, match="not on the page"):
        rating_messages([convo("1"), convo("2")], "rubric", 3)


# ---- parsing -----------------------------------------------------------------------------------------

def test_parse_scores_reads_fenced_reordered_and_bare_replies():
    fenced = "Sure! Here you go:\n```json\n" + scores_json(0.2, 0.9) + "\n```"
    assert [s.score for s in parse_scores(fenced, 2)] == [0.2, 0.9]
    reordered = json.dumps({"scores": [{"trajectory_id": 2, "score": "0.7"}, {"trajectory_id": "1", "score": 0.1}]})
    parsed = parse_scores(reordered, 2)
    assert [(s.trajectory_id, s.score, s.explanation) for s in parsed] == [("1", 0.1, ""), ("2", 0.7, "")]
    assert [s.score for s in parse_scores('[{"score": 1.5}, {"score": -2}]', 2)] == [1.0, 0.0]  # clamped


@pytest.mark.parametrize("reply, problem", [
    ("I think the first one is better.", "not JSON"),
    ('{"ranking": [1, 2]}', "no \"scores\" list"),
    (scores_json(0.5), "expected 2 scores"),
    ('{"scores": [{"score": "high"}, {"score": 0.1}]}', "malformed"),
    ('{"scores": [{"score": NaN}, {"score": 0.1}]}', "malformed"),
    (None, "not JSON"),
])
def test_parse_scores_says_what_is_wrong(reply, problem):
    with pytest.raises(ValueError, match=problem):
        parse_scores(reply, 2)


def test_ratings_from_sampled_replies_and_from_top_logprobs():
    assert rating_from_texts(["7", " 8/10 because", "Trajectory", None, "12"]) == (0.75, 2)
    assert rating_from_texts(["10"]) == (1.0, 1) and rating_from_texts(["none", ""]) is None
    top = [{"token": "9", "logprob": math.log(0.3)}, {"token": " 1", "logprob": math.log(0.3)},
           {"token": "The", "logprob": math.log(0.4)}, {"token": "07", "logprob": 0.0}]
    assert rating_from_top_logprobs(top) == pytest.approx(0.5)
    assert rating_from_top_logprobs([{"token": "x", "logprob": 0.0}]) is None


# ---- scoring a group -------------------------------------------------------------------------------

async def test_scores_replace_rewards_and_the_original_group_is_kept(fake, tmp_path):
    judge = fake(lambda m, p: scores_json(0.9, 0.1))
    original = group("1, 2, 3", "one two three")
    scored = await ruler_score_group(original, "openai/o3", cache_dir=tmp_path)
    assert [t.reward for t in scored] == [0.9, 0.1]
    assert [t.metrics["independent_reward"] for t in scored] == [0.0, 1.0]
    assert [t.metrics["ruler_score"] for t in scored] == [0.9, 0.1] and scored.trajectories[0].metrics["k"] == 0
    assert scored.trajectories[1].logs == ["RULER explanation: e2"] and len(scored.exceptions) == 1
    assert [t.reward for t in original] == [0.0, 1.0] and "ruler_score" not in original.trajectories[0].metrics
    assert original.trajectories[0].logs == []
    assert judge.requests[0][1]["response_format"]["type"] == "json_schema"  # a hosted judge is held to JSON


async def test_a_second_call_on_the_same_content_asks_nobody(fake, tmp_path):
    judge = fake(lambda m, p: scores_json(0.3, 0.6))
    first = await ruler_score_group(group("a", "b"), "openai/o3", cache_dir=tmp_path)
    again = await ruler_score_group(group("a", "b"), "openai/o3", cache_dir=tmp_path)
    assert len(judge.requests) == 1 and [t.reward for t in again] == [t.reward for t in first] == [0.3, 0.6]
    await ruler_score_group(group("a", "b"), "openai/o3", rubric="shorter is better", cache_dir=tmp_path)
    await ruler_score_group(group("a", "c"), "openai/o3", cache_dir=tmp_path)
    await ruler_score_group(group("a", "b"), "openai/o3", cache=False, cache_dir=tmp_path)
    assert len(judge.requests) == 4


async def test_malformed_verdicts_raise_or_are_swallowed(fake, tmp_path, capsys):
    judge = fake(lambda m, p: "The first trajectory is clearly best.")
    with pytest.raises(ValueError, match="not JSON"):
        await ruler_score_group(group("a", "b"), cache_dir=tmp_path)
    assert await ruler_score_group(group("a", "b"), swallow_exceptions=True, cache_dir=tmp_path) is None
    assert "not scored" in capsys.readouterr().out
    assert not list(tmp_path.rglob("*.json")) and len(judge.requests) == 2  # a failure is not cached
    with pytest.raises(TypeError, match="unexpected"):
        await ruler_score_group(group("a", "b"), swallow_exceptions=True, cahce=False)


async def test_identical_trajectories_get_one_verdict_each(fake, tmp_path):
    judge = fake(lambda m, p: scores_json(0.4))
    scored = await ruler_score_group(group("same", "same", "same"), cache_dir=tmp_path)
    assert [t.reward for t in scored] == [0.4] * 3 and len(judge.requests) == 1


async def test_rating_mode_samples_one_question_per_trajectory(fake, tmp_path):
    def reply(messages, params):
        return ["9", "8"] if "Rate trajectory 1" in messages[-1]["content"] else ["2", "no idea"]
    judge = fake(reply, local=True)
    scored = await ruler_score_group(group("1, 2, 3", "three"), "m", rating_samples=2, cache_dir=tmp_path)
    assert [t.reward for t in scored] == [0.85, 0.2]
    # top logprobs asked for in the same request, read where the server returns them (this one does not)
    assert all(p == {"n": 2, "temperature": 1.0, "max_tokens": 4, "logprobs": True, "top_logprobs": 20}
               for _, p in judge.requests)
    assert "mean of 1 of 2 sampled ratings" in scored.trajectories[1].logs[0]
    fake(lambda m, p: ["no", "idea"], local=True)
    with pytest.raises(ValueError, match="no rating"):
        await ruler_score_group(group("x", "y"), "m", cache=False)


async def test_empty_groups_and_bad_arguments():
    assert len(await ruler_score_group(art.TrajectoryGroup([]))) == 0
    history = art.Trajectory(messages_and_choices=convo("1"), additional_histories=[{"messages_and_choices": [USER]}])
    with pytest.raises(ValueError, match="additional_histories"):
        await ruler_score_group(art.TrajectoryGroup([history]), swallow_exceptions=True)
    with pytest.raises(TypeError, match="model name"):
        resolve_judge(3.5)  # type: ignore[arg-type]


async def test_no_litellm_and_no_endpoint_says_what_to_give(monkeypatch, tmp_path):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.setitem(__import__("sys").modules, "litellm", None)  # import litellm -> ImportError
    with pytest.raises(RuntimeError, match="pip install litellm"):
        await ruler_score_group(group("a", "b"), "openai/o3", cache_dir=tmp_path)
    assert await ruler_score_group(group("a", "b"), "openai/o3", swallow_exceptions=True, cache_dir=tmp_path) is None
