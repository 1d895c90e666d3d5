"""The OpenAI-compatible ASGI app over a backend's engines: GET /v1/models, POST /v1/chat/completions
(`stream=True` too: server/stream.py), POST /v1/responses (OpenAI's Responses API, served as a chat
completion: server/responses.py, responses_out.py) and POST /v1/completions (legacy text
completions: server/completions.py).

The backend provides a `ModelRegistry` (which engine and adapter serve a model name) and its
`InferenceGate`; each request resolves its model and runs the pipeline inside the gate, so a
request that waited out a train step is answered by the new weights. A request whose client goes
away is cancelled rather than decoded to `max_tokens` for nobody.

Every request passes `art_nb.web.RequestGuard` (Host, Origin, JSON only, a body of at most
`max_body` bytes) and `BearerAuth` first. The work that grows with a request (parsing and validating
a large body, rendering its prompt, building a large response) runs in a worker thread, once per
request: a megabyte-sized message takes seconds to tokenise, 150,000 tools copied once per choice
held the loop for 30 s, and every other client (and the train step waiting at the gate) waits for the
event loop meanwhile. The counts that make it grow are bounded in `schema`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from art_nb.response_items import assistant_message
from art_nb.secrets import Secret
from art_nb.store import CheckpointError
from art_nb.web import MB, ApiError, BearerAuth, RequestGuard, error_handlers, read_json

from ..engines.base import Engine, Sample, SamplingParams
from .completions import CompletionRequest, completion_body, completion_chunks, completion_params, prompt_ids
from .gate import InferenceGate
from .pipeline import completion, generate, render_prompt, sampling_params
from .responses import ResponsesRequest, ResponseStore, chat_request
from .responses_out import response_body, response_events, sse
from .schema import ChatCompletionRequest, validation_error
from .stream import sse_events, stream_chunks

__all__ = ["CHAT_MAX_BODY", "ModelRegistry", "ServedModel", "create_app"]

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
# What a route computes, on the engine that serves its model: the prompt ids and how to sample
Prepare = Callable[[Engine], tuple[list[int], SamplingParams]]
CHAT_MAX_BODY = 8 * MB
_THREADED_RENDER_BYTES = 64 * 1024  # bodies larger than this are validated and rendered in a worker thread
_THREADED_RESPONSE_TOKENS = 4096  # responses with more tokens (x alternatives) than this are built in one too


@dataclass(frozen=True)
class ServedModel:
    """The engine that serves a model name, and the adapter to use (None: base weights)."""

    engine: Engine
    adapter: str | None
    name: str
    # Awaited once the request is answered: a step loaded on demand stays pinned until then (adapters.py)
    release: Callable[[], Awaitable[None]] | None = None


class ModelRegistry(Protocol):
    def resolve(self, model_name: str) -> ServedModel | Awaitable[ServedModel]:
        """The model to serve for `model_name` ("{name}" or "{name}@{step}"); KeyError if unknown.

        May be async (e.g. to load an old step's adapter on first use); it is called inside the
        gate, so such loading never overlaps a train step.
        """
        ...

    def list_models(self) -> list[str]: ...


def create_app(
    registry: ModelRegistry, gate: InferenceGate, api_key: str | Secret | None = None, *,
    allowed_origins: Iterable[str] = (), max_body: int = CHAT_MAX_BODY, body_timeout: float = 120.0,
) -> Starlette:
    """The ASGI app over `registry`'s engines; with `api_key`, every request must carry it as a
    bearer token. `allowed_origins`: browser origins let in cross-site (see `RequestGuard`)."""
    created = int(time.time())

    async def list_models(request: Request) -> JSONResponse:
        data = [{"id": name, "object": "model", "created": created, "owned_by": "art_nb"}
                for name in registry.list_models()]
        return JSONResponse({"object": "list", "data": data})

    responses_kept = ResponseStore()  # for previous_response_id (server/responses.py)

    async def run(request: Request, model: str, prepare: Prepare, threaded: bool
                  ) -> tuple[ServedModel, list[int], list[Sample]]:
        """Resolve `model`, compute its prompt and parameters (`prepare`) and generate, all inside the
        gate (a request that waited out a train step gets the new weights); cancelled if the client leaves."""

        async def serve() -> tuple[ServedModel, list[int], list[Sample]]:
            async with gate.serving():
                try:
                    served = registry.resolve(model)
                    if inspect.isawaitable(served):
                        served = await served
                except KeyError:
                    raise ApiError(
                        404, f"model {model!r} is not served here; see GET /v1/models",
                        "model_not_found", param="model",
                    ) from None
                except CheckpointError as exc:  # a step whose checkpoint is damaged; the message offers another
                    raise ApiError(409, str(exc), "checkpoint_damaged", param="model") from None
                try:
                    engine = served.engine
                    prompt_ids, params = await asyncio.to_thread(prepare, engine) if threaded else prepare(engine)
                    return served, prompt_ids, await generate(engine, served.adapter, prompt_ids, params)
                finally:
                    if served.release is not None:
                        await asyncio.shield(served.release())

        return await _unless_disconnected(request, serve())

    async def chat_completions(request: Request) -> Response:
        req, threaded = await _request(request, ChatCompletionRequest)

        def prepare(engine: Engine) -> tuple[list[int], SamplingParams]:
            prompt_ids = render_prompt(engine.tokenizer, req)
            return prompt_ids, sampling_params(req, len(prompt_ids), engine.max_context, engine.tokenizer)

        served, prompt_ids, samples = await run(request, req.model, prepare, threaded)
        return await _built(threaded, samples, req.top_logprobs, _response, served, prompt_ids, samples, req)

    async def responses(request: Request) -> Response:
        req, threaded = await _request(request, ResponsesRequest)
        chat, conversation = (await asyncio.to_thread(chat_request, req, responses_kept) if threaded
                              else chat_request(req, responses_kept))

        def prepare(engine: Engine) -> tuple[list[int], SamplingParams]:
            prompt_ids = render_prompt(engine.tokenizer, chat)
            return prompt_ids, sampling_params(chat, len(prompt_ids), engine.max_context, engine.tokenizer)

        def respond(served: ServedModel, prompt_ids: list[int], samples: list[Sample]) -> Response:
            body = response_body(completion(served.name, prompt_ids, samples, chat, served.engine.tokenizer), req)
            if req.store is not False:
                responses_kept.put(body["id"], [*conversation, assistant_message(body["output"])])
            if req.stream:
                return StreamingResponse(sse(response_events(body)), media_type="text/event-stream")
            return _json(body)

        served, prompt_ids, samples = await run(request, req.model, prepare, threaded)
        return await _built(threaded, samples, chat.top_logprobs, respond, served, prompt_ids, samples)

    async def completions(request: Request) -> Response:
        req, threaded = await _request(request, CompletionRequest)

        def prepare(engine: Engine) -> tuple[list[int], SamplingParams]:
            ids = prompt_ids(engine.tokenizer, req)
            return ids, completion_params(req, len(ids), engine.max_context)

        def respond(served: ServedModel, prompt: list[int], samples: list[Sample]) -> Response:
            body = completion_body(served.name, prompt, samples, req, served.engine.tokenizer)
            if req.stream:
                usage = bool((req.stream_options or {}).get("include_usage"))
                return StreamingResponse(sse_events(completion_chunks(body, usage)), media_type="text/event-stream")
            return _json(body)

        served, prompt, samples = await run(request, req.model, prepare, threaded)
        return await _built(threaded, samples, req.logprobs, respond, served, prompt, samples)

    return Starlette(
        routes=[
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ],
        middleware=[
            Middleware(RequestGuard, allowed_origins=allowed_origins, max_body=max_body, body_timeout=body_timeout),
            Middleware(BearerAuth, key=api_key or None),
        ],
        exception_handlers=error_handlers(),
    )


async def _request(request: Request, model: type[M]) -> tuple[M, bool]:
    """The body validated as `model`, and whether the request is large enough that its work (validating,
    rendering, building the response) belongs in a worker thread."""
    body = await read_json(request)
    threaded = len(await request.body()) > _THREADED_RENDER_BYTES  # read once, kept by the request
    return (await asyncio.to_thread(_validated, model, body) if threaded else _validated(model, body)), threaded


def _validated(model: type[M], body: object) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


async def _built(threaded: bool, samples: list[Sample], top: int | None, build: Callable[..., Response],
                 *args: Any) -> Response:
    """`build(*args)`, in a worker thread when the request or its answer is large."""
    size = sum(len(s.token_ids) for s in samples) * (1 + (top or 0))
    if threaded or size > _THREADED_RESPONSE_TOKENS:
        return await asyncio.to_thread(build, *args)
    return build(*args)


def _json(body: dict[str, Any]) -> Response:
    return Response(json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(),
                    media_type="application/json")


def _response(served: ServedModel, prompt_ids: list[int], samples: list[Sample], req: ChatCompletionRequest) -> Response:
    """The HTTP response: the completion body, serialised here (JSON or, for `stream`, the SSE chunks)."""
    body = completion(served.name, prompt_ids, samples, req, served.engine.tokenizer)
    if req.stream:  # generated whole, sent as chunks (server/stream.py)
        usage = bool((req.stream_options or {}).get("include_usage"))
        return StreamingResponse(sse_events(stream_chunks(body, usage)), media_type="text/event-stream")
    return _json(body)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client goes away first.

    An interrupted gather closes its connections; without this the engine would go on decoding
    every orphaned request to `max_tokens` (or hold it at the gate through a train step), delaying
    whatever the user runs next.
    """
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():  # the client left, or this handler itself is being cancelled
            task.cancel()
    if task.cancelled():
        raise ApiError(499, "the client closed the connection", "client_closed_request")
    return task.result()


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body has been read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
