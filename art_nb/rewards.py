"""`art_nb.rewards`, ART's module of reward helpers: importable, so ART code loads; RULER (an LLM
judge that scores a group's trajectories against each other) is not built yet.

Calling `ruler` or `ruler_score_group` raises NotImplementedError naming what is missing, at the
call, never at import: a notebook that imports RULER but rewards with its own function still runs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ruler", "ruler_score_group"]

_MISSING = ("RULER (an LLM judge that ranks a group's trajectories) is not built in art_nb yet: give each "
            "trajectory a reward in your rollout instead, or score the group with your own judge in "
            "gather_trajectory_groups(after_each=...)")


async def ruler(message_lists: list[list[dict[str, Any]]], judge_model: str = "openai/o3",
                extra_litellm_params: dict[str, object] | None = None, rubric: str | None = None,
                tools: list[dict[str, Any]] | None = None, *, debug: bool = False) -> list[Any]:
    """ART's RULER scoring of raw message lists: not built yet (NotImplementedError)."""
    raise NotImplementedError(f"ruler: {_MISSING}")


async def ruler_score_group(group: Any, judge_model: str = "openai/o3",
                            extra_litellm_params: dict[str, object] | None = None, rubric: str | None = None,
                            *, swallow_exceptions: bool = False, debug: bool = False) -> Any:
    """ART's RULER scoring of a TrajectoryGroup: not built yet (NotImplementedError, even with
    `swallow_exceptions`: a group silently left unscored would train on rewards nobody gave)."""
    raise NotImplementedError(f"ruler_score_group: {_MISSING}")
