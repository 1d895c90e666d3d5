"""Who RULER asks: a judge named by a string, or a model art_nb serves.

- **A string** (`"openai/o3"`, `"anthropic/claude-..."`): through litellm when it is installed, as
  ART does, with `extra_litellm_params` passed along. Without litellm, any OpenAI-compatible endpoint
  through the openai SDK: `base_url` (or litellm's `api_base`) and `api_key` from
  `extra_litellm_params`, else `OPENAI_BASE_URL` / `OPENAI_API_KEY`; litellm's routing prefixes
  `openai/` and `hosted_vllm/` are dropped from the name.
- **An art_nb `Model`**: its own client. A `TrainableModel` judges with its base weights, which
  LocalBackend serves under the base model's hub name, so `judge_model=model` needs no key and no
  network (Colab, CI); another `Model` is asked under its inference name.

`Judge.local` says the endpoint is an art_nb model's, which may be any OpenAI-compatible server: its
ratings are read from top logprobs where it returns them (art_nb's own endpoint does) and sampled
several times in the same request otherwise.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..model import Model, TrainableModel

__all__ = ["Judge", "resolve_judge"]

_ROUTING_PREFIXES = ("openai/", "hosted_vllm/")
_CLIENT_KEYS = ("base_url", "api_base", "api_key")

Create = Callable[[list[dict[str, Any]], dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class Judge:
    """A resolved judge: `label` names it in the cache key and messages (no URL, no key in it)."""

    label: str
    local: bool
    create: Create

    async def complete(self, messages: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, Any]:
        """One chat completion as a plain dict (OpenAI's response shape)."""
        return await self.create(messages, params)


def _as_dict(response: Any) -> dict[str, Any]:
    """OpenAI's and litellm's responses are pydantic models; tests may hand back a dict."""
    return response if isinstance(response, dict) else response.model_dump()


def _model_judge(model: Model, extra: Mapping[str, Any]) -> Judge:
    name = model.base_model if isinstance(model, TrainableModel) else model.get_inference_name()
    body = {k: v for k, v in extra.items() if k not in _CLIENT_KEYS}

    async def create(messages: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, Any]:
        client = model.openai_client()
        response = await client.chat.completions.create(model=name, messages=messages,  # type: ignore[arg-type]
                                                        extra_body={**params, **body})
        return _as_dict(response)

    return Judge(label=f"art_nb:{name}", local=True, create=create)


def _litellm_judge(name: str, extra: Mapping[str, Any], litellm: Any) -> Judge:
    async def create(messages: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, Any]:
        response = await litellm.acompletion(model=name, messages=messages, caching=False, **{**params, **extra})
        return _as_dict(response)

    return Judge(label=f"litellm:{name}", local=False, create=create)


def _openai_judge(name: str, extra: Mapping[str, Any]) -> Judge:
    base_url = extra.get("base_url") or extra.get("api_base") or os.environ.get("OPENAI_BASE_URL")
    api_key = extra.get("api_key") or os.environ.get("OPENAI_API_KEY")
    if not base_url and not api_key:
        raise RuntimeError(
            f"judge {name!r}: litellm is not installed (`pip install litellm` reaches any provider), and no "
            "OpenAI-compatible endpoint is given: pass extra_litellm_params={'base_url': ..., 'api_key': ...}, "
            "set OPENAI_BASE_URL / OPENAI_API_KEY, or judge with a model art_nb serves (judge_model=model)")
    served = next((name[len(p):] for p in _ROUTING_PREFIXES if name.startswith(p)), name)
    body = {k: v for k, v in extra.items() if k not in _CLIENT_KEYS}

    async def create(messages: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, Any]:
        from openai import AsyncOpenAI

        async with AsyncOpenAI(base_url=base_url, api_key=api_key or "none", max_retries=2, timeout=600.0) as client:
            response = await client.chat.completions.create(model=served, messages=messages,  # type: ignore[arg-type]
                                                            extra_body={**params, **body})
        return _as_dict(response)

    return Judge(label=f"openai:{served}", local=False, create=create)


def resolve_judge(judge_model: str | Model, extra_litellm_params: Mapping[str, Any] | None = None) -> Judge:
    """The judge `judge_model` names; raises (RuntimeError, TypeError) saying what to give instead."""
    extra = dict(extra_litellm_params or {})
    if isinstance(judge_model, Model):
        return _model_judge(judge_model, extra)
    if not isinstance(judge_model, str):
        raise TypeError(f"judge_model is a {type(judge_model).__name__}; give a model name (str) or an art_nb Model")
    try:
        litellm = importlib.import_module("litellm")
    except ImportError:
        return _openai_judge(judge_model, extra)
    return _litellm_judge(judge_model, extra, litellm)
