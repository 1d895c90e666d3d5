"""requests: `Session.send` (every requests call goes through it) and `Response.iter_content`
(what `.content`, `iter_lines` and streaming read with; a stream to record is read ahead, see
`pending`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import requests

from .pending import ATTRIBUTE, Pending, begin

__all__ = ["install"]


def install() -> None:
    send, iter_content = requests.Session.send, requests.Response.iter_content

    def patched_send(self: requests.Session, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        pending = begin(request.method or "", request.url or "", request.body)
        response = send(self, request, **kwargs)
        if pending is not None:
            pending.status = response.status_code
            if kwargs.get("stream"):
                setattr(response, ATTRIBUTE, pending)
            else:  # send() has read the body already
                pending.add(response.content)
                pending.finish()
        return response

    def patched_iter_content(self: requests.Response, chunk_size: int | None = 1,
                             decode_unicode: bool = False) -> Iterator[Any]:
        # third-party: our own attribute on requests' response, set only on responses we track
        pending: Pending | None = getattr(self, ATTRIBUTE, None)
        if pending is None:
            yield from iter_content(self, chunk_size, decode_unicode)
            return
        try:
            for chunk in iter_content(self, chunk_size, decode_unicode):
                yield from pending.take(chunk)
        except Exception:
            yield from pending.release()  # what was read ahead reaches the client before the error
            raise
        yield from pending.end()

    requests.Session.send = patched_send  # type: ignore[method-assign]
    requests.Response.iter_content = patched_iter_content  # type: ignore[method-assign]
