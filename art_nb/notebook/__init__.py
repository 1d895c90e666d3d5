"""Notebook views: the live dashboard, the static summary, the parameters' defaults, export links, Drive.

Needs the `notebook` extra (ipywidgets, matplotlib). Everything loads on first use, so importing
`art_nb.notebook` (or `art_nb`) imports neither ipywidgets nor matplotlib nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .colab import in_colab, keep_on_drive
    from .dashboard import Dashboard
    from .evaluation import Comparison, compare
    from .export_view import show_export
    from .hardware import NotebookDefaults, pick_defaults
    from .summary import TrainingSummary, summary_from_model_dir
    from .viewer import show_trajectory

__all__ = [
    "Comparison",
    "Dashboard",
    "NotebookDefaults",
    "TrainingSummary",
    "compare",
    "in_colab",
    "keep_on_drive",
    "pick_defaults",
    "show_export",
    "show_trajectory",
    "summary_from_model_dir",
]

_WHERE = {
    "Comparison": "evaluation",
    "compare": "evaluation",
    "show_trajectory": "viewer",
    "Dashboard": "dashboard",
    "NotebookDefaults": "hardware",
    "in_colab": "colab",
    "keep_on_drive": "colab",
    "pick_defaults": "hardware",
    "show_export": "export_view",
    "TrainingSummary": "summary",
    "summary_from_model_dir": "summary",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'art_nb.notebook' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)
