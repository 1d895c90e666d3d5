"""The OpenAI Agents SDK's default model (`OpenAIResponsesModel`, which speaks `/v1/responses`) on the
real tiny model (CPU), as a user writes it: `Agent` with one function tool, `Runner.run`, inside
`art.trajectory(...)`. Each rollout makes at least two model calls (a tool call answered by the SDK
with the tool's result and the model's next reply, or a second user turn sent with
`result.to_input_list()`), every call is captured, training takes exactly the ids the engine
sampled (nothing re-tokenised, no template fallback: the turns come back as their sampled ids), and
a step trains.

SmolLM2-135M rarely calls a tool unprompted, so the conversation opens with three earlier questions
answered with a call (written by the client, as `test_turns_real.py` does); the test asserts that some
rollout's first reply did call the tool, so the function-call path is exercised, not assumed. A second
group forces the first call with `tool_choice="required"` (the SDK resets it after the call), which
needs the endpoint's constrained decoding: expected to fail with a 400 where that is not served.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import art_nb as art
from art_nb.grpo.tokens import tokenize_trajectory

agents = pytest.importorskip("agents")
from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
from agents.exceptions import AgentsException
from agents.models.openai_provider import OpenAIProvider
from agents.models.openai_responses import OpenAIResponsesModel

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"
INSTRUCTIONS = "You answer with a tool call when a tool can help."


def _examples() -> list[dict[str, Any]]:
    """Earlier questions answered with a call and its result, as Responses input items."""
    items: list[dict[str, Any]] = []
    for i, city in enumerate(["Rome", "Oslo", "Lima"]):
        items += [{"role": "user", "content": f"Weather in {city}?"},
                  {"type": "function_call", "call_id": f"ex{i}", "name": "get_weather",
                   "arguments": json.dumps({"city": city})},
                  {"type": "function_call_output", "call_id": f"ex{i}", "output": "18 C"}]
    return items


async def _rollout(model: art.TrainableModel, seed: int, called: list[str], force_tool: bool = False) -> None:
    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return f"21 C and sunny in {city}"

    # max_tokens bounds the time a reply takes on CPU; a reply cut there is "incomplete", which the SDK raises
    # (as with OpenAI) after its call was captured. The seed is art_nb's, as chat completions take it.
    settings = ModelSettings(temperature=1.0, max_tokens=128, extra_body={"seed": seed},
                             tool_choice="required" if force_tool else None)  # the SDK resets it after a call
    agent = Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather], model=model.get_inference_name(),
                  model_settings=settings)
    provider = OpenAIProvider(openai_client=model.openai_client())  # the provider the SDK uses by default
    assert isinstance(provider.get_model(model.get_inference_name()), OpenAIResponsesModel)
    run_config = RunConfig(model_provider=provider, tracing_disabled=True)
    trajectory = art.current_trajectory(required=True)
    try:
        result = await Runner.run(agent, [*_examples(), {"role": "user", "content": "Weather in Paris?"}],
                                  run_config=run_config, max_turns=3)
        if not called:  # no tool call: the second turn is the user's
            await Runner.run(agent, [*result.to_input_list(), {"role": "user", "content": "And in Lima?"}],
                             run_config=run_config, max_turns=3)
    except AgentsException as error:  # a reply cut at max_tokens, max turns: the calls so far are captured and train
        trajectory.log(f"agent stopped: {type(error).__name__}: {error}")
    trajectory.reward = float(bool(called)) + 0.01 * seed  # rewards differ within the group


@pytest.fixture(scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("art"))
    model = art.TrainableModel(name="agents", project="it", base_model=TINY,
                               config=art.ModelConfig(max_seq_len=1024, lora=art.LoraConfig(rank=8, alpha=32)))
    await model.register(backend)
    yield backend, model
    await backend.close()


async def _group_trains_exactly(backend: art.LocalBackend, model: art.TrainableModel, force_tool: bool
                                ) -> list[list[str]]:
    """Four rollouts as a group, each with at least two model calls, all captured and trained on exactly
    the ids the engine sampled (and their logprobs), then a step; the tool calls each rollout made."""
    calls: list[list[str]] = [[] for _ in range(4)]
    group = await art.trajectory_group([art.trajectory(_rollout(model, seed, calls[seed], force_tool))
                                        for seed in range(4)])
    tokenizer = backend._runtime.state(model).trainer.tokenizer  # what training tokenises with
    for trajectory in group.trajectories:
        assert len(trajectory.exchanges) >= 2, f"a rollout made fewer than two model calls: {trajectory.logs}"
        assert all(call.request.get("input") for call in trajectory.exchanges)  # Responses calls, captured
        seq = tokenize_trajectory(tokenizer, trajectory, 1024)
        assert seq.retokenized_choices == 0 and seq.template_fallbacks == 0
        sampled = [i for call in trajectory.exchanges for i in call.choices[0].token_ids]
        assert [i for i, m in zip(seq.input_ids, seq.assistant_mask, strict=True) if m] == sampled
        logprobs = [lp for call in trajectory.exchanges for lp in call.choices[0].logprobs]
        assert [lp for lp, m in zip(seq.engine_logprobs, seq.assistant_mask, strict=True) if m] == logprobs
    print(f"\ntool calls per rollout: {calls}; "
          f"sampled per call: {[[len(c.choices[0].token_ids) for c in t.exchanges] for t in group.trajectories]}")
    step = await model.get_step()
    result = await model.train([group], config=art.TrainConfig(learning_rate=1e-4))
    assert result.step == step + 1 and result.metrics["retokenized_choices"] == 0
    assert model.get_inference_name().endswith(f"@{step + 1}")
    return calls


async def test_the_agents_sdk_default_model_trains_on_the_ids_the_engine_sampled(served: Any) -> None:
    calls = await _group_trains_exactly(*served, force_tool=False)
    assert any(calls), "no rollout called the tool: the function-call path went untested"


async def test_a_forced_tool_call_then_the_reply_to_its_result_train_exactly(served: Any) -> None:
    calls = await _group_trains_exactly(*served, force_tool=True)
    assert all(calls), f"tool_choice='required' did not make every rollout call the tool: {calls}"
