"""`from art_nb.serverless.backend import ServerlessBackend`, ART's other import path for it."""

from ..backends.serverless import ServerlessBackend

__all__ = ["ServerlessBackend"]
