"""Where `art-nb serve` keeps the token it generates, and where `RemoteBackend` on this machine finds it.

Without a token of its own (no `--token-file`, no `ART_NB_SERVE_TOKEN`, no `--no-token`) the server
generates one, as Jupyter's server does even on loopback: any account on the machine can connect
to a loopback port, and without a token any of them could download the adapter, delete
checkpoints or train. The token is printed once and written to `serve-{port}.token` under
`$XDG_CONFIG_HOME/art-nb` (`~/.config/art-nb` by default), readable by its owner only (0600 in a
0700 directory). A server restarted on the same port takes the token from there, so its clients
keep working; deleting the file makes the next start generate a new one.

A `RemoteBackend` given no key reads that file for its URL's port, only when the URL is a loopback
address: a token of this machine is never sent to another one.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from art_nb.secrets import Secret
from art_nb.web import is_loopback

__all__ = ["generate_token", "load_token", "loopback_token", "save_token", "token_path"]


def token_path(port: int) -> Path:
    """The token file of a server on `port` (created by `save_token`)."""
    config = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config) / "art-nb" / f"serve-{int(port)}.token"


def generate_token() -> Secret:
    return Secret(secrets.token_urlsafe(32), "generated")


def load_token(port: int) -> Secret | None:
    """The token saved for `port`, or None when there is none or it is not private to this user: a regular
    file (not a link) owned by this user, that no one else can read or write."""
    path = token_path(port)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        private = stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077
        text = handle.read(4096).decode("utf-8", errors="replace").strip() if private else ""
    return Secret(text, f"token file {path}") if text else None


def save_token(secret: Secret, port: int) -> Path:
    """Write `secret` as the token of the server on `port`, mode 0600, replacing any file there at once
    (a new file renamed into place: at no moment can another user read it)."""
    path = token_path(port)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(secret.reveal() + "\n")
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return path


def loopback_token(base_url: str) -> Secret | None:
    """The saved token of the server at `base_url` when that is a loopback address on this machine."""
    import httpx

    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL:
        return None
    port = url.port or {"http": 80, "https": 443}.get(url.scheme)
    return load_token(port) if port is not None and is_loopback(url.host) else None
