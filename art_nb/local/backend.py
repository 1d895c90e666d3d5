"""`from art_nb.local.backend import LocalBackend`, ART's other import path for it."""

from ..backends.local import LocalBackend, TrainingStoppedError

__all__ = ["LocalBackend", "TrainingStoppedError"]
