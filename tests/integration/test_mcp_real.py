"""ART's MCP-RL on the real tiny model (CPU), offline, against an MCP server the test starts over stdio
(tests/fakes/notes_mcp_server.py, a notes store with two tools): its tools are listed, scenarios are
generated for them (by a fake of the hosted generator: SmolLM2 does not write scenario JSON), a group
of `mcp_rollout`s attempts a scenario with the tools, RULER scores the group with the model's own
base weights as judge, and a step trains on exactly the ids the engine sampled.

SmolLM2-135M never calls a tool unforced, so the group's rollouts end after one call; in the forced
variant (a named `tool_choice`, served by constrained decoding) the server's tools really answer.
Tool dispatch itself is covered by tests/unit/test_mcp.py."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import art_nb as art
from art_nb.grpo.tokens import tokenize_trajectory
from art_nb.mcp import GeneratedScenario, generate_scenarios, list_mcp_resources, list_mcp_tools, mcp_rollout
from art_nb.rewards import ruler_score_group
from fakes.scenario_generator import FakeScenarioGenerator

mcp = pytest.importorskip("mcp")

pytestmark = [pytest.mark.slow, pytest.mark.long]

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"
NOTES_SERVER = Path(__file__).resolve().parents[1] / "fakes" / "notes_mcp_server.py"
SCENARIOS = [{"task": "Find the note about groceries and report what to buy", "difficulty": 1},
             {"task": "Save a note titled 'call' saying to call Ana, then confirm it is there", "difficulty": 2},
             {"task": "Summarise every note about meetings", "difficulty": 3}]


@contextlib.asynccontextmanager
async def notes_session() -> AsyncIterator[Any]:
    """A fresh notes server for one rollout (its own process, so rollouts never share a store)."""
    params = mcp.StdioServerParameters(command=sys.executable, args=[str(NOTES_SERVER)])
    async with mcp.stdio_client(params) as (read, write), mcp.ClientSession(read, write) as session:
        await session.initialize()
        yield session


async def rollout(model: art.TrainableModel, scenario: GeneratedScenario, max_tokens: int = 48,
                  **kwargs: Any) -> art.Trajectory:
    try:
        async with notes_session() as session:
            return await mcp_rollout(model, session, scenario, max_turns=2, max_tokens=max_tokens, **kwargs)
    except BaseExceptionGroup as group:  # the mcp client's task groups wrap what the rollout raised
        error: BaseException = group
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]
        raise error from None


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("art"))
    model = art.TrainableModel(name="mcp", project="it", base_model=TINY,
                               config=art.ModelConfig(max_seq_len=2048, lora=art.LoraConfig(rank=8, alpha=32)))
    await model.register(backend)
    yield backend, model
    await backend.close()


@pytest.fixture(scope="module")
async def scenarios():
    """The server's tools, listed over stdio, handed to `generate_scenarios` as ART's notebook does."""
    async with notes_session() as session:
        tools, resources = await list_mcp_tools(session), await list_mcp_resources(session)
    schemas = {t.name: t.parameters for t in tools}
    assert set(schemas) == {"search_notes", "add_note"} and resources == []
    assert schemas["add_note"]["required"] == ["title", "text"]  # the server's input schema, as listed
    generator = await FakeScenarioGenerator(SCENARIOS).start()
    try:
        generated = await generate_scenarios(tools, resources, num_scenarios=2, show_preview=False,
                                             generator_model="openai/gpt-4.1-mini", generator_api_key="sk-test",
                                             generator_base_url=generator.base_url)
    finally:
        await generator.stop()
    (sent,) = generator.requests
    prompt = sent["body"]["messages"][0]["content"]
    assert '"name": "search_notes"' in prompt and '"name": "add_note"' in prompt and "exactly 2 objects" in prompt
    assert sent["body"]["response_format"]["json_schema"]["schema"]["properties"]["scenarios"]["maxItems"] == 2
    assert sent["authorization"] == "Bearer sk-test" and sent["body"]["model"] == "openai/gpt-4.1-mini"
    assert [s.task for s in generated] == [s["task"] for s in SCENARIOS[:2]]  # a third one is cut off
    return generated


def check_trained_ids(backend: art.LocalBackend, model: art.TrainableModel, group: art.TrajectoryGroup) -> None:
    tokenizer = backend._runtime.state(model).trainer.tokenizer  # what training tokenises with
    for traj in group.trajectories:
        seq = tokenize_trajectory(tokenizer, traj, 2048)
        assert seq.retokenized_choices == 0 and seq.template_fallbacks == 0
        sampled = [i for call in traj.exchanges for i in call.choices[0].token_ids]
        assert [i for i, m in zip(seq.input_ids, seq.assistant_mask, strict=True) if m] == sampled


async def judged_and_trained(backend: art.LocalBackend, model: art.TrainableModel, group: art.TrajectoryGroup,
                             cache_dir: Path) -> art.TrajectoryGroup:
    scored = await ruler_score_group(group, model, {"seed": 7}, rating_samples=2, cache_dir=cache_dir)
    assert scored is not None and all(0.0 <= t.reward <= 1.0 for t in scored)
    assert all(t.metrics["ruler_score"] == t.reward and t.metrics["independent_reward"] == 0.0 for t in scored)
    check_trained_ids(backend, model, scored)
    for i, traj in enumerate(scored):  # a group whose scores tie trains nothing; keep RULER's order
        traj.reward += 1e-3 * i
    step_before = await model.get_step()
    result = await model.train([scored], config=art.TrainConfig(learning_rate=1e-4))
    assert result.step == step_before + 1 and result.metrics["retokenized_choices"] == 0
    return scored


async def test_mcp_rl_generates_rolls_out_judges_and_trains(served, scenarios, tmp_path) -> None:
    backend, model = served
    (group,) = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(model, scenarios[0]) for _ in range(3))], max_exceptions=0)
    for traj in group:
        assert traj.exchanges and traj.metadata == {"task": scenarios[0].task, "difficulty": 1}
        offered = {t["function"]["name"] for t in traj.exchanges[0].request["tools"]}
        assert offered == {"search_notes", "add_note", "complete_task"}
        assert traj.messages()[1]["content"] == f"Please complete this task: {scenarios[0].task}"
        assert traj.metrics["num_turns"] == len(traj.exchanges) and not traj.metrics["task_completed"]
    scored = await judged_and_trained(backend, model, group, tmp_path)
    print(f"\nMCP-RL: RULER rewards {[round(t.reward, 3) for t in scored]}, "
          f"tool calls {[t.metrics['tool_calls'] for t in scored]}")


async def test_forced_tool_calls_reach_the_server_and_train(served, scenarios, tmp_path) -> None:
    """Every turn forced to call the server's search_notes (a named tool_choice: "required" may pick
    complete_task first, whose result no later call carries), so a second turn carries the first's result.
    The query is free text: a reply max_tokens cut is no call, but still the grammar's prefix."""
    backend, model = served
    search = {"type": "function", "function": {"name": "search_notes"}}
    (group,) = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(model, scenarios[0], max_tokens=128, tool_choice=search, seed=s)
                             for s in range(3))], max_exceptions=0)
    tokenizer = backend._runtime.state(model).trainer.tokenizer
    for traj in group:
        for call in traj.exchanges:
            text = tokenizer.decode(call.choices[0].token_ids, skip_special_tokens=True)
            assert text.startswith('<tool_call>\n{"name": "search_notes", "arguments": {"query": "'), text
    results = [m for traj in group for m in traj.messages() if m["role"] == "tool"]
    assert results, "no forced call got the server's result"
    await judged_and_trained(backend, model, group, tmp_path)
