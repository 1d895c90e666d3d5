"""A stand-in for the hosted model `generate_scenarios` asks (OpenRouter's gpt-4.1-mini in ART): an
OpenAI-compatible `/v1/chat/completions` that answers every request with fixed scenario JSON.

A hosted model cannot be reached from the tests and SmolLM2-135M does not write valid scenario JSON,
so only the generator is faked; the requests are kept (`requests`, with the Authorization header)
so a test sees what `generate_scenarios` sent: ART's prompt, the tools, the JSON schema, the key.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from art_nb.local.server import RunningServer, start_server


class FakeScenarioGenerator:
    def __init__(self, scenarios: list[dict[str, Any]]) -> None:
        self.scenarios = scenarios
        self.requests: list[dict[str, Any]] = []
        self.server: RunningServer | None = None

    @property
    def base_url(self) -> str:
        assert self.server is not None, "start() the fake first"
        return self.server.base_url

    async def start(self) -> FakeScenarioGenerator:
        self.server = await start_server(Starlette(routes=[Route("/v1/chat/completions", self._complete,
                                                                  methods=["POST"])]))
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()

    async def _complete(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append({"body": body, "authorization": request.headers.get("authorization")})
        content = json.dumps({"scenarios": self.scenarios})
        return JSONResponse({"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": body["model"],
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": content}}]})
