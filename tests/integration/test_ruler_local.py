"""RULER offline on CPU: the tiny real model, served by LocalBackend, judges a group with its base
weights (no key, no network); and the 2048 notebook's RULER cell scores one group of real games.

SmolLM2-135M is a weak judge: its ratings are noisy and their order is not asserted, only what holds
whatever it answers (scores in [0, 1], rewards replaced, originals kept, verdicts cached)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import art_nb as art
from art_nb.envs import game_2048 as g2048
from art_nb.rewards import ruler_score_group

pytestmark = pytest.mark.slow

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"
NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "2048.ipynb"
SYSTEM = {"role": "system", "content": "Answer the arithmetic question with the number only."}


def answer(text: str, reward: float) -> art.Trajectory:
    return art.Trajectory(messages_and_choices=[SYSTEM, {"role": "user", "content": "What is 2+2?"},
                                                {"role": "assistant", "content": text}], reward=reward)


@pytest.fixture(scope="module")
async def judge(tmp_path_factory):
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("art"))
    model = art.TrainableModel(name="ruler-judge", project="it", base_model=TINY,
                               config=art.ModelConfig(max_seq_len=1536))
    await model.register(backend)
    yield model
    await backend.close()


async def test_the_local_base_model_scores_a_group_offline(judge, tmp_path):
    group = art.TrajectoryGroup([answer("4", 1.0), answer("I like turtles.", -1.0)])
    started = time.perf_counter()
    scored = await ruler_score_group(group, judge, {"seed": 1234}, rating_samples=4, cache_dir=tmp_path)
    judged_s = time.perf_counter() - started
    assert all(0.0 <= t.reward <= 1.0 for t in scored)
    assert [t.metrics["independent_reward"] for t in scored] == [1.0, -1.0]
    assert [t.metrics["ruler_score"] for t in scored] == [t.reward for t in scored]
    assert all("over the judge's top logprobs" in t.logs[-1] for t in scored) and group.rewards() == [1.0, -1.0]
    started = time.perf_counter()
    again = await ruler_score_group(group, judge, {"seed": 1234}, rating_samples=4, cache_dir=tmp_path)
    assert again.rewards() == scored.rewards() and time.perf_counter() - started < judged_s / 4  # from the cache
    print(f"\nRULER with {TINY} as judge: rewards {scored.rewards()} in {judged_s:.1f}s")


async def test_the_2048_notebooks_ruler_cell_scores_one_group(judge, tmp_path):
    cell = next(c for c in json.loads(NOTEBOOK.read_text())["cells"] if c.get("id") == "cell-ruler")
    namespace = {"art": art, "g2048": g2048, "model": judge, "RULER_JUDGE": None, "ART_PATH": str(tmp_path)}
    exec("".join(cell["source"]), namespace)  # noqa: S102 (the notebook's own cell, as the kernel runs it)
    scenario = g2048.Game2048Scenario(seed=7, target=64, max_turns=2)
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(g2048.rollout(judge, scenario) for _ in range(2))],
        after_each=namespace["judge_group"], max_exceptions=0)
    (group,) = groups
    assert len(group) == 2 and all(0.0 <= t.reward <= 1.0 for t in group)
    assert all(t.metrics["ruler_score"] == t.reward and "independent_reward" in t.metrics for t in group)
    assert list((tmp_path / "ruler_cache").rglob("*.json"))  # the verdict is kept for a re-run
