"""RULER's verdicts on disk, keyed by content, so re-running a notebook cell does not re-judge.

One JSON file per verdict, `<dir>/<key[:2]>/<key>.json`, written to a temporary name and renamed, so
a crash never leaves half a verdict; an unreadable file counts as a miss. The key
(`ruler_prompt.cache_key`) hashes the judge, the rubric, the conversations and the request, so any
change to those asks the judge again.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from pydantic import ValidationError

from .ruler_prompt import TrajectoryScore

__all__ = ["default_cache_dir", "load", "save"]


def default_cache_dir() -> Path:
    """`ART_NB_RULER_CACHE` when set, else `.art/ruler_cache` (beside ART's default run directory)."""
    return Path(os.environ.get("ART_NB_RULER_CACHE") or ".art/ruler_cache")


def _path(directory: Path, key: str) -> Path:
    return directory / key[:2] / f"{key}.json"


def load(directory: Path, key: str) -> list[TrajectoryScore] | None:
    """The verdict stored under `key`, or None (absent, or not readable as one)."""
    try:
        data = json.loads(_path(directory, key).read_text())
        return [TrajectoryScore.model_validate(s) for s in data["scores"]]
    except (OSError, ValueError, KeyError, TypeError, ValidationError):
        return None


def save(directory: Path, key: str, judge: str, scores: list[TrajectoryScore]) -> None:
    """Store a verdict atomically (temporary file + rename)."""
    path = _path(directory, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"judge": judge, "scores": [s.model_dump() for s in scores]}, ensure_ascii=False)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
