"""A local stand-in for the hosted W&B Training API, speaking the protocol `ServerlessBackend` uses.

It keeps models, checkpoints and training jobs in memory, checks the bearer key, and can be told to
fail: `fail(...)` queues HTTP errors (429 with Retry-After, 500s, even a 500 sent *after* the job
was created, the case idempotency keys exist for) and `fail_next_job(...)` makes a job end in
`training_failed`. Jobs advance one event per poll, so clients must really poll; event pages are
small, so clients must page. `FakeArtifacts` stands in for W&B Artifacts: a finished job writes the
next step's adapter files there, and an uploaded adapter (a hand-off) counts as a checkpoint — the
one assumption about the hosted service that only this fake backs (see docs/remote.md).

Every request is recorded in `requests` (method, path, headers, JSON body) for assertions.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from art_nb.local.server import RunningServer, start_server
from art_nb.secrets import Secret
from art_nb.serverless import ArtifactRef

_MODEL_NAME = re.compile(r"^wandb-artifact:///([^/]+)/([^/]+)/([^/:]+)(?::step(\d+))?$")


class FakeArtifacts:
    """Artifacts as directories: `{root}/{entity}/{project}/{name}/step{N}/`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.uploads: list[tuple[ArtifactRef, str | None, list[str]]] = []

    def dir(self, ref: ArtifactRef) -> Path:
        return self.root / ref.entity / ref.project / ref.name / f"step{ref.step}"

    def steps(self, entity: str, project: str, name: str) -> list[int]:
        base = self.root / entity / project / name
        return sorted(int(p.name[4:]) for p in base.glob("step*")) if base.is_dir() else []

    async def download(self, ref: ArtifactRef, directory: Path, key: Secret) -> None:
        source = self.dir(ref)
        if not source.is_dir():
            raise FileNotFoundError(f"artifact {ref.path} not found")
        for file in source.iterdir():
            shutil.copy2(file, directory / file.name)

    async def upload(self, ref: ArtifactRef, directory: Path, key: Secret, run_id: str | None) -> None:
        target = self.dir(ref)
        target.mkdir(parents=True, exist_ok=False)
        for file in directory.iterdir():
            shutil.copy2(file, target / file.name)
        self.uploads.append((ref, run_id, sorted(p.name for p in directory.iterdir())))


@dataclass
class _Failure:
    method: str
    path: str  # prefix of the request path
    status: int
    retry_after: str | None = None
    after_effect: bool = False  # handle the request, then answer with the error anyway
    message: str = "simulated failure"


@dataclass
class _Job:
    id: str
    model_id: str
    events: list[dict[str, Any]]
    revealed: int = 0
    body: dict[str, Any] = field(default_factory=dict)


class FakeWandbServer:
    def __init__(self, api_key: str, artifacts: FakeArtifacts, *, entity: str = "fake-entity",
                 page_size: int = 2) -> None:
        self.api_key, self.artifacts, self.entity, self.page_size = api_key, artifacts, entity, page_size
        self.models: dict[str, dict[str, Any]] = {}
        self.checkpoints: dict[str, dict[int, dict[str, float]]] = {}
        self.jobs: dict[str, _Job] = {}
        self.idempotency: dict[str, str] = {}
        self.failures: list[_Failure] = []
        self.requests: list[dict[str, Any]] = []
        self.logged: list[dict[str, Any]] = []
        self._fail_jobs: list[str] = []
        self._ids = itertools.count(1)
        self.server: RunningServer | None = None

    # ---- control -------------------------------------------------------------------------------

    def fail(self, method: str, path: str, status: int, *, times: int = 1, retry_after: str | None = None,
             after_effect: bool = False, message: str = "simulated failure") -> None:
        self.failures.extend(_Failure(method, path, status, retry_after, after_effect, message) for _ in range(times))

    def fail_next_job(self, error_message: str) -> None:
        self._fail_jobs.append(error_message)

    def calls(self, method: str, path_prefix: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["method"] == method and r["path"].startswith(path_prefix)]

    @property
    def base_url(self) -> str:
        assert self.server is not None
        return self.server.base_url  # ends in /v1, like the hosted one

    async def start(self) -> FakeWandbServer:
        self.server = await start_server(self.app(), host="127.0.0.1", port=0)
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()

    # ---- protocol ------------------------------------------------------------------------------

    def _steps(self, model_id: str) -> list[int]:
        model = self.models[model_id]
        uploaded = self.artifacts.steps(model["entity"], model["project"], model["name"])
        return sorted(set(self.checkpoints[model_id]) | set(uploaded))

    def _page(self, items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
        start = next((i + 1 for i, item in enumerate(items) if item["id"] == after), 0) if after else 0
        chunk = items[start:start + limit]
        return {"object": "list", "data": chunk, "has_more": start + limit < len(items)}

    async def _create_model(self, body: dict[str, Any]) -> JSONResponse:
        entity = body.get("entity") or self.entity
        for model in self.models.values():
            if (model["entity"], model["project"], model["name"]) == (entity, body["project"], body["name"]):
                if body.get("return_existing"):
                    return JSONResponse(model)
                return JSONResponse({"error": {"message": "model exists"}}, status_code=409)
        model_id = f"model-{next(self._ids)}"
        model = {"id": model_id, "entity": entity, "project": body["project"], "name": body["name"],
                 "base_model": body["base_model"], "run_id": f"run-{model_id}"}
        self.models[model_id], self.checkpoints[model_id] = model, {}
        return JSONResponse(model)

    def _create_job(self, body: dict[str, Any], key: str | None) -> dict[str, Any]:
        if key and key in self.idempotency:
            return {"id": self.idempotency[key]}
        job_id = f"job-{next(self._ids)}"
        n = sum(len(g["trajectories"]) for g in body["trajectory_groups"])
        events: list[dict[str, Any]] = [{"type": "training_started", "data": {"num_sequences": n}}]
        if self._fail_jobs:
            events += [{"type": "gradient_step", "data": {"loss": 0.5}},
                       {"type": "training_failed", "data": {"error_message": self._fail_jobs.pop(0)}}]
        else:
            events += [{"type": "gradient_step", "data": {"loss": 0.1 * (i + 1), "grad_norm": 1.0}} for i in range(n)]
            events.append({"type": "training_ended", "data": {}})
        for i, event in enumerate(events):
            event["id"] = f"{job_id}-ev{i}"
        self.jobs[job_id] = _Job(job_id, body["model_id"], events, body=body)
        if key:
            self.idempotency[key] = job_id
        return {"id": job_id}

    def _reveal(self, job: _Job) -> None:
        """One more event per poll; when the job ends, its checkpoint appears (and its adapter files)."""
        if job.revealed >= len(job.events):
            return
        job.revealed += 1
        if job.events[job.revealed - 1]["type"] == "training_ended":
            model = self.models[job.model_id]
            steps = self._steps(job.model_id)
            parent, step = (steps[-1] if steps else None), (steps[-1] + 1 if steps else 1)
            self.checkpoints[job.model_id][step] = {"loss": 0.1}
            ref = ArtifactRef(model["entity"], model["project"], model["name"], step)
            target = self.artifacts.dir(ref)
            target.mkdir(parents=True)
            parent_dir = None if parent is None else self.artifacts.dir(
                ArtifactRef(model["entity"], model["project"], model["name"], parent))
            if parent_dir is not None and parent_dir.is_dir():  # "training" starts from the previous adapter
                for file in parent_dir.iterdir():
                    if file.name != "trained_from.json":
                        shutil.copy2(file, target / file.name)
            else:
                (target / "adapter_config.json").write_text(json.dumps({"r": 8, "base_model": model["base_model"]}))
                (target / "adapter_model.safetensors").write_bytes(b"fake weights")
            (target / "trained_from.json").write_text(json.dumps({"job": job.id, "parent": parent}))

    def app(self) -> Starlette:
        async def guard(request: Request) -> tuple[dict[str, Any], JSONResponse | None]:
            body = json.loads(await request.body() or b"{}")
            self.requests.append({"method": request.method, "path": request.url.path, "time": time.monotonic(),
                                  "headers": dict(request.headers), "body": body, "query": dict(request.query_params)})
            if request.headers.get("authorization") != f"Bearer {self.api_key}":
                return body, JSONResponse({"error": {"message": "invalid API key"}}, status_code=401)
            return body, None

        def planned_failure(request: Request) -> _Failure | None:
            for failure in self.failures:
                if failure.method == request.method and request.url.path.startswith(failure.path):
                    self.failures.remove(failure)
                    return failure
            return None

        def failure_response(failure: _Failure) -> JSONResponse:
            headers = {"Retry-After": failure.retry_after} if failure.retry_after else {}
            return JSONResponse({"error": {"message": failure.message}}, status_code=failure.status, headers=headers)

        async def handle(request: Request) -> JSONResponse:
            body, denied = await guard(request)
            if denied is not None:
                return denied
            failure = planned_failure(request)
            if failure is not None and not failure.after_effect:
                return failure_response(failure)
            response = await route(request, body)
            return failure_response(failure) if failure is not None else response

        async def route(request: Request, body: dict[str, Any]) -> JSONResponse:
            path, method, query = request.url.path.removeprefix("/v1"), request.method, request.query_params
            parts = path.strip("/").split("/")
            if method == "POST" and path == "/preview/models":
                return await self._create_model(body)
            if method == "POST" and path == "/preview/training-jobs":
                if body.get("model_id") not in self.models:
                    return JSONResponse({"error": {"message": "unknown model"}}, status_code=404)
                return JSONResponse(self._create_job(body, request.headers.get("idempotency-key")))
            if method == "GET" and parts[:2] == ["preview", "training-jobs"] and parts[3:] == ["events"]:
                job = self.jobs.get(parts[2])
                if job is None:
                    return JSONResponse({"error": {"message": "unknown job"}}, status_code=404)
                self._reveal(job)
                visible = job.events[:job.revealed]
                return JSONResponse(self._page(visible, query.get("after"), int(query.get("limit", self.page_size))))
            if parts[:2] == ["preview", "models"] and len(parts) >= 3 and parts[2] in self.models:
                model_id = parts[2]
                if method == "POST" and parts[3:] == ["log"]:
                    self.logged.append(body)
                    return JSONResponse(None)
                if method == "GET" and parts[3:] == ["checkpoints"]:
                    items = [{"id": f"{model_id}-ck{s}", "step": s, "metrics": self.checkpoints[model_id].get(s, {})}
                             for s in self._steps(model_id)]
                    if query.get("order") == "desc":
                        items.reverse()
                    return JSONResponse(self._page(items, query.get("after"), int(query.get("limit", self.page_size))))
                if method == "DELETE" and parts[3:] == ["checkpoints"]:
                    model, existing = self.models[model_id], self._steps(model_id)
                    deleted = [s for s in body["steps"] if s in existing]
                    for s in deleted:
                        self.checkpoints[model_id].pop(s, None)
                        ref = ArtifactRef(model["entity"], model["project"], model["name"], s)
                        shutil.rmtree(self.artifacts.dir(ref), ignore_errors=True)
                    return JSONResponse({"deleted_count": len(deleted),
                                         "not_found_steps": [s for s in body["steps"] if s not in existing]})
            if method == "POST" and path == "/chat/completions":
                return self._completion(body)
            return JSONResponse({"error": {"message": f"no route {method} {path}"}}, status_code=404)

        return Starlette(routes=[Route("/{path:path}", handle, methods=["GET", "POST", "DELETE"])])

    def _completion(self, body: dict[str, Any]) -> JSONResponse:
        match = _MODEL_NAME.match(body.get("model", ""))
        if match is None:
            return JSONResponse({"error": {"message": "model must be wandb-artifact:///entity/project/name[:stepN]"}},
                                status_code=404)
        entity, project, name, step = match.groups()
        known = [m for m in self.models.values() if (m["entity"], m["project"], m["name"]) == (entity, project, name)]
        if not known or (step is not None and int(step) not in self._steps(known[0]["id"])):
            return JSONResponse({"error": {"message": f"model {body['model']} not found"}}, status_code=404)
        token_ids = [101, 102, 2]
        return JSONResponse({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "token_ids": token_ids,
                         "message": {"role": "assistant", "content": "blue"},
                         "logprobs": {"content": [{"token": str(t), "logprob": -0.5, "bytes": None, "top_logprobs": []}
                                                  for t in token_ids]}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
        })
