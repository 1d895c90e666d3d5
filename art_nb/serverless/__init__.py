"""Train and serve on the hosted W&B Training API (`ServerlessBackend`), as OpenPipe ART's client does.

One job per file: `api` speaks the service's routes and wire format (retries, the one error type,
the key scrubbed from every message); `artifacts` moves LoRA files through W&B Artifacts as
`{entity}/{project}/{name}:step{N}`; `backend` implements the `Backend` protocol on top of both,
recording runs locally through `art_nb.records` like every other backend.
"""

from .api import API_KEY_ENV, DEFAULT_BASE_URL, ServerlessError, TrainingJobFailed
from .artifacts import ArtifactRef, ArtifactStore, WandbArtifacts
from .backend import ServerlessBackend

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_BASE_URL",
    "ArtifactRef",
    "ArtifactStore",
    "ServerlessBackend",
    "ServerlessError",
    "TrainingJobFailed",
    "WandbArtifacts",
]
