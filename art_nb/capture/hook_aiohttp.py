"""aiohttp: `ClientSession._request` (what `get`/`post`/`request` all call; it sees the `json=` or
`data=` body) and `ClientResponse.read` (what `json()` and `text()` read with).

A response read chunk by chunk from `response.content` (aiohttp-level streaming) is not recorded:
use httpx or requests for streaming inside a scope, or read the whole body.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from .pending import ATTRIBUTE, Pending, begin

__all__ = ["install"]


def install() -> None:
    request, read = aiohttp.ClientSession._request, aiohttp.ClientResponse.read

    async def patched_request(self: aiohttp.ClientSession, method: str, str_or_url: Any,
                              **kwargs: Any) -> aiohttp.ClientResponse:
        body = kwargs.get("json") if kwargs.get("json") is not None else kwargs.get("data")
        pending = begin(method, str(str_or_url), body)
        response = await request(self, method, str_or_url, **kwargs)
        if pending is not None:
            pending.status = response.status
            setattr(response, ATTRIBUTE, pending)
        return response

    async def patched_read(self: aiohttp.ClientResponse) -> bytes:
        body = await read(self)
        # third-party: our own attribute on aiohttp's response, set only on responses we track
        pending: Pending | None = getattr(self, ATTRIBUTE, None)
        if pending is not None and not pending.done:
            pending.add(body)
            pending.finish()
        return body

    aiohttp.ClientSession._request = patched_request  # type: ignore[method-assign]
    aiohttp.ClientResponse.read = patched_read  # type: ignore[method-assign]
