"""On-disk layout of a model's run, and the one way checkpoints are written.

    {path}/{project}/models/{name}/
        checkpoints/{step:04d}/   adapter_model.safetensors, adapter_config.json, trainer_state.pt, meta.json
        history.jsonl             one line per logged step (metrics), appended before the step trains
        trajectories/{split}/{step:04d}.jsonl
        logs/register.log         what vLLM, Unsloth, transformers... printed while it registered (appended)
        wandb_run_id              the W&B run this model logs to, so a restarted kernel continues it
        serverless.json           the hosted training job being followed (ServerlessBackend)
        .writer.lock              held by the one process that writes here

Every path under a model directory is spelled here; the rest of the package asks for it by name.

A checkpoint is written into a hidden temporary sibling and renamed into place, so a crash at any
moment leaves either the complete checkpoint or none: "latest" is never half-written. A training step
hands its adapter to the engine in memory and writes the whole checkpoint in the background, so a
crash in that window leaves the previous step as the latest. Leftover temporaries from a crash are
removed on the next open. Names are checked so nothing is ever written
outside the model directory, and links are never followed out of it: every directory the store
creates or writes in is a real directory (not a symbolic link), every file it writes in place (the
writer lock, the logs) is opened with O_NOFOLLOW and must be a regular file with no other hard link,
and a checkpoint's files are handed to a client only under the same rules (`art_nb.nofollow`). A
planted link is a `StorePathError` naming it, never a write or a read somewhere else.

Logs are append-only JSON lines, fsynced per append. A crash mid-append can leave a torn last line;
the next append starts on a new line, so the torn fragment never swallows a later record, and
readers skip lines that do not parse (or are not UTF-8), with a warning naming the file and line.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from .nofollow import StorePathError, open_regular, real_dirs
from .types import check_name

__all__ = [
    "ADAPTER_FILES",
    "CHECKPOINTS_DIR",
    "RECORD_PARTS",
    "RUN_ID_FILE",
    "SERVERLESS_JOB_FILE",
    "TRAJECTORIES_DIR",
    "CheckpointError",
    "StoreLockedError",
    "StorePathError",
    "HISTORY_FILE",
    "MAX_STEP",
    "META_FILE",
    "ModelMismatchError",
    "ModelStore",
    "TRAINER_STATE",
    "check_name",
    "checkpoint_path",
    "checkpoint_key",
    "checkpoint_step_of",
    "checkpoint_steps",
    "checkpoints_dir",
    "model_dir",
    "model_subpath",
    "read_jsonl",
    "register_log_path",
    "relative_text",
    "staging_path",
    "trajectory_files",
    "write_adapter",
]

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")  # what an engine serves (PEFT's format)
TRAINER_STATE = "trainer_state.pt"  # optimizer + RNG state, loaded with weights_only=True
META_FILE = "meta.json"
HISTORY_FILE = "history.jsonl"
CHECKPOINTS_DIR = "checkpoints"
TRAJECTORIES_DIR = "trajectories"
RUN_ID_FILE = "wandb_run_id"
SERVERLESS_JOB_FILE = "serverless.json"
# What a pull from S3 can leave out (`exclude=`), as path prefixes inside a model directory; "logs" is
# the history and the logs/ folder a bucket ART wrote may hold.
RECORD_PARTS = {"checkpoints": (f"{CHECKPOINTS_DIR}/",), "trajectories": (f"{TRAJECTORIES_DIR}/",),
                "logs": (HISTORY_FILE, "logs/")}
# A step names files ({step:04d}): 10**400 made a name too long for the filesystem. A billion steps
# is far beyond any run.
MAX_STEP = 10**9
_STEP_DIR = re.compile(r"^\d{4,}$")
_STEP_FILE = re.compile(r"^(\d{4,})\.jsonl$")
_TMP_PREFIX = ".tmp-"
_log = logging.getLogger("art_nb")
_warned: set[tuple[str, int, int]] = set()  # damaged log lines already reported (readers re-read often)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (the previous one is intact) or read."""


class StoreLockedError(RuntimeError):
    """Another process (or backend) writes this model directory; names its pid."""


class ModelMismatchError(ValueError):
    """A model name is taken by another base model or config: registered in this process, or trained
    on disk (its checkpoints' meta.json). Names both."""


def model_subpath(project: str, name: str) -> str:
    """`{project}/models/{name}`: where a model's run lives under a root (a backend's path, an S3 prefix)."""
    return f"{check_name('project', project)}/models/{check_name('name', name)}"


def model_dir(root: str | os.PathLike[str], project: str, name: str) -> Path:
    """Where a model's run lives under `root`, without creating or opening anything."""
    return Path(root).expanduser().resolve() / model_subpath(project, name)


def checkpoints_dir(model_dir: Path) -> Path:
    """The `checkpoints/` directory of a model directory (it may not exist)."""
    return model_dir / CHECKPOINTS_DIR


def checkpoint_key(step: int) -> str:
    """`checkpoints/{step:04d}`: checkpoint `step` relative to its model directory, as an S3 key prefix."""
    return checkpoint_path(Path(CHECKPOINTS_DIR), step).as_posix()


def checkpoint_step_of(relative: str) -> int | None:
    """The step of the checkpoint holding the file at `relative` (a posix path inside a model
    directory, as in S3 keys); None for a file that is not in a checkpoint."""
    parts = relative.split("/")
    if len(parts) > 2 and parts[0] == CHECKPOINTS_DIR and _STEP_DIR.match(parts[1]):
        return int(parts[1])
    return None


def staging_path(directory: Path, label: str) -> Path:
    """A hidden temporary path in `directory` for something renamed into place once complete. Hidden,
    so it never leaves the machine (S3 skips hidden files); under `checkpoints/`, the next writer
    removes it after a crash."""
    return directory / f"{_TMP_PREFIX}{label}-{os.getpid()}"


def relative_text(text: str, directory: Path) -> str:
    """`text` with `directory`'s absolute path made relative to it: what a server shows clients (a
    message naming `checkpoints/0003`, not where the server keeps its runs)."""
    root = str(directory)
    return text.replace(root + os.sep, "").replace(root, ".")


def checkpoint_steps(checkpoints: Path) -> list[int]:
    """Steps with a complete checkpoint under a `checkpoints/` directory, ascending ([] if it is missing).
    A step directory that is a symbolic link is not a checkpoint (it may lead anywhere)."""
    if not checkpoints.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints.iterdir()
                  if _STEP_DIR.match(p.name) and p.is_dir() and not p.is_symlink())


def checkpoint_path(checkpoints: Path, step: int) -> Path:
    """The directory of checkpoint `step` under a `checkpoints/` directory (it may not exist)."""
    _check_step(step)
    return checkpoints / f"{step:04d}"


def _check_step(step: int) -> None:
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be from 0 to {MAX_STEP:,}, got {str(step)[:30]}")


def register_log_path(model_dir: Path) -> Path:
    """The log that register's third-party output goes to, under a model directory (local/quiet.py)."""
    return model_dir / "logs" / "register.log"


def trajectory_files(model_dir: Path) -> list[tuple[str, int, Path]]:
    """(split, step, path) of every trajectories file under a model directory, newest step first, train first."""
    root = model_dir / TRAJECTORIES_DIR
    found = []
    if root.is_dir():
        for split_dir in root.iterdir():
            if split_dir.is_dir():
                for file in split_dir.iterdir():
                    match = _STEP_FILE.match(file.name)
                    if match:
                        found.append((split_dir.name, int(match.group(1)), file))
    return sorted(found, key=lambda item: (-item[1], item[0] != "train", item[0]))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records (JSON objects) of a JSON-lines log; a missing file is [].

    A line that is not a JSON object in UTF-8 (cut short by a crash mid-write, or damaged by hand:
    one latin-1 byte made the whole history unreadable) is skipped with a warning naming the file
    and the line, once per damaged line however often the log is read.
    """
    if not path.exists():
        return []
    records = []
    for number, raw in enumerate(path.read_bytes().splitlines(), 1):
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            _warn_damaged(path, number, raw, exc)
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            _warn_damaged(path, number, raw, TypeError(f"a JSON {type(record).__name__}, not an object"))
    return records


def _warn_damaged(path: Path, number: int, raw: bytes, problem: Exception) -> None:
    key = (str(path), number, hash(raw))
    if raw.strip() and key not in _warned:
        _warned.add(key)
        _log.warning("%s line %d is skipped, it is not a JSON object in UTF-8 (%s: %s): %r", path, number,
                     type(problem).__name__, str(problem)[:120], raw[:80])


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ModelStore:
    """Checkpoints, history and trajectories of one model, under one directory."""

    def __init__(self, root: str | os.PathLike[str], project: str, name: str) -> None:
        self.dir = model_dir(root, project, name)
        self.root = self.dir.parents[2]
        self.root.mkdir(parents=True, exist_ok=True)
        real_dirs(self.root, project, "models", name, "checkpoints")
        self.checkpoints = self.dir / "checkpoints"
        self._lock_fd: int | None = None

    def _shown(self, path: Path) -> str:
        """`path` as messages name it: from the root (`--path`) down, which a client may see."""
        return str(path.relative_to(self.root))

    # ---- one writer per model directory ------------------------------------------------------

    def acquire_writer(self) -> None:
        """Become the one writer of this model directory, then remove temporaries left by a crash.

        An OS file lock (flock on `.writer.lock`, holding the writer's pid), so the kernel releases
        it when the writer dies, however it dies. A second writer (another `art-nb serve`, a notebook
        on the same path) would train from a stale step and overwrite checkpoints; it gets
        `StoreLockedError` naming the holder instead. Only the writer removes temporaries: a reader
        never deletes a checkpoint another process is staging.
        """
        if self._lock_fd is not None:
            return
        path = self.dir / ".writer.lock"
        fd = open_regular(path, os.O_RDWR | os.O_CREAT, self._shown(path))  # never truncate through a link
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            who = (f"this process (pid {holder}: a backend here has this model registered; close it first)"
                   if holder == str(os.getpid()) else f"another process (pid {holder})")
            raise StoreLockedError(
                f"{self.dir} is being written by {who}: two writers would train from "
                "stale steps and overwrite each other's checkpoints. Stop that one (or its notebook kernel), or "
                "use another path or model name"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd
        self._remove_temporaries()

    def release_writer(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    # ---- checkpoints -------------------------------------------------------------------------

    def _remove_temporaries(self) -> None:
        for tmp in self.checkpoints.glob(f"{_TMP_PREFIX}*"):
            _remove(tmp)

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""
        return checkpoint_steps(self.checkpoints)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def checkpoint_dir(self, step: int) -> Path:
        return checkpoint_path(self.checkpoints, step)

    def write_checkpoint(self, step: int, write: Callable[[Path], None], meta: dict[str, Any] | None = None) -> Path:
        """Call `write(tmp_dir)` to fill a temporary directory, then rename it to the step's directory.

        Any failure (disk full included) removes the temporary and raises `CheckpointError`;
        existing checkpoints are untouched.
        """
        final = self.checkpoint_dir(step)
        tmp = self.checkpoints / f"{_TMP_PREFIX}{step:04d}-{os.getpid()}-{time.monotonic_ns()}"
        with self._removed_on_failure(tmp, step):
            tmp.mkdir()
            write(tmp)
            (tmp / META_FILE).write_text(json.dumps({"step": step, "time": time.time(), **(meta or {})}))
            for file in tmp.iterdir():
                with open(file, "rb") as handle:
                    os.fsync(handle.fileno())
            _fsync_dir(tmp)
            if final.exists():  # re-writing a step (e.g. after a rollback): swap, never delete first
                old = self.checkpoints / f"{_TMP_PREFIX}old-{step:04d}-{time.monotonic_ns()}"
                final.rename(old)
                tmp.rename(final)
                _remove(old)
            else:
                tmp.rename(final)
            _fsync_dir(self.checkpoints)
        return final

    @contextlib.contextmanager
    def _removed_on_failure(self, tmp: Path, step: int) -> Iterator[None]:
        """Remove `tmp` if the block fails, and turn the failure into one clear `CheckpointError`.

        Writers report a full disk in their own types (safetensors: SafetensorError, torch.save:
        RuntimeError), not only OSError. Interrupts (KeyboardInterrupt, CancelledError) are not
        failures and propagate as they are.
        """
        try:
            yield
        except BaseException as error:
            shutil.rmtree(tmp, ignore_errors=True)
            if not isinstance(error, Exception):
                raise
            cause = error.strerror if isinstance(error, OSError) and error.strerror else error
            raise CheckpointError(
                f"could not write checkpoint {step:04d} ({type(error).__name__}: {cause}); "
                f"the previous checkpoint (step {self.latest_step()}) is intact"
            ) from error

    def delete_checkpoints(self, steps: Iterable[int]) -> list[int]:
        deleted = []
        for step in steps:
            path = self.checkpoint_dir(step)
            if path.is_dir():
                trash = self.checkpoints / f"{_TMP_PREFIX}del-{step:04d}-{time.monotonic_ns()}"
                path.rename(trash)  # atomic disappearance, then the slow delete
                _remove(trash)
                deleted.append(step)
        return deleted

    # ---- logs --------------------------------------------------------------------------------

    def _append_lines(self, path: Path, records: Iterable[dict[str, Any]]) -> None:
        data = "".join(json.dumps(record, default=str, allow_nan=True) + "\n" for record in records).encode("utf-8")
        real_dirs(self.root, *path.parent.relative_to(self.root).parts)
        fd = open_regular(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, self._shown(path))
        with os.fdopen(fd, "ab") as handle:
            size = os.fstat(fd).st_size
            if size > 0 and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data  # a crash cut the last line short: keep it apart from this record
            handle.write(data)
            handle.flush()
            os.fsync(fd)

    def append_history(self, record: dict[str, Any]) -> None:
        self._append_lines(self.dir / HISTORY_FILE, [record])

    def read_history(self) -> list[dict[str, Any]]:
        return read_jsonl(self.dir / HISTORY_FILE)

    def trajectory_file(self, split: str, step: int) -> Path:
        _check_step(step)
        return self.dir / TRAJECTORIES_DIR / check_name("split", split) / f"{step:04d}.jsonl"

    def append_trajectories(self, split: str, step: int, records: Iterable[dict[str, Any]]) -> Path:
        path = self.trajectory_file(split, step)
        self._append_lines(path, records)
        return path


def write_adapter(directory: Path, tensors: dict[str, Any], config: dict[str, Any]) -> None:
    """Write a PEFT adapter held in memory as the files `save_pretrained` writes (ADAPTER_FILES).

    `tensors` are CPU torch tensors under the state-dict keys PEFT saves, `config` the
    adapter_config.json content: what a trainer hands an engine (engines.base.AdapterWeights).
    Tensors may be views of one buffer, as long as they do not overlap.
    """
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)  # as save_pretrained did: `trainer.save(new_dir)` works
    save_file(tensors, str(directory / ADAPTER_FILES[0]), metadata={"format": "pt"})
    (directory / ADAPTER_FILES[1]).write_text(json.dumps(config, indent=2, sort_keys=True))


def _remove(path: Path) -> None:
    """Remove a store's temporary: a link is unlinked, never followed (rmtree refuses links, silently here)."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)
