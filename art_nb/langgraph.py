"""`art_nb.langgraph`: ART's LangGraph helpers, `wrap_rollout` and `init_chat_model`, over capture.

ART logs a LangGraph agent's model calls through a wrapper around the chat model, then rebuilds the
conversation from that log, re-tokenised, when the rollout ends. art_nb needs no wrapper: every
call a LangChain `ChatOpenAI` makes goes through httpx, and capture records each one with the
token ids the engine sampled (art_nb.capture). So the two helpers are thin:

- `wrap_rollout(model, rollout)` runs the rollout inside a capture scope and hands the recorded
  calls to the trajectory it returns (ART's rollouts build and return one), or, if it returns
  nothing, returns the scope's own (where `art.current_trajectory()` wrote). Training then takes
  exactly the ids the engine sampled, whatever LangGraph did to the messages in between.
- `init_chat_model()` is a plain `ChatOpenAI` pointed at the model's endpoint (temperature 1.0, as
  ART's), so LangChain's own `bind_tools`, `with_structured_output`, retries and streaming apply.

Porting ART code is changing the import. Where art_nb differs: the chat model is LangChain's own,
not ART's `LoggingLLM` (whose `with_structured_output` binds the schema as a tool and reads the
first tool call; LangChain's asks the endpoint for a JSON schema instead); `model_provider`,
`configurable_fields` and `config_prefix` are accepted and ignored, as ART ignores them; nothing is
written under `.art/langgraph/`. LangChain loads only when `init_chat_model` is first called.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ParamSpec

from .capture import context as capture_scope
from .model import Model
from .trajectories import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from langchain_openai import ChatOpenAI

__all__ = ["init_chat_model", "wrap_rollout"]

P = ParamSpec("P")

_current_model: contextvars.ContextVar[Model | None] = contextvars.ContextVar("art_nb_langgraph_model",
                                                                              default=None)


def wrap_rollout(model: Model, fn: Callable[P, Awaitable[Trajectory | None]]) -> Callable[P, Awaitable[Trajectory]]:
    """`fn` as a rollout whose model calls become its trajectory (ART's `wrap_rollout`).

    The returned coroutine function runs `fn(*args, **kwargs)` inside a capture scope, with `model`
    as the one `init_chat_model()` points at. The trajectory `fn` returns receives the calls made
    to art_nb's endpoint: they replace any messages it wrote by hand, as ART's log replaces them.
    If `fn` returns None, the scope's own trajectory is returned (set its reward through
    `art.current_trajectory()`). Each call runs in its own scope, so a group of them, gathered
    concurrently, never mixes calls.
    """
    if not isinstance(model, Model):
        raise TypeError(f"wrap_rollout(model, fn): model is a {type(model).__name__}; pass the art_nb Model the "
                        "rollout's chat model calls (the one registered with a backend)")
    if not callable(fn):
        raise TypeError(f"wrap_rollout(model, fn): fn is a {type(fn).__name__}; pass the async rollout function")

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> Trajectory:
        token = _current_model.set(model)
        scope = Trajectory()
        try:
            with scope:
                result = await fn(*args, **kwargs)
            outcome = _handed_over(scope, result)
        except BaseException:
            _replace_in_group(scope, None)
            raise
        finally:
            _current_model.reset(token)
        _replace_in_group(scope, outcome)
        return outcome

    return wrapper


def _handed_over(scope: Trajectory, result: Any) -> Trajectory:
    """The trajectory to return: the rollout's own with the scope's calls, or the scope itself."""
    if result is None or result is scope:
        return scope
    if not isinstance(result, Trajectory):
        raise TypeError(f"the wrapped rollout returned a {type(result).__name__}; return an art_nb Trajectory "
                        "(or nothing, to get the one `art.current_trajectory()` returns inside it)")
    if scope.exchanges:
        if result.exchanges:
            raise ValueError("the wrapped rollout returned a trajectory that recorded calls of its own (a `with "
                             "trajectory:` block inside it): record them in one place, the wrapper's scope")
        result.messages_and_choices = []  # the calls are the record, as ART's log replaces them
        result.additional_histories = []
        result.exchanges = list(scope.exchanges)
    return result


def _replace_in_group(scope: Trajectory, outcome: Trajectory | None) -> None:
    """Leaving the scope inside `with art.TrajectoryGroup() as g:` added the scope to `g`; put the
    trajectory the rollout returned in its place (nothing, if the rollout raised)."""
    group = capture_scope.group_owner()
    if not isinstance(group, TrajectoryGroup):
        return
    for i, item in enumerate(group.trajectories):
        if item is scope:
            if outcome is None:
                del group.trajectories[i]
            else:
                group.trajectories[i] = outcome
            return


def init_chat_model(model: str | Model | None = None, *, model_provider: str | None = None,
                    configurable_fields: None = None, config_prefix: str | None = None,
                    chat_model: Any = None, timeout_seconds: float | None = None, **kwargs: Any) -> ChatOpenAI:
    """A LangChain `ChatOpenAI` on the model's endpoint (ART's `init_chat_model`).

    `model`: ART passes a model name (e.g. `model.get_inference_name()`) from inside a rollout
    wrapped by `wrap_rollout`, whose model gives the endpoint; an art_nb `Model` may be passed
    instead, anywhere (its endpoint and inference name). `chat_model` is returned as it is (ART's
    escape hatch: capture records it too if it calls the model's endpoint). `timeout_seconds` is the
    request timeout; other keyword arguments (`temperature`, default 1.0, `max_tokens`, `base_url`,
    `api_key`...) go to `ChatOpenAI`.
    """
    del model_provider, configurable_fields, config_prefix  # accepted as in ART, which ignores them too
    if chat_model is not None:
        return chat_model
    served = model if isinstance(model, Model) else _current_model.get()
    if served is None:
        raise RuntimeError("init_chat_model: no model to point at: call it inside a rollout wrapped by "
                           "`art_nb.langgraph.wrap_rollout(model, rollout)`, or pass the model itself: "
                           "`init_chat_model(model)`")
    if not served.inference_base_url:
        raise RuntimeError(f"init_chat_model: model {served.name!r} has no endpoint yet: run "
                           "`await model.register(backend)` first (or set inference_base_url)")
    try:
        from langchain_openai import ChatOpenAI
    except ImportError as error:
        raise ImportError("art_nb.langgraph needs langchain-openai: pip install 'art-nb[agents]'") from error
    kwargs.setdefault("temperature", 1.0)
    if timeout_seconds is not None:
        kwargs.setdefault("timeout", timeout_seconds)
    return ChatOpenAI(model=model if isinstance(model, str) else served.get_inference_name(),
                      base_url=kwargs.pop("base_url", served.inference_base_url),
                      api_key=kwargs.pop("api_key", served.inference_api_key or "none"), **kwargs)
