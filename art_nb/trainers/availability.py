"""Whether the Unsloth trainer can run here, asked without importing Unsloth (~40 s) or the trainers.

Its own module so the plan (art_nb/plan.py), which asks this before choosing a trainer,
does not import the trainer classes, which are built from a plan: the two would import each other.
"""

from __future__ import annotations

import importlib.util
import logging

__all__ = ["unsloth_unavailable_reason"]

_log = logging.getLogger("art_nb")


def unsloth_unavailable_reason() -> str | None:
    """Why the Unsloth trainer cannot run here (shown to the user), or None when it can."""
    from ..versions import VersionError, check_versions

    if importlib.util.find_spec("unsloth") is None:
        return "Unsloth is not installed (pip install 'art-nb[gpu]')"
    import torch

    if not torch.cuda.is_available():
        return "Unsloth needs a CUDA GPU"
    try:
        warnings = check_versions("unsloth")
    except VersionError as exc:
        return str(exc)
    for warning in warnings:
        _log.warning("%s", warning)
    return None
