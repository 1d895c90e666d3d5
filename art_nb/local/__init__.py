"""`from art_nb.local import LocalBackend`, the import path OpenPipe ART users already write."""

from ..backends.local import LocalBackend, TrainingStoppedError

__all__ = ["LocalBackend", "TrainingStoppedError"]
