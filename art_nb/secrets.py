"""API keys: where they come from, and a wrapper that never prints them.

A key is looked up in this order: the argument, a Colab secret (the notebook's "Secrets" panel,
read through `google.colab.userdata`, imported only when running in Colab), then an environment
variable. The result is a `Secret`: its repr and str are a fixed mask, so a key that ends up in a
cell's output, a log line, a progress bar or an exception is still not shown, and a notebook saved
with that output does not carry it. Code that must send the key calls `reveal()` at the last
moment; `redact(text)` scrubs it, and any piece of it 8 characters or longer, from text that came
back from a server.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field

__all__ = ["MissingSecretError", "Secret", "find_secret"]

_MASK = "********"
_MIN_PIECE = 8  # pieces of a key this long are masked wherever they appear


class MissingSecretError(LookupError):
    """No key was given, found in Colab secrets, or set in the environment; says where to put one."""


@dataclass(frozen=True, eq=False)
class Secret:
    """A key that can be sent but not shown. `source` says where it was found (never the value)."""

    _value: str = field(repr=False)
    source: str = "argument"

    def __post_init__(self) -> None:
        if not isinstance(self._value, str) or not self._value.strip():
            raise ValueError(f"the key from {self.source} is empty")

    def reveal(self) -> str:
        """The key itself: only for an Authorization header or an SDK call that needs it."""
        return self._value

    def redact(self, text: str, partial: bool = True) -> str:
        """`text` with the key masked (for server-supplied messages).

        With `partial` (the default), every run of text made of pieces of the key at least
        `_MIN_PIECE` characters long is masked too: a message cut anywhere (by a server, a log
        line, or us) can leave the key's head or tail, and 30 of 40 characters is most of a key.
        Shorter pieces are left alone, as ordinary text shares them by chance.
        """
        if not partial or len(self._value) < _MIN_PIECE:
            return text.replace(self._value, _MASK) if self._value in text else text
        pieces = {self._value[i : i + _MIN_PIECE] for i in range(len(self._value) - _MIN_PIECE + 1)}
        masked = [False] * len(text)
        for i in range(len(text) - _MIN_PIECE + 1):
            if text[i : i + _MIN_PIECE] in pieces:
                masked[i : i + _MIN_PIECE] = [True] * _MIN_PIECE
        if not any(masked):
            return text
        out: list[str] = []
        for i, char in enumerate(text):
            if not masked[i]:
                out.append(char)
            elif i == 0 or not masked[i - 1]:
                out.append(_MASK)
        return "".join(out)

    def matches(self, candidate: str | bytes) -> bool:
        """Constant-time comparison, for servers that check a presented key."""
        given = candidate.encode() if isinstance(candidate, str) else candidate
        return hmac.compare_digest(given, self._value.encode())

    def __repr__(self) -> str:
        return f"Secret({_MASK}, source={self.source!r})"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __copy__(self) -> Secret:
        return self  # immutable: copies may share it (pydantic and dataclasses copy defaults)

    def __deepcopy__(self, memo: dict[int, object]) -> Secret:
        return self

    def __reduce__(self) -> tuple[object, ...]:
        # Pickling would write the key into whatever is pickled (a checkpoint, a cache): refuse.
        raise TypeError("a Secret cannot be pickled; pass the key again where it is needed")


def _colab_secret(name: str) -> str | None:
    """The Colab secret `name`, or None outside Colab, when absent, or when access is not granted."""
    try:
        from google.colab import userdata  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        value = userdata.get(name)
    except Exception:  # noqa: BLE001 - SecretNotFoundError / NotebookAccessError: treat as absent
        return None
    return value or None


def find_secret(
    given: str | Secret | None,
    *,
    name: str,
    required: bool = True,
    purpose: str = "",
) -> Secret | None:
    """The key from `given`, else the Colab secret `name`, else the environment variable `name`.

    With `required=False` a missing key gives None (e.g. a loopback server without auth).
    """
    if isinstance(given, Secret):
        return given
    if given is not None:
        return Secret(given, "argument")
    colab = _colab_secret(name)
    if colab is not None:
        return Secret(colab, f"Colab secret {name}")
    env = os.environ.get(name)
    if env:
        return Secret(env, f"environment variable {name}")
    if not required:
        return None
    what = f" for {purpose}" if purpose else ""
    raise MissingSecretError(
        f"no API key{what}: pass api_key=..., add a Colab secret named {name} (key icon in the left "
        f"panel, with notebook access on), or set the environment variable {name}"
    )
