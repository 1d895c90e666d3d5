"""One call in flight: where it will be recorded, what was asked, and the response bytes so far.

Each hook opens a `Pending` when a request leaves inside a scope and finishes it when the body has
been read (whole, or to the end of a stream); `finish` records at most once, so a body read twice
(or a stream closed after its last chunk) is one call.

A stream is read ahead. The hooks hand each chunk to `take`, which holds chunks back once the first
event shows a stream worth recording (it carries `prompt_token_ids`) and releases them all when the
stream has ended and the call is recorded. So a client that stops reading after its first chunk,
or closes the response, or drops it without closing, has the whole sample recorded before it sees
a byte, every time (recording it when the client stops would depend on how the transport happened
to split the body). It costs art_nb's endpoint nothing: it sends a finished answer in one write. A
stream without token ids (another server) passes through untouched and unrecorded.

A call made outside every scope while some scope is open (`context.outside`, e.g. from a thread
started by hand) gets a Pending with no list to record into: when its response shows it came from
an art_nb endpoint, it is counted (`context.note_outside_call`) so the trajectories open meanwhile
can say why they recorded nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from . import context
from .body import is_model_url, parse_call, request_json
from .calls import CapturedCall

__all__ = ["Pending", "begin"]

ATTRIBUTE = "_art_nb_capture"  # where a hook keeps the Pending on a third-party response object
_TOKEN_IDS = b'"prompt_token_ids"'
_SSE_FIELDS = (b"data:", b"event:")  # how an event's first line starts (the Responses API names its events)
Mode = Literal["undecided", "hold", "pass", "ignore"]


@dataclass
class Pending:
    calls: list[CapturedCall] | None  # None: a call outside every scope, only counted
    request: dict[str, Any]
    status: int | None = None
    body: bytearray = field(default_factory=bytearray)
    done: bool = False
    mode: Mode = "undecided"  # how a streamed body is read (`_decide`)
    held: list[Any] = field(default_factory=list)
    reading: bool = False  # a hook's byte iterator is running: it finishes the call at the stream's end

    def add(self, chunk: bytes) -> None:
        if not self.done:
            self.body.extend(chunk)

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        call = parse_call(self.request, self.status or 0, bytes(self.body))
        if call is None:
            return
        if self.calls is None:
            context.note_outside_call()
        else:
            self.calls.append(call)

    def closed(self) -> None:
        """The response was closed. httpx closes it itself when the raw stream runs out, before the
        last re-chunked bytes reach the iterator: a running iterator finishes the call, not this."""
        if not self.reading:
            self.finish()

    def take(self, chunk: Any) -> list[Any]:
        """The chunks a streaming hook may hand on now, given the next one (bytes, or text from
        requests' `decode_unicode`): none while reading ahead, all at once when the stream has been
        recorded or turns out not to be one to record."""
        if self.done:
            return [chunk]
        self.add(chunk.encode() if isinstance(chunk, str) else chunk)
        if self.mode == "pass":
            return [chunk]
        self.held.append(chunk)
        if self.mode == "undecided":
            self.mode = self._decide()
            if self.mode == "ignore":  # server-sent events without token ids: not art_nb's, nothing to keep
                self.done = True
                self.body.clear()
            elif self.mode == "hold" and self.calls is None:  # only to be counted: the first event says enough
                self.done = True
                self.body.clear()
                if 200 <= (self.status or 0) < 300:
                    context.note_outside_call()
        return self.release() if self.done or self.mode == "pass" else []

    def end(self) -> list[Any]:
        """The stream has ended: record it, and return the chunks still held."""
        self.finish()
        return self.release()

    def release(self) -> list[Any]:
        """The chunks held back (e.g. to hand on before an error from the transport is raised)."""
        held, self.held = self.held, []
        return held

    def _decide(self) -> Mode:
        """From the bytes so far: "hold" when the first server-sent event is complete and carries
        `prompt_token_ids`, "ignore" when it carries none, "pass" for a body that is not server-sent
        events (a JSON completion is recorded when read to its end, as a non-streamed one is), else
        "undecided" (the first event is not complete yet)."""
        head = bytes(self.body.lstrip()[:6])
        if not any(field.startswith(head) or head.startswith(field) for field in _SSE_FIELDS):
            return "pass"
        if not any(head.startswith(field) for field in _SSE_FIELDS):
            return "undecided"
        ends = [i for i in (self.body.find(b"\n\n"), self.body.find(b"\r\n\r\n")) if i >= 0]
        if not ends:
            return "undecided"
        return "hold" if _TOKEN_IDS in self.body[:min(ends)] else "ignore"


def begin(method: str, url: str, body: Any) -> Pending | None:
    """A Pending for a model call (chat, Responses or text completions) made inside a scope (or outside
    every scope while one is open elsewhere, to be counted), else None (let it pass)."""
    if not is_model_url(method, url):
        return None
    calls = context.sink()
    if calls is None and not context.outside():
        return None
    request = request_json(body)
    return None if request is None else Pending(calls, request)
