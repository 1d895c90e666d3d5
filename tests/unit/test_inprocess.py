"""`model.openai_client()` without a socket: the app on the backend's thread, the client on this loop.

The same-loop case runs the whole of test_server.py (its `inprocess` parameter); here the app runs on a
`BackgroundLoop` thread as in a notebook, and the real `openai.AsyncOpenAI` calls it from this thread's loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from art_nb.local.loop import BackgroundLoop
from art_nb.local.server import InferenceGate, create_app, start_server
from tests.unit.test_server import Registry, ScriptedEngine
from tests.unit.test_server import tokenizer as tokenizer  # noqa: F401  (the module's fixture)


class Served:
    def __init__(self, tokenizer: Any) -> None:
        self.loop = BackgroundLoop("test-inprocess")
        self.engine = ScriptedEngine(tokenizer)
        self.cancelled = 0
        generate = self.engine.generate

        async def counting(request: Any) -> Any:
            try:
                return await generate(request)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

        self.engine.generate = counting  # type: ignore[method-assign]

        async def start() -> Any:
            return await start_server(create_app(Registry(self.engine), InferenceGate(), api_key="key-0123456789abcdef"))

        self.server = self.loop.run_sync(start(), timeout=30)

    def client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.server.base_url, api_key="key-0123456789abcdef", max_retries=0,
                                  http_client=self.server.in_process_http_client(), **kwargs)

    def hold(self) -> asyncio.Event:
        """Make the engine wait (on the server's loop) until the returned event is set there."""
        event = self.loop.run_sync(_event(), timeout=5)
        self.engine.hold = event
        return event


async def _event() -> asyncio.Event:
    return asyncio.Event()


@pytest.fixture
def served(tokenizer: Any) -> Iterator[Served]:
    s = Served(tokenizer)
    yield s
    s.loop.run_sync(s.server.stop(), timeout=30)


async def test_requests_and_streams_cross_from_this_loop_to_the_servers(served: Served, tokenizer: Any) -> None:
    client = served.client()
    replies = await asyncio.gather(*(client.chat.completions.create(
        model="agent", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=32) for i in range(16)))
    assert [r.choices[0].message.content for r in replies] == ["answer 0"] * 16
    assert replies[0].choices[0].token_ids == tokenizer.encode("answer 0", add_special_tokens=False) + [tokenizer.eos_token_id]
    stream = await client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=32, stream=True)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "answer 0"
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nobody", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):  # the bearer key is checked as over HTTP
        await openai.AsyncOpenAI(base_url=served.server.base_url, api_key="wrong", max_retries=0,
                                 http_client=served.server.in_process_http_client()).models.list()
    await client.close()


async def test_a_caller_that_gives_up_is_a_disconnect_to_the_app(served: Served) -> None:
    release = served.hold()
    client = served.client()
    task = asyncio.ensure_future(client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "x"}]))
    for _ in range(200):
        if served.engine.requests:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):  # the app saw the disconnect and stopped waiting for the engine
        if served.cancelled:
            break
        await asyncio.sleep(0.01)
    assert served.cancelled == 1
    served.loop.loop.call_soon_threadsafe(release.set)
    await client.close()


async def test_the_clients_read_timeout_holds(served: Served) -> None:
    release = served.hold()
    client = served.client(timeout=0.3)
    with pytest.raises(openai.APITimeoutError):
        await client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "x"}])
    for _ in range(200):
        if served.cancelled:
            break
        await asyncio.sleep(0.01)
    assert served.cancelled == 1  # and the app was told the caller left
    served.loop.loop.call_soon_threadsafe(release.set)
    await client.close()


def test_model_openai_client_uses_the_backends_in_process_client_unless_turned_off(monkeypatch: Any) -> None:
    import art_nb as art

    made: list[Any] = []

    class Backend:
        def in_process_http_client(self, model: Any) -> Any:
            made.append(model)
            import openai as oa

            return oa.DefaultAsyncHttpxClient()

    model = art.Model(name="m", project="p", inference_base_url="http://127.0.0.1:9/v1", inference_api_key="k")
    model._backend = Backend()  # type: ignore[assignment]
    model._endpoint = lambda: ("http://127.0.0.1:9/v1", "k")  # type: ignore[method-assign]
    model.openai_client()
    assert made == [model]
    monkeypatch.setenv("ART_NB_IN_PROCESS_CLIENT", "0")
    model.openai_client(timeout=5.0)  # a new client (other kwargs): over HTTP this time
    assert made == [model]
