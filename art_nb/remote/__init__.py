"""The client of `art-nb serve` (`RemoteBackend`) and the server itself (`art-nb serve`)."""

from .client import RemoteBackend

__all__ = ["RemoteBackend"]
