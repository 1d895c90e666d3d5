"""The in-process backend: engine, trainer, checkpoint store and OpenAI endpoint in this kernel."""

from .backend import LocalBackend, TrainingStoppedError

__all__ = ["LocalBackend", "TrainingStoppedError"]
