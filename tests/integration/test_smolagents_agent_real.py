"""smolagents' agents, as their users write them, on SmolLM2 (CPU) inside `art.trajectory`: what capture
refuses and why, and that what the refusal says to keep trains exactly (agent_frameworks.py says how
that is checked).

smolagents' runs are not one append-only conversation, by design, so capture refuses them and says
which of two things the agent did:
- it swaps the system prompt for its final-answer call: once an agent reaches `max_steps`,
  `provide_final_answer` asks for the answer under a system prompt of its own;
- it sends a reply back changed: CodeAgent appends its closing code tag to a reply without one, and
  ToolCallingAgent writes a tool call back as its own "Calling tools: [...]" text instead of the reply.
Every refusal here must name one of those; the test then keeps the calls before the refused one, as the
message says, and trains a step on exactly the ids the engine sampled.

smolagents is synchronous: each run goes to a worker thread (`asyncio.to_thread`), which capture follows.
ToolCallingAgent sends `tool_choice="required"` on every step. Its system prompt is ~1,200 tokens and
CodeAgent's ~2,300, so the groups are small: the claim here is about refusals, which are deterministic.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from typing import Any

import openai
import pytest
from agent_frameworks import MAX_TOKENS, QUESTION, served, train_exactly, weather

import art_nb as art
from art_nb.grpo.captured import CaptureRefused
from art_nb.grpo.tokens import tokenize_trajectory

pytest.importorskip("smolagents")
from smolagents import CodeAgent, OpenAIServerModel, ToolCallingAgent, tool
from smolagents.utils import AgentGenerationError

pytestmark = [pytest.mark.slow, pytest.mark.long]

SWAP = "Cause: the agent swapped its system prompt"
CHANGED = "Cause: the agent sent call"


@tool
def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: the city's name
    """
    return weather(city)


def run(agent_kind: type, model: art.TrainableModel, max_steps: int) -> Any:
    llm = OpenAIServerModel(model_id=model.get_inference_name(), api_base=model.inference_base_url,
                            api_key=model.inference_api_key, max_tokens=MAX_TOKENS, temperature=1.0)
    try:
        return agent_kind(tools=[get_weather], model=llm, max_steps=max_steps, verbosity_level=0).run(QUESTION)
    except AgentGenerationError as error:  # the endpoint's 400 (e.g. a tool_choice it does not serve), unwrapped
        if isinstance(error.__cause__, openai.BadRequestError):
            raise error.__cause__ from None
        raise


def keep_what_extends(tokenizer: Any, trajectory: art.Trajectory) -> list[str]:
    """The causes capture names for `trajectory`'s refusals; its calls cut before each refused one."""
    causes = []
    while True:
        try:
            tokenize_trajectory(tokenizer, trajectory, 10**6)
            return causes
        except CaptureRefused as refused:
            message = str(refused)
            cause = next((c for c in (SWAP, CHANGED) if c in message), None)
            assert cause, f"a refusal that names no cause: {message}"
            causes.append(cause)
            k = int(re.search(r"captured call (\d+)'s prompt", message).group(1))  # type: ignore[union-attr]
            assert f"trajectory.exchanges = trajectory.exchanges[:{k}]" in message
            trajectory.exchanges = trajectory.exchanges[:k]


async def refused_then_trained(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, agent_kind: type, rollouts: int,
                               max_steps: int) -> Counter[str]:
    s = await served(tmp_path, monkeypatch, agent_kind.__name__.lower(), max_seq_len=4096)
    try:
        async def rollout() -> None:
            await asyncio.to_thread(run, agent_kind, s.model, max_steps)

        group = await art.trajectory_group([art.trajectory(rollout()) for _ in range(rollouts)])
        calls = [len(t.exchanges) for t in group.trajectories]
        causes = Counter(c for t in group.trajectories for c in keep_what_extends(s.tokenizer, t))
        print(f"\n{agent_kind.__name__}: calls per rollout {calls}; refusals {dict(causes)}")
        await train_exactly(s, group, f"smolagents {agent_kind.__name__}, the calls kept", turns=1)
        return causes
    finally:
        await s.backend.close()


async def test_a_tool_calling_agent_is_refused_naming_what_it_did_and_its_kept_calls_train_exactly(
        tmp_path, monkeypatch) -> None:
    causes = await refused_then_trained(tmp_path, monkeypatch, ToolCallingAgent, rollouts=4, max_steps=2)
    assert set(causes) <= {SWAP, CHANGED} and causes


async def test_a_code_agent_is_refused_naming_the_system_prompt_swap_and_its_first_call_trains_exactly(
        tmp_path, monkeypatch) -> None:
    """One step, then the final-answer call under its own system prompt (unless the step's code already
    called final_answer): each refusal names the swap."""
    causes = await refused_then_trained(tmp_path, monkeypatch, CodeAgent, rollouts=4, max_steps=1)
    assert set(causes) <= {SWAP}
