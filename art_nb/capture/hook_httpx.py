"""httpx and httpx2 (its successor, which the openai SDK 3.x uses; same API): `Client.send` /
`AsyncClient.send` (every request goes through them, the openai SDK's included) and the response's
byte iterators (what `read()`, `aread()` and streaming use; a stream to record is read ahead, see
`pending`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

from .pending import ATTRIBUTE, Pending, begin

__all__ = ["install"]


def install(httpx: ModuleType) -> None:
    """Patch `httpx` (the module `httpx` or `httpx2`)."""

    def _request_body(request: Any) -> bytes | None:
        try:
            return request.content
        except httpx.RequestNotRead:  # a streamed upload: not a JSON chat request
            return None

    send, async_send = httpx.Client.send, httpx.AsyncClient.send
    iter_bytes, aiter_bytes = httpx.Response.iter_bytes, httpx.Response.aiter_bytes
    close, aclose = httpx.Response.close, httpx.Response.aclose

    def _attach(response: Any, pending: Pending | None, streaming: bool) -> None:
        if pending is None:
            return
        pending.status = response.status_code
        if streaming:
            setattr(response, ATTRIBUTE, pending)
        else:  # send() has read the body already
            pending.add(response.content)
            pending.finish()

    def patched_send(self: Any, request: Any, **kwargs: Any) -> Any:
        pending = begin(request.method, str(request.url), _request_body(request))
        response = send(self, request, **kwargs)
        _attach(response, pending, bool(kwargs.get("stream")))
        return response

    async def patched_async_send(self: Any, request: Any, **kwargs: Any) -> Any:
        pending = begin(request.method, str(request.url), _request_body(request))
        response = await async_send(self, request, **kwargs)
        _attach(response, pending, bool(kwargs.get("stream")))
        return response

    def patched_iter_bytes(self: Any, chunk_size: int | None = None) -> Iterator[bytes]:
        # third-party: our own attribute on httpx's response, set only on responses we track
        pending: Pending | None = getattr(self, ATTRIBUTE, None)
        if pending is None:
            yield from iter_bytes(self, chunk_size)
            return
        pending.reading = True
        try:
            for chunk in iter_bytes(self, chunk_size):
                yield from pending.take(chunk)
        except Exception:
            yield from pending.release()  # what was read ahead reaches the client before the error
            raise
        finally:
            pending.reading = False
        yield from pending.end()

    async def patched_aiter_bytes(self: Any, chunk_size: int | None = None) -> AsyncIterator[bytes]:
        # third-party: our own attribute on httpx's response, set only on responses we track
        pending: Pending | None = getattr(self, ATTRIBUTE, None)
        if pending is None:
            async for chunk in aiter_bytes(self, chunk_size):
                yield chunk
            return
        pending.reading = True
        try:
            async for chunk in aiter_bytes(self, chunk_size):
                for part in pending.take(chunk):
                    yield part
        except Exception:
            for part in pending.release():  # what was read ahead reaches the client before the error
                yield part
            raise
        finally:
            pending.reading = False
        for part in pending.end():
            yield part

    def patched_close(self: Any) -> None:
        close(self)
        # third-party: our own attribute on httpx's response
        pending: Pending | None = getattr(self, ATTRIBUTE, None)
        if pending is not None:
            pending.closed()

    async def patched_aclose(self: Any) -> None:
        await aclose(self)
        # third-party: our own attribute on httpx's response
        pending: Pending | None = getattr(self, ATTRIBUTE, None)
        if pending is not None:
            pending.closed()

    httpx.Client.send = patched_send
    httpx.AsyncClient.send = patched_async_send
    httpx.Response.iter_bytes = patched_iter_bytes
    httpx.Response.aiter_bytes = patched_aiter_bytes
    httpx.Response.close = patched_close
    httpx.Response.aclose = patched_aclose
