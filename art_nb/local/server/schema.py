"""The body of POST /v1/chat/completions, validated at the door.

Every field the endpoint cannot honour faithfully is refused with a 400 that says what to send
instead (`min_tokens > 0`, penalties, `logit_bias`, non-text content parts), rather than accepted
and silently ignored: a rollout that asked for them would otherwise train on samples it did not mean
to draw. A JSON `response_format` and a `tool_choice` of "required" or a named function are enforced
by constrained decoding (`constrain.py`); this module checks their shape.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from art_nb.trajectories import template_message
from art_nb.web import ApiError

__all__ = ["MAX_STOP", "MAX_STOP_CHARS", "MAX_TOOLS", "ChatCompletionRequest", "validation_error"]

_MAX_N = 256
# Work per request grows with these: the prompt renders every tool, and the engine checks every stop
# string after every token, decoding a tail as long as the longest one (per row of a batch other clients
# share: 1.3 ms a token at 1,024 characters, 0.3 ms at 256, SmolLM2's tokenizer). Unbounded, 150,000 tools
# held the event loop for 30 s and 700,000 stop strings slowed another client's request from 0.4 s to
# 17.8 s. Far above real use: OpenAI's API takes 128 tools and 4 stop strings.
MAX_TOOLS = 512
MAX_STOP = 64
MAX_STOP_CHARS = 256


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
    several (user, metadata, store) that do not change what is sampled."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(max_length=512)
    messages: list[_Message] = Field(min_length=1)
    n: int = Field(1, ge=1, le=_MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = Field(None, description=f"at most {MAX_STOP} strings of {MAX_STOP_CHARS} characters")
    stop_token_ids: list[int] | None = Field(None, max_length=1024)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch and vLLM seed generators take
    tools: list[_Tool] | None = Field(None, description=f"at most {MAX_TOOLS}")
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: a forced "required" reply holds exactly one call
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None  # {"include_usage": true} adds a usage chunk
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    # Special-token text in content is plain text unless this is set (see art_nb.local.server.prompt).
    allow_special_tokens_in_content: bool = False

    @field_validator("model")
    @classmethod
    def _step_suffix(cls, model: str) -> str:
        _, at, step = model.rpartition("@")
        if at and not (step.isascii() and step.isdigit()):
            raise ValueError(f"after '@' comes a step number in ASCII digits, like 'name@3' (got {step[:20]!r})")
        return model

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids and not all(0 <= i < 2**31 for i in ids):
            raise ValueError("token ids are integers from 0 to 2**31 - 1")
        return ids

    @field_validator("stop", "tools", mode="before")
    @classmethod
    def _bounded_count(cls, value: Any, info: ValidationInfo) -> Any:
        limit = MAX_STOP if info.field_name == "stop" else MAX_TOOLS  # counted before each item is validated
        if isinstance(value, list) and len(value) > limit:
            raise ValueError(f"at most {limit} are accepted, got {len(value):,}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):  # `logprobs` is declared first, so it is validated already
            raise ValueError("needs logprobs=true, as in OpenAI's API")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if isinstance(value, dict):
            name = (value.get("function") or {}).get("name") if value.get("type") == "function" else None
            if not isinstance(name, str) or not name:
                raise ValueError('a named tool choice is {"type": "function", "function": {"name": "<a tool>"}}')
        elif value not in (None, "auto", "none", "required"):
            raise ValueError('use "auto", "none", "required" or {"type": "function", "function": {"name": ...}}')
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

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value and any(value.values()):
            raise ValueError("not supported: a bias would skew the logprobs training uses")
        return value

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = (value or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"type {kind!r} is not served; use 'text', 'json_object' or 'json_schema'")
        spec = (value or {}).get("json_schema", {}) if kind == "json_schema" else {}
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError('json_schema is {"name": ..., "schema": {<a JSON schema object>}, "strict": true}')
        return value

    @property
    def parses_tool_calls(self) -> bool:
        """Whether tools are offered, so the reply's tool calls are parsed (tool_choice="none" hides them)."""
        return bool(self.tools) and self.tool_choice != "none"

    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools to show the model (a copy of each: call once per request, it grows with the body)."""
        if not self.parses_tool_calls:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools or ()]


def validation_error(exc: ValidationError, under: str = "") -> ApiError:
    """One 400 naming every bad field ("messages.0.role: Input should be ..."), as a field of `under`
    when given (a register's "config.cpu_threads: Input should be less than or equal to 1024")."""
    parts, first_param = [], None
    for err in exc.errors():
        param = ".".join(str(p) for p in (under, *err["loc"]) if p != "") or None
        first_param = first_param or param
        message = err["msg"].removeprefix("Value error, ")
        parts.append(f"{param}: {message}" if param else message)
    return ApiError(400, "; ".join(parts), param=first_param)
