"""`from art_nb.serverless import ServerlessBackend`, ART's import path (it lives in art_nb.backends.serverless)."""

from ..backends.serverless import ServerlessBackend

__all__ = ["ServerlessBackend"]
