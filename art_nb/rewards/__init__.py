"""`art_nb.rewards`, ART's `art.rewards`: RULER, an LLM judge that scores a group's trajectories
against each other, so a rollout needs no hand-written reward.

    group = await ruler_score_group(group, judge_model=model)          # offline: the base model judges
    group = await ruler_score_group(group, "openai/o4-mini", swallow_exceptions=True)   # a hosted judge

See `art_nb.rewards.ruler` for what is returned and `ruler_judge` for how a judge is reached.
"""

from __future__ import annotations

from .ruler import DEFAULT_RUBRIC, TrajectoryScore, ruler, ruler_score_group

__all__ = ["DEFAULT_RUBRIC", "TrajectoryScore", "ruler", "ruler_score_group"]
