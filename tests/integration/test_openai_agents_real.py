"""The OpenAI Agents SDK's tool-using agent, as its users write it, trains exactly on SmolLM2 (CPU): an
`Agent` with one `function_tool`, run by `Runner.run` twice in one conversation (a question, then a
follow-up on `result.to_input_list()`), inside `art.trajectory`, 16 rollouts, one step; what trained is
what the engine sampled (agent_frameworks.py says how that is checked).

The model is `OpenAIChatCompletionsModel` on the model's endpoint: the SDK's default model speaks the
Responses API (`/v1/responses`).
"""

from __future__ import annotations

import json
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

agents = pytest.importorskip("agents")
from agents import (
    Agent,
    AgentsException,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

pytestmark = [pytest.mark.slow, pytest.mark.long]


def few_shot() -> list[dict[str, Any]]:
    """Earlier questions answered with a call, its result and a reply, as Agents SDK input items."""
    items: list[dict[str, Any]] = []
    for i, (city, answer) in enumerate(EXAMPLES):
        items += [{"role": "user", "content": f"Weather in {city}?"},
                  {"type": "function_call", "call_id": f"ex{i}", "name": "get_weather",
                   "arguments": json.dumps({"city": city})},
                  {"type": "function_call_output", "call_id": f"ex{i}", "output": answer},
                  {"role": "assistant", "content": example_reply(city, answer)}]
    return items


async def rollout(model: art.TrainableModel) -> None:
    client = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key, max_retries=0)

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return weather(city)

    agent = Agent(name="weather", instructions=SYSTEM, tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model=model.get_inference_name(), openai_client=client),
                  model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=1.0))
    trajectory = art.current_trajectory(required=True)
    items = [*few_shot(), {"role": "user", "content": QUESTION}]
    try:
        for follow_up in (FOLLOW_UP, None):
            result = await Runner.run(agent, items, max_turns=3)
            if follow_up:
                items = [*result.to_input_list(), {"role": "user", "content": follow_up}]
    except AgentsException as error:  # an unknown tool name, too many turns: the run so far still trains
        trajectory.log(f"agent stopped: {type(error).__name__}: {error}")
    finally:
        await client.close()


async def test_an_agents_sdk_tool_agent_trains_on_what_the_engine_sampled(tmp_path, monkeypatch) -> None:
    set_tracing_disabled(True)  # the SDK would send traces to OpenAI
    await rollouts_train_exactly(tmp_path, monkeypatch, "openai-agents", rollout)
