"""smolagents' agents, as their users write them, on SmolLM2 (CPU) inside `art.trajectory`: they train, each
sampled token exactly once after exactly the prompt it was sampled from (agent_frameworks.py says how that
is checked).

smolagents' runs are not one append-only conversation, by design: an agent that reaches `max_steps` asks
for its final answer under a system prompt of its own (`provide_final_answer`), CodeAgent appends its
closing code tag to a reply without one, and ToolCallingAgent writes a tool call back as its own "Calling
tools: [...]" text instead of the reply. Where a call's prompt does not extend the history before it, a
train step trains the calls from it on as a sequence of their own (grpo/captured.py); each such part
names which of those the agent did, and the test asserts it names one.

smolagents is synchronous: each run goes to a worker thread (`asyncio.to_thread`), which capture follows.
ToolCallingAgent sends `tool_choice="required"` on every step. Its system prompt is ~1,200 tokens and
CodeAgent's ~2,300, so the groups are small: the claim is about exactness, which holds for every rollout.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import openai
import pytest
from agent_frameworks import MAX_TOKENS, QUESTION, served, train_exactly, weather

import art_nb as art
from art_nb.grpo.tokens import training_sequences

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


def causes(tokenizer: Any, trajectory: art.Trajectory) -> list[str]:
    """The cause each part of `trajectory` after its first names for parting from the history."""
    named = []
    for part in training_sequences(tokenizer, trajectory, 10**6)[1:]:
        cause = next((c for c in (SWAP, CHANGED) if c in (part.parted or "")), None)
        assert cause, f"a parted history that names no cause: {part.parted}"
        named.append(cause)
    return named


async def trained_in_parts(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, agent_kind: type, rollouts: int,
                           max_steps: int) -> Counter[str]:
    s = await served(tmp_path, monkeypatch, agent_kind.__name__.lower(), max_seq_len=4096)
    try:
        async def rollout() -> None:
            await asyncio.to_thread(run, agent_kind, s.model, max_steps)

        group = await art.trajectory_group([art.trajectory(rollout()) for _ in range(rollouts)])
        calls = [len(t.exchanges) for t in group.trajectories]
        named = Counter(c for t in group.trajectories for c in causes(s.tokenizer, t))
        print(f"\n{agent_kind.__name__}: calls per rollout {calls}; parts begun by {dict(named)}")
        await train_exactly(s, group, f"smolagents {agent_kind.__name__}", turns=1, parts=True)
        return named
    finally:
        await s.backend.close()


async def test_a_tool_calling_agent_trains_exactly_in_parts_naming_what_it_did(tmp_path, monkeypatch) -> None:
    named = await trained_in_parts(tmp_path, monkeypatch, ToolCallingAgent, rollouts=4, max_steps=2)
    assert set(named) <= {SWAP, CHANGED} and named


async def test_a_code_agent_trains_exactly_in_parts_naming_what_it_did(tmp_path, monkeypatch) -> None:
    """Two steps (the second after its closing code tag written back), then the final-answer call under its
    own system prompt (unless the code already called final_answer): each part after the first names one."""
    named = await trained_in_parts(tmp_path, monkeypatch, CodeAgent, rollouts=4, max_steps=2)
    assert set(named) <= {SWAP, CHANGED} and named
