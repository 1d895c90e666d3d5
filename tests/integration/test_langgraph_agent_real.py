"""A LangGraph ReAct agent with one tool, on langchain-openai's `ChatOpenAI` pointed at the model's
endpoint, as LangGraph's users write it, trains exactly on SmolLM2 (CPU): two invocations in one
conversation (a question, then a follow-up appended to the returned messages), inside `art.trajectory`,
16 rollouts, one step; what trained is what the engine sampled (agent_frameworks.py says how that is
checked). test_langgraph_real.py covers ART's own LangGraph helpers (`art_nb.langgraph`).
"""

from __future__ import annotations

from typing import Any

import pytest
from agent_frameworks import (
    EXAMPLES,
    FOLLOW_UP,
    MAX_TOKENS,
    QUESTION,
    SYSTEM,
    example_reply,
    rollouts_train_exactly,
    weather,
)

import art_nb as art

pytest.importorskip("langgraph")
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return weather(city)


def few_shot() -> list[Any]:
    """Earlier questions answered with a call, its result and a reply, as LangChain messages."""
    messages: list[Any] = [SystemMessage(content=SYSTEM)]
    for i, (city, answer) in enumerate(EXAMPLES):
        messages += [HumanMessage(content=f"Weather in {city}?"),
                     AIMessage(content="", tool_calls=[{"name": "get_weather", "args": {"city": city}, "id": f"ex{i}"}]),
                     ToolMessage(content=answer, tool_call_id=f"ex{i}"),
                     AIMessage(content=example_reply(city, answer))]
    return messages


async def rollout(model: art.TrainableModel) -> None:
    chat_model = ChatOpenAI(model=model.get_inference_name(), base_url=model.inference_base_url,
                            api_key=model.inference_api_key, temperature=1.0, max_tokens=MAX_TOKENS, max_retries=0)
    agent = create_react_agent(chat_model, [get_weather])
    trajectory = art.current_trajectory(required=True)
    messages = [*few_shot(), HumanMessage(content=QUESTION)]
    try:
        for follow_up in (FOLLOW_UP, None):
            state = await agent.ainvoke({"messages": messages}, config={"recursion_limit": 6})
            if follow_up:
                messages = [*state["messages"], HumanMessage(content=follow_up)]
    except GraphRecursionError as error:  # the model kept calling the tool: the run so far still trains
        trajectory.log(f"agent stopped: {error}")


async def test_a_langgraph_react_agent_trains_on_what_the_engine_sampled(tmp_path, monkeypatch) -> None:
    await rollouts_train_exactly(tmp_path, monkeypatch, "langgraph", rollout)
