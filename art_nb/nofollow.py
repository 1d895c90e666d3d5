"""Files and directories opened without following a link out of the directory they belong to.

A model directory under `--path` can hold what someone planted there: a `.writer.lock` that is a
symbolic link to a file elsewhere (registering truncated and overwrote that file), a checkpoint
entry linked to a file outside (`art-nb serve` handed it to any client). The store writes, and the
server serves, only through these functions:

- `real_dirs` creates a path one directory at a time, and each must be a directory, not a link;
- `open_regular` opens with O_NOFOLLOW, then checks on the descriptor (no race with a swap) that
  it holds a regular file with a single name: a hard link is the same file under another name,
  possibly outside;
- `servable_files` / `open_servable` hand out only such files, directly in a directory whose real
  path stays inside the model directory.

Anything else is a `StorePathError` naming the path (relative to the directory, so a client that
sees it learns nothing of the server's layout) and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

__all__ = ["StorePathError", "open_regular", "open_servable", "real_dirs", "servable_files"]

_NO_LINKS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a planted FIFO must not hang the open


class StorePathError(RuntimeError):
    """A path in a model directory is a symbolic link, not a regular file, a file with other hard links,
    or leads out of the directory: the store neither writes through it nor serves it."""


def open_regular(path: Path, flags: int, shown: str) -> int:
    """A descriptor on the regular file at `path` (created 0644 with O_CREAT in `flags`), never through
    a symbolic link; `shown` is how errors name it."""
    try:
        fd = os.open(path, flags | _NO_LINKS, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StorePathError(f"{shown} is a symbolic link: the store never writes or serves through one (it "
                                 "may lead outside the model directory); remove the link") from None
        raise
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
        return fd
    os.close(fd)
    what = (f"a file with {info.st_nlink} hard links (one may be outside the model directory)"
            if stat.S_ISREG(info.st_mode) else "not a regular file")
    raise StorePathError(f"{shown} is {what}: the store only writes and serves files of its own; replace it with "
                         f"a copy (cp {path.name} {path.name}.new && mv {path.name}.new {path.name}) or remove it")


def real_dirs(root: Path, *parts: str) -> Path:
    """`root/parts...`, each part created if missing and checked to be a directory, not a link to one:
    what is made or written below stays below `root` (the store's --path)."""
    path = root
    for part in parts:
        path = path / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise StorePathError(f"{path.relative_to(root)} is not a directory of the store (a symbolic link or a "
                                 "file): the store never writes through links, which may lead outside it; remove it")
    return path


def _inside(directory: Path, within: Path) -> bool:
    real, root = os.path.realpath(directory), os.path.realpath(within)
    return os.path.commonpath([real, root]) == root


def servable_files(directory: Path, within: Path) -> list[Path]:
    """The files of `directory` (a checkpoint) that may be handed to a client: regular files with one
    name, directly in it, the directory itself not a link and really inside `within` (the model
    directory). Links and anything else are left out of the listing."""
    if directory.is_symlink() or not _inside(directory, within):
        raise StorePathError(f"{directory.name} is a link out of the model directory; it is not served")
    return sorted(p for p in directory.iterdir() if stat.S_ISREG(p.lstat().st_mode) and p.lstat().st_nlink == 1)


def open_servable(directory: Path, name: str, within: Path) -> BinaryIO:
    """`directory`'s file `name` opened for reading, under `servable_files`' rules, checked again on the
    open descriptor (a link swapped in after the listing is refused too). FileNotFoundError when
    there is no such file."""
    if name not in {p.name for p in servable_files(directory, within)}:
        raise FileNotFoundError(name)
    return os.fdopen(open_regular(directory / name, os.O_RDONLY, f"{directory.name}/{name}"), "rb")
