"""Whether the Unsloth trainer can run here, asked without importing Unsloth (~40 s) or the trainers.

Its own module so the plan (art_nb/plan.py), which asks this before choosing a trainer,
does not import the trainer classes, which are built from a plan: the two would import each other.
For the same reason (it imports no transformers) register imports Unsloth through it (`import_unsloth`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

__all__ = ["import_unsloth", "unsloth_unavailable_reason"]

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


def import_unsloth() -> str:
    """Import Unsloth before transformers, as it asks; the sentence for the log.

    Unsloth patches transformers' classes as it loads; imported after them it warns "may run
    slower". Register calls this before vLLM or a trainer imports transformers (trainers/peft.py does
    at module level). Unsloth imports vLLM too, when installed. Seconds: Unsloth's import is the
    slowest part of building its trainer.
    """
    late = "transformers" in sys.modules and "unsloth" not in sys.modules
    importlib.import_module("unsloth")
    if late:  # the kernel imported transformers earlier (a notebook cell, a GGUF conversion): too late to help
        return "Unsloth imported after transformers (already loaded in this process): it may run slower"
    return "Unsloth imported before transformers, as it asks"
