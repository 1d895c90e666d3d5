"""The client `model.openai_client()` returns: the SDK's `AsyncOpenAI`, whose chat completions send the
messages and tools without the SDK's request transform.

Before each request the SDK walks the arguments against its TypedDict annotations
(`async_maybe_transform`). For a chat request the walk changes nothing the server can see: those types
carry no aliases or formats, so it only leaves out unset values, dumps pydantic models (a message taken
from an earlier reply) and turns iterables into lists. But it is typing introspection at every level of
every message: about half of the client's CPU per request (1.04 ms with it, 0.56 ms without, on the 2-core
CI machine: bench/endpoint_per_request.py), and in a notebook that CPU is taken under the GIL that vLLM's
engine thread needs to decode. The Anthropic SDK, generated the same way, has the same walk, and its
users the same workaround: hand the heavy fields over in `extra_body`.

So `messages` and `tools` travel in `extra_body`, the SDK's own channel for body fields (merged over
what its transform returns, JSON-encoded by it, a caller's own `extra_body` still winning), made
JSON-ready here as the transform would; `create` receives an empty list in their place, so every other
argument still passes the SDK's checks and transform and the keys keep their order. The server receives
the same JSON (tests/unit/test_chat_client.py compares the bodies). Other methods (`parse`, the
responses API) are the SDK's as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["chat_client_class", "json_ready"]

_MOVED = ("messages", "tools")  # the fields whose walk costs: every message, every tool's JSON schema


def json_ready(value: Any) -> Any:
    """`value` as the SDK's transform hands a chat request's messages and tools to its JSON encoder:
    unset values (`omit`, `NOT_GIVEN`) left out of mappings, pydantic models dumped as it dumps them,
    other iterables (tuples, generators) made lists."""
    import pydantic

    unset, model = _unset_types(), pydantic.BaseModel  # looked up once, not at every element

    def ready(item: Any) -> Any:
        if isinstance(item, Mapping):
            return {key: ready(inner) for key, inner in item.items() if not isinstance(inner, unset)}
        if isinstance(item, model):
            # third-party: the SDK's models name fields its requests leave out (`__api_exclude__`); most have none
            return item.model_dump(mode="json", exclude_unset=True, exclude=getattr(item, "__api_exclude__", None))
        if isinstance(item, Iterable) and not isinstance(item, (str, bytes, bytearray)):
            return [ready(inner) for inner in item]
        return item

    return ready(value)


@functools.cache
def _unset_types() -> tuple[type, ...]:
    """The SDK's markers of an argument not given: `NotGiven`, and `Omit` where it is public (openai 1.40 has
    only the first)."""
    import openai

    # third-party: `Omit` became a public name of the openai package after 1.40
    return tuple(marker for marker in (openai.NotGiven, getattr(openai, "Omit", None)) if marker is not None)


@functools.cache
def chat_client_class() -> type:
    """The `AsyncOpenAI` subclass (made on first use: openai is imported lazily)."""
    from openai import AsyncOpenAI
    from openai.resources.chat import AsyncChat, AsyncCompletions

    class ChatCompletions(AsyncCompletions):
        async def create(self, **kwargs: Any) -> Any:  # type: ignore[override]
            extra = kwargs.get("extra_body")
            moved = {name: kwargs[name] for name in _MOVED
                     if name in kwargs and not isinstance(kwargs[name], _unset_types())}
            if moved and (extra is None or isinstance(extra, Mapping)):
                kwargs["extra_body"] = {**{name: json_ready(value) for name, value in moved.items()}, **(extra or {})}
                kwargs.update(dict.fromkeys(moved, []))
            return await super().create(**kwargs)

    class Chat(AsyncChat):
        @functools.cached_property
        def completions(self) -> AsyncCompletions:
            return ChatCompletions(self._client)

    class ArtNbOpenAI(AsyncOpenAI):
        """`AsyncOpenAI`, with `chat.completions.create` sending messages and tools as described in
        art_nb.chat_client."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if "chat" in vars(self):  # third-party: openai 1.x before its lazy resources built them in __init__
                self.chat = Chat(self)

        @functools.cached_property
        def chat(self) -> AsyncChat:  # type: ignore[override]
            return Chat(self)

    return ArtNbOpenAI
