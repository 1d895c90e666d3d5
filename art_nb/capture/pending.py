"""One call in flight: where it will be recorded, what was asked, and the response bytes so far.

Each hook opens a `Pending` when a request leaves inside a scope and finishes it when the body has
been read (whole, or to the end of a stream); `finish` records at most once, so a body read twice
(or a stream closed after its last chunk) is one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .body import is_chat_url, parse_call, request_json
from .calls import CapturedCall
from .context import sink

__all__ = ["Pending", "begin"]

ATTRIBUTE = "_art_nb_capture"  # where a hook keeps the Pending on a third-party response object


@dataclass
class Pending:
    calls: list[CapturedCall]
    request: dict[str, Any]
    status: int | None = None
    body: bytearray = field(default_factory=bytearray)
    done: bool = False

    def add(self, chunk: bytes) -> None:
        if not self.done:
            self.body.extend(chunk)

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        call = parse_call(self.request, self.status or 0, bytes(self.body))
        if call is not None:
            self.calls.append(call)


def begin(method: str, url: str, body: Any) -> Pending | None:
    """A Pending for a chat-completions request made inside a scope, else None (let it pass)."""
    calls = sink()
    if calls is None or not is_chat_url(method, url):
        return None
    request = request_json(body)
    return None if request is None else Pending(calls, request)
