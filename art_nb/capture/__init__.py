"""Capture: the model calls a rollout makes, recorded with the server's exact token ids.

Inside a scope (`with art.Trajectory() as t:`, `await art.trajectory(coro)`), every POST to a
`/chat/completions`, `/responses` or `/completions` endpoint made through httpx (so the openai SDK,
LangChain's and the Agents SDK's clients too), requests or aiohttp is recorded into the innermost
scope's trajectory, as a `CapturedCall`, when the response carries `prompt_token_ids` (art_nb's
endpoint does; so does vLLM's when asked to return token ids). Everything else passes untouched.
`no_capture()` excludes a block.

How the pieces split: `scope` holds the context variables (which trajectory records, whether
recording is off); `calls` is the record (pydantic, crosses the wire with the trajectory); `body`
turns a request and its response bytes (JSON or server-sent events) into a record; `hooks` patch
the HTTP libraries, each once, and only libraries already imported. Headers are never read, so an
Authorization header is never recorded or logged.

Which tokens train, and when a recording is refused, is decided by `art_nb.grpo.captured`.
"""

from __future__ import annotations

from .calls import CapturedCall, CapturedChoice
from .context import capturing, no_capture

__all__ = ["CapturedCall", "CapturedChoice", "capturing", "no_capture"]
