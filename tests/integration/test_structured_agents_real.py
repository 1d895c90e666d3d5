"""Agent frameworks that need constrained decoding, on the real tiny model (CPU), each as it is:
the OpenAI Agents SDK with `output_type=<a pydantic model>` (response_format json_schema, strict),
pydantic-ai with a structured output (a forced `final_result` tool: tool_choice "required") and
smolagents' ToolCallingAgent (tool_choice "required" every step). Each runs a group of rollouts
inside `art.trajectory(...)`, gets a reply its own parser accepts, and trains a step on exactly the
ids the engine sampled; the step is finite and reports the grammar's share of the mismatch
(`mismatch_logprob_abs`: on a CPU the engine and the trainer agree to ~1e-6 otherwise).

smolagents asks for its final answer under a system prompt of its own and writes an earlier tool call
back into the conversation as text ("Calling tools: [...]"), so a run of several calls is not one
append-only history: its calls train as a sequence per part (docs/capture.md), every sample once."""

from __future__ import annotations

import asyncio
import math
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

import art_nb as art
from art_nb.grpo.tokens import training_sequences

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"
CITIES = ["Paris", "Lima", "Oslo"]


class Forecast(BaseModel):
    city: str = Field(max_length=16)
    sky: Literal["sunny", "cloudy", "rainy"]
    celsius: int = Field(ge=-40, le=50)


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("art"))
    model = art.TrainableModel(name="structured", project="it", base_model=TINY,
                               config=art.ModelConfig(max_seq_len=2048, lora=art.LoraConfig(rank=8, alpha=32)))
    await model.register(backend)
    yield backend, model
    await backend.close()


async def train_on_sampled_ids(backend: art.LocalBackend, model: art.TrainableModel, group: art.TrajectoryGroup,
                               ) -> dict[str, float]:
    """Every trajectory trains on exactly the ids the engine sampled; one step, whose metrics come back."""
    tokenizer = backend._runtime.state(model).trainer.tokenizer  # what training tokenises with
    for i, traj in enumerate(group.trajectories):
        assert traj.exchanges, f"the framework's calls were not recorded: {traj.logs}"
        parts = training_sequences(tokenizer, traj, 2048)  # one, unless the agent's history parts (smolagents)
        assert all(seq.retokenized_choices == 0 and seq.template_fallbacks == 0 for seq in parts)
        sampled = [t for call in traj.exchanges for t in call.choices[0].token_ids]
        assert [t for seq in parts for t, m in zip(seq.input_ids, seq.assistant_mask, strict=True) if m] == sampled
        traj.reward += 0.01 * i  # a group whose rewards tie trains nothing
    step = await model.get_step()
    result = await model.train([group], config=art.TrainConfig(learning_rate=1e-4))
    assert result.step == step + 1 and result.metrics["retokenized_choices"] == 0
    assert all(math.isfinite(v) for v in result.metrics.values() if isinstance(v, float)), result.metrics
    assert result.metrics["skipped_nonfinite"] == 0 and result.metrics["tokens_trained"] > 0
    # The engine's logprobs are of the masked distribution: the grammar's share shows in the mismatch
    assert result.metrics["mismatch_logprob_abs"] > 0.01 and result.metrics["is_weight_mean"] < 1, result.metrics
    print(f"\nstep {result.step}: " + ", ".join(f"{k} {result.metrics[k]:.4g}" for k in (
        "loss", "tokens_trained", "mismatch_logprob_abs", "mismatch_kl", "is_weight_mean", "is_bounded_fraction")))
    return result.metrics


async def test_agents_sdk_output_type_trains(served) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    backend, model = served
    set_tracing_disabled(True)  # the SDK would upload traces to OpenAI

    async def rollout(city: str) -> None:
        client = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
        agent = Agent(name="forecaster", instructions="Give the forecast as JSON.", output_type=Forecast,
                      model=OpenAIChatCompletionsModel(model=model.get_inference_name(), openai_client=client),
                      model_settings=ModelSettings(temperature=1.0, max_tokens=48))
        result = await Runner.run(agent, f"What is the weather in {city} today?")
        forecast = result.final_output
        assert isinstance(forecast, Forecast)  # the SDK parsed and validated the reply
        art.current_trajectory(required=True).reward = float(forecast.city == city) + float(forecast.sky == "sunny")
        await client.close()

    group = await art.trajectory_group([art.trajectory(rollout(city)) for city in CITIES])
    for traj in group.trajectories:
        [call] = traj.exchanges
        assert call.request["response_format"]["json_schema"]["strict"] is True
        Forecast.model_validate_json(traj.messages()[-1]["content"])
    await train_on_sampled_ids(backend, model, group)


async def test_pydantic_ai_structured_output_trains(served) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    backend, model = served

    async def rollout(city: str) -> None:
        provider = OpenAIProvider(base_url=model.inference_base_url, api_key=model.inference_api_key)
        agent = Agent(OpenAIChatModel(model.get_inference_name(), provider=provider), output_type=Forecast,
                      model_settings={"temperature": 1.0, "max_tokens": 64})
        result = await agent.run(f"What is the weather in {city} today?")
        assert isinstance(result.output, Forecast)
        art.current_trajectory(required=True).reward = float(result.output.city == city)

    group = await art.trajectory_group([art.trajectory(rollout(city)) for city in CITIES])
    for traj in group.trajectories:
        first = traj.exchanges[0]
        assert first.request["tool_choice"] == "required"  # pydantic-ai's tool output mode
        assert first.choices[0].message["tool_calls"][0]["function"]["name"] == "final_result"
    await train_on_sampled_ids(backend, model, group)


async def test_smolagents_tool_calling_agent_trains(served) -> None:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    backend, model = served
    looked_up: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city's name
        """
        looked_up.append(city)
        return f"21 C and sunny in {city}"

    def run(city: str) -> Any:  # smolagents is synchronous: it runs in a worker thread, which capture follows
        llm = OpenAIServerModel(model_id=model.get_inference_name(), api_base=model.inference_base_url,
                                api_key=model.inference_api_key, temperature=1.0, max_tokens=96,
                                seed=CITIES.index(city), parallel_tool_calls=False)
        # One step, then smolagents' own final-answer call (no tools) if that step was not final_answer:
        # its 1,200-token system prompt makes every step slow on a CPU
        agent = ToolCallingAgent(tools=[get_weather], model=llm, max_steps=1, verbosity_level=0,
                                 instructions="Answer in a few words.")
        return agent.run(f"What is the weather in {city}?")

    async def rollout(city: str) -> None:
        answer = await asyncio.to_thread(run, city)
        traj = art.current_trajectory(required=True)
        traj.reward = float(city in str(answer)) + float(city in looked_up)

    group = await art.trajectory_group([art.trajectory(rollout(city)) for city in CITIES])
    tokenizer = backend._runtime.state(model).trainer.tokenizer
    for traj in group.trajectories:
        call = traj.exchanges[0]  # the step's forced tool call (then, unless it was final_answer, the final answer)
        choice = call.choices[0]
        assert call.request["tool_choice"] == "required" and call.request["parallel_tool_calls"] is False
        text = tokenizer.decode(choice.token_ids, skip_special_tokens=True)
        assert text.startswith('<tool_call>\n{"name": "'), text  # the grammar's, even where max_tokens cut it
        if choice.finish_reason != "length":  # a finished reply is exactly one call to one of the tools
            [called] = choice.message["tool_calls"]
            assert called["function"]["name"] in ("get_weather", "final_answer"), choice.message
    print(f"\nsmolagents: looked up {looked_up}; rewards {[round(t.reward, 2) for t in group.trajectories]}")
    await train_on_sampled_ids(backend, model, group)
