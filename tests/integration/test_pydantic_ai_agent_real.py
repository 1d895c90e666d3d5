"""A pydantic-ai agent with one tool, on its OpenAI provider pointed at the model's endpoint, as
pydantic-ai's users write it, trains exactly on SmolLM2 (CPU): two runs in one conversation (a
question, then a follow-up with `message_history=result.all_messages()`), inside `art.trajectory`, 16
rollouts, one step; what trained is what the engine sampled (agent_frameworks.py says how that is
checked).
"""

from __future__ import annotations

from typing import Any

import openai
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

pytest.importorskip("pydantic_ai")
from pydantic_ai import Agent
from pydantic_ai.exceptions import AgentRunError
from pydantic_ai.messages import (
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

pytestmark = [pytest.mark.slow, pytest.mark.long]


def few_shot() -> list[Any]:
    """Earlier questions answered with a call, its result and a reply, as pydantic-ai messages."""
    messages: list[Any] = []
    for i, (city, answer) in enumerate(EXAMPLES):
        messages += [ModelRequest(parts=[UserPromptPart(content=f"Weather in {city}?")]),
                     ModelResponse(parts=[ToolCallPart("get_weather", {"city": city}, f"ex{i}")]),
                     ModelRequest(parts=[ToolReturnPart("get_weather", answer, f"ex{i}")]),
                     ModelResponse(parts=[TextPart(content=example_reply(city, answer))])]
    return messages


async def rollout(model: art.TrainableModel) -> None:
    client = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key, max_retries=0)
    agent = Agent(OpenAIChatModel(model.get_inference_name(), provider=OpenAIProvider(openai_client=client)),
                  instructions=SYSTEM, model_settings={"max_tokens": MAX_TOKENS, "temperature": 1.0})

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return weather(city)

    trajectory = art.current_trajectory(required=True)
    history = few_shot()
    try:
        for prompt in (QUESTION, FOLLOW_UP):
            history = (await agent.run(prompt, message_history=history)).all_messages()
    except AgentRunError as error:  # e.g. a call to a tool it does not have, retried too often
        trajectory.log(f"agent stopped: {type(error).__name__}: {error}")
    finally:
        await client.close()


async def test_a_pydantic_ai_tool_agent_trains_on_what_the_engine_sampled(tmp_path, monkeypatch) -> None:
    await rollouts_train_exactly(tmp_path, monkeypatch, "pydantic-ai", rollout)
