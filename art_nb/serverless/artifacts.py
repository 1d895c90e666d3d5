"""Checkpoint files across the boundary: a LoRA lives in W&B Artifacts as `{entity}/{project}/{name}:step{N}`.

`ArtifactStore` is the seam: `WandbArtifacts` moves files with the `wandb` SDK; the tests use a local
store with the same two methods. Only the adapter travels (PEFT's two files), never optimizer state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Protocol

from art_nb.secrets import Secret

from .api import ServerlessError

__all__ = ["ArtifactRef", "ArtifactStore", "WandbArtifacts"]


@dataclass(frozen=True)
class ArtifactRef:
    """One checkpoint's artifact: `{entity}/{project}/{name}:step{step}` of type "lora"."""

    entity: str
    project: str
    name: str
    step: int

    @property
    def path(self) -> str:
        return f"{self.entity}/{self.project}/{self.name}:step{self.step}"

    @property
    def uri(self) -> str:
        return f"wandb-artifact:///{self.path}"


class ArtifactStore(Protocol):
    async def download(self, ref: ArtifactRef, directory: Path, key: Secret) -> None:
        """Fill the empty `directory` with the artifact's files."""
        ...

    async def upload(self, ref: ArtifactRef, directory: Path, key: Secret, run_id: str | None) -> None:
        """Store `directory`'s files as `ref` (alias `step{N}`), logged to the model's run."""
        ...


class WandbArtifacts:
    """Checkpoint files through W&B Artifacts with the `wandb` SDK (`pip install wandb`).

    Not exercised by the tests here (no network): they use a local store with the same interface.
    """

    @staticmethod
    def _sdk() -> ModuleType:
        try:
            import wandb  # type: ignore[import-not-found]
        except ImportError as exc:
            raise ImportError("moving serverless checkpoints needs the W&B SDK: pip install wandb") from exc
        return wandb

    async def download(self, ref: ArtifactRef, directory: Path, key: Secret) -> None:
        def run() -> None:
            wandb = self._sdk()
            wandb.Api(api_key=key.reveal()).artifact(ref.path, type="lora").download(root=str(directory))

        await _scrubbed(asyncio.to_thread(run), key, f"download of {ref.path}")

    async def upload(self, ref: ArtifactRef, directory: Path, key: Secret, run_id: str | None) -> None:
        def run() -> None:
            wandb = self._sdk()
            settings = wandb.Settings(api_key=key.reveal(), silent=True, console="off")
            wb_run = wandb.init(entity=ref.entity, project=ref.project, id=run_id, resume="allow" if run_id else None,
                                job_type="art-nb-handoff", settings=settings)
            try:
                artifact = wandb.Artifact(ref.name, type="lora", metadata={"step": ref.step, "source": "art_nb"})
                artifact.add_dir(str(directory))
                wb_run.log_artifact(artifact, aliases=[f"step{ref.step}"]).wait()
            finally:
                wb_run.finish()

        await _scrubbed(asyncio.to_thread(run), key, f"upload of {ref.path}")


async def _scrubbed(work: Awaitable[None], key: Secret, what: str) -> None:
    """Await `work`; an SDK error could quote the key, so it is re-raised as a scrubbed `ServerlessError`."""
    try:
        await work
    except ImportError:
        raise
    except Exception as exc:  # noqa: BLE001 - any SDK failure, re-raised without the key
        raise ServerlessError(f"{what} failed: {key.redact(f'{type(exc).__name__}: {exc}')}") from None
