"""An OpenAI-compatible chat endpoint over any `Engine`, and a runner for it inside the kernel.

The rollout's OpenAI client talks to this app; the app turns messages into prompt ids with the
model's chat template, asks the engine for samples, and answers in the ChatCompletion format plus
what training needs and OpenAI does not give:

- every choice carries `token_ids`, the completion ids exactly as sampled (EOS included when the
  engine sampled it), and the response carries `prompt_token_ids`;
- `logprobs.content[*].logprob` are the engine's temperature-1 logprobs of those ids.

Stop strings are applied here, on the decoded text: the content is cut *before* the first stop
string, but `token_ids` keep everything sampled up to and including the token that completed it,
because the trainer trains on ids, not on text, and those ids are what the policy produced.

The `InferenceGate` lets the backend pause serving during a train step: requests that arrive wait
(they never fail), and `pause()` returns once the requests already inside the engine have drained.

Not supported, with a 400 that says so: streaming, `top_logprobs > 0`, `min_tokens > 0`,
`tool_choice` other than "auto"/"none", penalties, non-text content parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import json
import socket
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

import uvicorn
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .engines.base import (
    ContextTooLongError,
    Engine,
    EngineDeadError,
    EngineError,
    GenerationRequest,
    Sample,
    SamplingParams,
)
from .toolcalls import parse_tool_calls
from .trajectory import template_message

__all__ = [
    "ServedModel",
    "ModelRegistry",
    "InferenceGate",
    "create_app",
    "RunningServer",
    "start_server",
]

T = TypeVar("T")

_MAX_N = 256
_MIN_LOGPROB = -9999.0


# --- what the backend provides ------------------------------------------------------------------


@dataclass(frozen=True)
class ServedModel:
    """The engine that serves a model name, and the adapter to use (None: base weights)."""

    engine: Engine
    adapter: str | None
    name: str


class ModelRegistry(Protocol):
    def resolve(self, model_name: str) -> ServedModel | Awaitable[ServedModel]:
        """The model to serve for `model_name` ("{name}" or "{name}@{step}"); KeyError if unknown.

        May be async (e.g. to load an old step's adapter on first use); it is called inside the
        gate, so such loading never overlaps a train step.
        """
        ...

    def list_models(self) -> list[str]: ...


class InferenceGate:
    """Pause/resume for inference, so a train step can have the accelerator to itself.

    Use from one event loop (the backend's). `serving()` wraps each request's engine work; while
    paused, new requests wait inside `serving()` until `resume()`.
    """

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def wait_serving(self) -> None:
        """Return when the gate is open."""
        # Loop: a pause() between set() and this waiter running must keep it waiting.
        while not self._open.is_set():
            await self._open.wait()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        await self.wait_serving()
        self._in_flight += 1  # no await since the check above, so a pause cannot slip in between
        self._drained.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()

    async def pause(self) -> None:
        """Stop admitting requests and wait until those in flight have finished."""
        self._open.clear()
        await self._drained.wait()

    def resume(self) -> None:
        self._open.set()


# --- errors -------------------------------------------------------------------------------------


class _APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry = retry

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        # OpenAI clients retry 5xx answers unless told not to; retrying a dead engine only delays the error.
        headers = None if self.retry is None else {"x-should-retry": "true" if self.retry else "false"}
        return JSONResponse({"error": error}, status_code=self.status, headers=headers)


def _validation_error(exc: ValidationError) -> _APIError:
    """One 400 naming every bad field ("messages.0.role: Input should be ...")."""
    parts, first_param = [], None
    for err in exc.errors():
        param = ".".join(str(p) for p in err["loc"]) or None
        first_param = first_param or param
        message = err["msg"].removeprefix("Value error, ")
        parts.append(f"{param}: {message}" if param else message)
    return _APIError(400, "; ".join(parts), param=first_param)


# --- the request body ---------------------------------------------------------------------------


class _Function(BaseModel):
    name: str
    arguments: str = "{}"


class _ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: _Function


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # extra keys go through to the chat template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
            return "".join(part["text"] for part in content)
        return content

    @model_validator(mode="after")
    def _role_fields(self) -> _Message:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs 'tool_call_id' (the id of the call it answers)")
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a {self.role} message needs 'content'")
        return self

    def for_template(self) -> dict[str, Any]:
        """The dict a chat template expects: content a string, tool-call arguments objects (as HF
        templates expect; a JSON string would be rendered quoted)."""
        return template_message(self.model_dump(exclude_none=True))


class _FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class _Tool(BaseModel):
    type: Literal["function"]
    function: _FunctionSpec


class ChatCompletionRequest(BaseModel):
    """The body of POST /v1/chat/completions. Unknown fields are ignored, as OpenAI clients send
    several (user, metadata, store, stream_options) that do not change what is sampled."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[_Message] = Field(min_length=1)
    n: int = Field(1, ge=1, le=_MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    seed: int | None = None
    tools: list[_Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("top_logprobs")
    @classmethod
    def _no_alternatives(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("only 0 is supported: the engine returns the logprob of the sampled token only")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value not in (None, "auto", "none"):
            raise ValueError('only "auto" and "none" are supported; describe the tool to call in the prompt')
        return value

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("streaming is not supported yet; call without stream=True")
        return value

    @field_validator("min_tokens")
    @classmethod
    def _no_min_tokens(cls, value: int) -> int:
        if value:
            raise ValueError("only 0 is supported")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("penalties are not supported: they would skew the logprobs training uses")
        return value

    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools to show the model; tool_choice="none" hides them (and no calls are parsed)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


# --- the pipeline: render, sample, post-process -------------------------------------------------


def _render_prompt(tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
    import jinja2  # a dependency of transformers' chat templating

    messages = [m.for_template() for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=req.offered_tools(), add_generation_prompt=True, tokenize=False
        )
    except jinja2.TemplateError as exc:  # templates raise for conversations they cannot render
        raise _APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
    # The template already wrote BOS and the role markers; tokenising must not add them again.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _sampling_params(req: ChatCompletionRequest, prompt_len: int, max_context: int) -> SamplingParams:
    room = max_context - prompt_len
    max_tokens = req.max_completion_tokens or req.max_tokens or max(room, 1)  # default: fill the context
    if max_tokens > room:
        raise _APIError(
            400,
            f"the model's context holds {max_context} tokens, but the prompt has {prompt_len} and "
            f"{max_tokens} more were requested; shorten the messages or lower max_tokens",
            param="messages",
            code="context_length_exceeded",
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,  # 0 means greedy
        top_p=1.0 if req.top_p is None else req.top_p,
        n=req.n,
        stop=tuple(req.stop or ()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        seed=req.seed,
        ignore_eos=req.ignore_eos,
    )


async def _generate(served: ServedModel, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
    try:
        return await served.engine.generate(GenerationRequest(prompt_ids, params, adapter=served.adapter))
    except ContextTooLongError as exc:
        raise _APIError(400, str(exc), param="messages", code="context_length_exceeded") from exc
    except EngineDeadError as exc:
        raise _APIError(503, str(exc), type="server_error", code="engine_dead", retry=False) from exc
    except EngineError as exc:
        raise _APIError(500, str(exc), type="server_error", code="engine_error") from exc


def _cut_at_stop(tokenizer: Any, sample: Sample, stops: list[str]) -> tuple[str, list[int], list[float], bool]:
    """(content, token_ids, logprobs, stopped) after the first stop string completes.

    The ids kept are the shortest prefix whose text contains a stop string (found by bisection:
    containing a stop string is monotone in the prefix length); the content is that text cut
    where the earliest stop string in it begins.
    """
    ids, logprobs = sample.token_ids, sample.logprobs
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not any(stop in text for stop in stops):
        return text, ids, logprobs, False
    lo, hi = 0, len(ids)  # invariant: decode(ids[:hi]) contains a stop string; decode(ids[:lo]) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if any(stop in tokenizer.decode(ids[:mid], skip_special_tokens=True) for stop in stops):
            hi = mid
        else:
            lo = mid
    text = tokenizer.decode(ids[:hi], skip_special_tokens=True)
    cut = min(text.find(stop) for stop in stops if stop in text)
    return text[:cut], ids[:hi], logprobs[:hi], True


def _choice(index: int, sample: Sample, req: ChatCompletionRequest, tokenizer: Any) -> dict[str, Any]:
    content, ids, logprobs, stopped = _cut_at_stop(tokenizer, sample, req.stop or [])
    finish_reason = "stop" if stopped else sample.finish_reason
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if req.offered_tools():
        content, calls = parse_tool_calls(content)
        if calls:
            message = {"role": "assistant", "content": content or None, "tool_calls": calls}
            if finish_reason == "stop":
                finish_reason = "tool_calls"
    choice: dict[str, Any] = {
        "index": index,
        "message": message,
        "finish_reason": finish_reason,
        "logprobs": None,
        "token_ids": ids,
    }
    if req.logprobs:
        texts = _token_texts(tokenizer)
        entries = []
        for token_id, logprob in zip(ids, logprobs, strict=True):
            text = texts.get(token_id)
            if text is None:
                # Per-token text: a token holding part of a UTF-8 character decodes to U+FFFD.
                token = tokenizer.decode([token_id])
                text = texts[token_id] = (token, list(token.encode()))
            entries.append({
                "token": text[0],
                "logprob": max(logprob, _MIN_LOGPROB),  # JSON has no -inf
                "bytes": text[1],
                "top_logprobs": [],
            })
        choice["logprobs"] = {"content": entries, "refusal": None}
    return choice


_TOKEN_TEXTS: weakref.WeakKeyDictionary[Any, dict[int, tuple[str, list[int]]]] = weakref.WeakKeyDictionary()


def _token_texts(tokenizer: Any) -> dict[int, tuple[str, list[int]]]:
    """Per-token text and bytes, decoded once per tokenizer: one `decode` call per token of every
    response was most of the server's time per request (all of it on the event loop, beside vLLM)."""
    texts = _TOKEN_TEXTS.get(tokenizer)
    if texts is None:
        texts = _TOKEN_TEXTS[tokenizer] = {}
    return texts


# --- the app ------------------------------------------------------------------------------------


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
        raise _APIError(499, "the client closed the connection", code="client_closed_request")
    return task.result()


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body has been read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _BearerAuth:
    """Require `Authorization: Bearer <key>` on every HTTP request (compared in constant time)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = _APIError(401, "invalid or missing API key", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(registry: ModelRegistry, gate: InferenceGate, api_key: str | None = None) -> Starlette:
    """The ASGI app: GET /v1/models and POST /v1/chat/completions over `registry`'s engines."""
    created = int(time.time())

    async def list_models(request: Request) -> JSONResponse:
        data = [{"id": name, "object": "model", "created": created, "owned_by": "art_nb"}
                for name in registry.list_models()]
        return JSONResponse({"object": "list", "data": data})

    async def chat_completions(request: Request) -> JSONResponse:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _APIError(400, f"the request body is not valid JSON: {exc}") from exc
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise _validation_error(exc) from exc

        async def serve() -> tuple[ServedModel, list[int], list[Sample]]:
            # Resolve inside the gate: a request that waited out a train step gets the new weights.
            async with gate.serving():
                try:
                    served = registry.resolve(req.model)
                    if inspect.isawaitable(served):
                        served = await served
                except KeyError:
                    raise _APIError(
                        404, f"model {req.model!r} is not served here; see GET /v1/models",
                        param="model", code="model_not_found",
                    ) from None
                prompt_ids = _render_prompt(served.engine.tokenizer, req)
                params = _sampling_params(req, len(prompt_ids), served.engine.max_context)
                return served, prompt_ids, await _generate(served, prompt_ids, params)

        served, prompt_ids, samples = await _unless_disconnected(request, serve())
        tokenizer = served.engine.tokenizer
        choices = [_choice(i, sample, req, tokenizer) for i, sample in enumerate(samples)]
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        return JSONResponse({
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": served.name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
            "prompt_token_ids": prompt_ids,
        })

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, _APIError)
        return exc.response()

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return _APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette still re-raises after this, so the traceback reaches the server log.
        return _APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    return Starlette(
        routes=[
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        ],
        middleware=[Middleware(_BearerAuth, api_key=api_key)] if api_key else [],
        exception_handlers={_APIError: api_error, HTTPException: http_error, Exception: unexpected},
    )


# --- running it inside the current event loop ---------------------------------------------------


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signal handlers alone: in a notebook kernel, Ctrl-C/interrupt
    belongs to the user's cell, not to the endpoint."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


class RunningServer:
    """A server started by `start_server`. `base_url` ends in /v1, ready for `AsyncOpenAI(base_url=...)`."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None], host: str, port: int) -> None:
        self._server, self._task = server, task
        self.port = port
        self.base_url = f"http://{host}:{port}/v1"

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, let open requests finish (up to `timeout` s), then close. Idempotent."""
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            await self._task


async def start_server(
    app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *, startup_timeout: float = 10.0
) -> RunningServer:
    """Serve `app` with uvicorn as a task on the running event loop; return once it accepts connections.

    `port=0` picks a free port: the socket is bound here, so the port is known before uvicorn runs
    and no other process can take it in between.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio only sets TCP_NODELAY on sockets whose proto says TCP, and without
    # it every small response waits ~40 ms for Nagle + delayed ACK (measured: 45 ms -> 8 ms a request).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    # log_config=None: do not reconfigure the user's logging; lifespan off: the app has none.
    config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=5,
        # Rollout clients sit idle on pooled connections while a step trains; uvicorn's default 5 s
        # keep-alive closed them under the clients, whose next request then failed (seen on the H200).
        timeout_keep_alive=3600,
    )
    server = _QuietServer(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # raises what stopped it
            raise RuntimeError("the server exited during startup")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"the server did not start within {startup_timeout} s")
        await asyncio.sleep(0.01)
    return RunningServer(server, task, host, port)
