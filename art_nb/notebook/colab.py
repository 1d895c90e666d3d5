"""Colab: whether this kernel runs there, and keeping a run's directory on Google Drive when it does.

A Colab runtime is recycled when the browser disconnects for long or the session times out, and
its disk goes with it: checkpoints, `history.jsonl` and the trajectories. With the notebooks'
`KEEP_ON_DRIVE = True`, `.art` lives on the user's Drive instead, so reconnecting, re-running the
install cell and then Run all resumes at the last checkpoint. Off Colab it changes nothing.

Not tried on a real Drive here (the development machines have no Colab): Drive's filesystem is
slower than the runtime's disk, so each checkpoint's commit takes longer; if it refused the
model directory's writer lock, registering would say so.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

__all__ = ["DRIVE_MOUNT", "in_colab", "keep_on_drive"]

DRIVE_MOUNT = "/content/drive"
_log = logging.getLogger("art_nb.notebook")


def in_colab() -> bool:
    """True inside a Google Colab runtime (its kernel sets COLAB_RELEASE_TAG and ships google.colab)."""
    if os.environ.get("COLAB_RELEASE_TAG"):
        return True
    try:
        return importlib.util.find_spec("google.colab") is not None
    except (ImportError, ValueError):
        return False


def keep_on_drive(art_path: str, folder: str = "art_nb", mount_point: str = DRIVE_MOUNT) -> str:
    """Where to keep `art_path`: on Colab, `MyDrive/{folder}/{name of art_path}` on Google Drive
    (mounting Drive first, which asks for permission once); elsewhere `art_path` unchanged."""
    if not in_colab():
        print(f"KEEP_ON_DRIVE: not on Colab, the run stays in {art_path}")
        return art_path
    drive = Path(mount_point) / "MyDrive"
    if not drive.is_dir():
        from google.colab import drive as colab_drive  # type: ignore[import-not-found]

        colab_drive.mount(mount_point)
    target = drive / folder / Path(art_path).name
    target.mkdir(parents=True, exist_ok=True)
    print(f"KEEP_ON_DRIVE: the run is kept in {target} (Google Drive): a disconnect does not lose it")
    return str(target)
