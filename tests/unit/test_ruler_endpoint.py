"""RULER's judges over the wire: the real openai client against a local server speaking OpenAI's
chat-completions protocol (canned replies; the request bodies the client sent are asserted), an art_nb
Model as judge, and the litellm path through a stand-in module."""

from __future__ import annotations

import json
import math
import sys
import types

import pytest
from aiohttp import web

import art_nb as art
from art_nb.rewards import ruler, ruler_score_group

CONVOS = [[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": answer}] for answer in ("4", "5")]


class OpenAIStub:
    """POST /v1/chat/completions: records (headers, body) and answers with `reply(body)` choices."""

    def __init__(self, reply) -> None:
        self.reply, self.requests = reply, []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append((dict(request.headers), body))
        choices = [{"index": i, "finish_reason": "stop", "logprobs": logprobs,
                    "message": {"role": "assistant", "content": content}}
                   for i, (content, logprobs) in enumerate(self.reply(body))]
        return web.json_response({"id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
                                  "choices": choices})


@pytest.fixture
async def stub():
    servers = []

    async def start(reply) -> tuple[OpenAIStub, str]:
        server = OpenAIStub(reply)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", server.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        servers.append(runner)
        port = runner.addresses[0][1]
        return server, f"http://127.0.0.1:{port}/v1"

    yield start
    for runner in servers:
        await runner.cleanup()


@pytest.fixture
def no_litellm(monkeypatch):
    monkeypatch.setitem(sys.modules, "litellm", None)  # `import litellm` raises ImportError
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


async def test_hosted_judge_by_name_through_the_openai_protocol(stub, no_litellm, tmp_path):
    verdict = {"scores": [{"trajectory_id": "1", "explanation": "right", "score": 1.0},
                          {"trajectory_id": "2", "explanation": "wrong", "score": 0.0}]}
    server, url = await stub(lambda body: [(json.dumps(verdict), None)])
    group = art.TrajectoryGroup(art.Trajectory(messages_and_choices=c) for c in CONVOS)
    scored = await ruler_score_group(group, "openai/gpt-4o-mini",
                                     {"base_url": url, "api_key": "sk-test", "temperature": 0.3},
                                     cache_dir=tmp_path)
    assert [t.reward for t in scored] == [1.0, 0.0]
    headers, body = server.requests[0]
    assert headers["Authorization"] == "Bearer sk-test"
    assert body["model"] == "gpt-4o-mini" and body["temperature"] == 0.3  # routing prefix dropped
    assert body["response_format"]["type"] == "json_schema" and "api_key" not in body and "base_url" not in body
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert "<context>" in body["messages"][1]["content"] and '<trajectory id="2">' in body["messages"][1]["content"]


async def test_hosted_judge_rating_reads_top_logprobs(stub, no_litellm, monkeypatch, tmp_path):
    def reply(body):
        probs = {"8": 0.5, "6": 0.25} if "trajectory 1" in body["messages"][-1]["content"] else {"2": 0.5}
        top = [{"token": t, "logprob": math.log(p), "bytes": None} for t, p in probs.items()]
        top.append({"token": " The", "logprob": math.log(0.2), "bytes": None})
        return [("8", {"content": [{"token": "8", "logprob": -0.7, "bytes": None, "top_logprobs": top}]})]
    server, url = await stub(reply)
    monkeypatch.setenv("OPENAI_BASE_URL", url)  # the endpoint from the environment
    scores = await ruler(CONVOS, "hosted_vllm/judge", method="rating", cache_dir=tmp_path)
    assert [s.score for s in scores] == pytest.approx([(8 * 0.5 + 6 * 0.25) / 0.75 / 10, 0.2])
    assert {b["model"] for _, b in server.requests} == {"judge"}
    assert all(b["logprobs"] is True and b["top_logprobs"] == 20 and b["n"] == 1 for _, b in server.requests)


async def test_a_trainable_model_judges_with_its_base_weights(stub, tmp_path):
    server, url = await stub(lambda body: [(str(r), None) for r in (7, 9)][: body["n"]])
    model = art.TrainableModel(name="agent", project="p", base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
                               inference_base_url=url, inference_api_key="local-key")
    scores = await ruler(CONVOS, model, cache_dir=tmp_path, rating_samples=2)
    assert [s.score for s in scores] == [0.8, 0.8]
    assert len(server.requests) == 2
    for headers, body in server.requests:  # rating mode: the base model's hub name, sampled ratings
        assert body["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and body["n"] == 2
        assert body["top_logprobs"] == 20 and body["logprobs"] is True  # read where the server returns them
        assert headers["Authorization"] == "Bearer local-key"


async def test_litellm_is_used_when_installed(monkeypatch, tmp_path):
    calls = []

    async def acompletion(**kwargs):
        calls.append(kwargs)
        return {"choices": [{"message": {"content": '{"scores": [{"score": 0.25}, {"score": 0.75}]}'}}]}

    monkeypatch.setitem(sys.modules, "litellm", types.SimpleNamespace(acompletion=acompletion))
    scores = await ruler(CONVOS, "anthropic/claude-x", {"max_tokens": 99}, cache_dir=tmp_path)
    assert [s.score for s in scores] == [0.25, 0.75]
    (call,) = calls
    assert call["model"] == "anthropic/claude-x" and call["max_tokens"] == 99 and call["caching"] is False
    assert call["response_format"]["type"] == "json_schema" and len(call["messages"]) == 2
