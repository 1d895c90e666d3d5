"""`art_nb.langgraph`, ART's LangGraph integration: importable, so ART code loads; not built yet.

ART records a LangGraph agent's LLM calls through a wrapped chat model and rebuilds the trajectory
from them. Using `wrap_rollout` or `init_chat_model` raises NotImplementedError naming that; a
rollout written against `model.openai_client()` directly trains as usual.
"""

from __future__ import annotations

from typing import Any

__all__ = ["init_chat_model", "wrap_rollout"]

_MISSING = ("the LangGraph integration (a chat model that records each call into the trajectory) is not built "
            "in art_nb yet: call model.openai_client() in your rollout and append each Choice to the trajectory")


def wrap_rollout(model: Any, fn: Any) -> Any:
    """ART's wrapper that turns a LangGraph run into a Trajectory: not built yet (NotImplementedError)."""
    raise NotImplementedError(f"wrap_rollout: {_MISSING}")


def init_chat_model(model: Any = None, **kwargs: Any) -> Any:
    """ART's LangChain chat model pointed at the trained model: not built yet (NotImplementedError)."""
    raise NotImplementedError(f"init_chat_model: {_MISSING}")
