"""art_nb.mcp without a model: ART's scenario types and generation (prompt, schema, parsing, the
generator's request), and `mcp_rollout`'s tool dispatch against the real stdio notes server
(tests/fakes/notes_mcp_server.py), driven by a scripted model whose replies are tool calls. The
real tiny model, RULER and a train step are tests/integration/test_mcp_real.py."""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import art_nb as art
from art_nb.mcp import (
    GeneratedScenario,
    GeneratedScenarioCollection,
    MCPTool,
    complete_task_tool,
    generate_scenarios,
    list_mcp_tools,
    mcp_rollout,
    tool_result_text,
)
from art_nb.mcp.scenarios import parse_scenarios, scenario_prompt, scenario_response_format
from fakes.scenario_generator import FakeScenarioGenerator

NOTES_SERVER = Path(__file__).resolve().parents[1] / "fakes" / "notes_mcp_server.py"
NOTE_TOOLS = [MCPTool("search_notes", "Find notes", {"type": "object", "properties": {"query": {"type": "string"}}})]


# ---- scenarios ---------------------------------------------------------------------------------

def test_scenario_types_behave_as_arts() -> None:
    scenarios = GeneratedScenarioCollection.from_json(json.dumps({"scenarios": [
        {"task": "a", "difficulty": 1}, {"task": "b", "difficulty": 4}, {"task": "c", "difficulty": 2}]}))
    assert [s.task for s in scenarios] == ["a", "b", "c"] and scenarios[1].difficulty == 4
    train, val = scenarios.split(2)
    assert (len(train), len(val)) == (2, 1)
    assert [s.task for s in scenarios.filter_by_difficulty(2, 5)] == ["b", "c"]
    assert GeneratedScenarioCollection.from_json(scenarios.to_json()).to_dicts() == scenarios.to_dicts()
    assert GeneratedScenarioCollection.from_json('[{"task": "x", "difficulty": 5}]')[0].task == "x"
    assert sorted(s.task for s in scenarios.shuffle()) == ["a", "b", "c"]
    assert scenarios.get_summary()["difficulty_distribution"] == {1: 1, 4: 1, 2: 1}
    assert GeneratedScenario("t" * 200, 3).preview(10) == "t" * 10 + "…"
    with pytest.raises(ValueError, match="difficulty must be an integer from 1 to 5"):
        GeneratedScenario(task="t", difficulty=9)
    with pytest.raises(ValueError, match="difficulty"):
        GeneratedScenario(task="t", difficulty=True)
    with pytest.raises(ValueError, match=r"\['difficulty'\] missing"):
        GeneratedScenario.from_dict({"task": "t"})
    with pytest.raises(ValueError, match="train_size"):
        scenarios.split(4)


def test_the_prompt_and_schema_are_arts() -> None:
    prompt = scenario_prompt([NOTE_TOOLS[0].to_dict()], [], 3, "Only about groceries.")
    assert '"name": "search_notes"' in prompt and "No resources available" in prompt
    assert "exactly 3 objects" in prompt and prompt.endswith("Only about groceries.")
    schema = scenario_response_format(3)["json_schema"]["schema"]["properties"]["scenarios"]
    assert (schema["minItems"], schema["maxItems"]) == (3, 3)
    assert schema["items"]["properties"]["difficulty"] == {"type": "integer", "minimum": 1, "maximum": 5}


def test_parsing_keeps_n_and_names_what_is_wrong() -> None:
    three = json.dumps({"scenarios": [{"task": str(i), "difficulty": 1} for i in range(3)]})
    assert [s.task for s in parse_scenarios(three, 2)] == ["0", "1"]
    assert len(parse_scenarios(json.dumps({"items": json.loads(three)["scenarios"]}), 3)) == 3
    with pytest.raises(ValueError, match="expected 4 scenarios, the generator wrote 3"):
        parse_scenarios(three, 4)
    with pytest.raises(ValueError, match="not JSON.*Sure! Here"):
        parse_scenarios("Sure! Here are your scenarios", 1)
    with pytest.raises(ValueError, match="no content"):
        parse_scenarios(None, 1)


async def test_generate_scenarios_asks_the_generator_as_art_does(monkeypatch) -> None:
    generator = await FakeScenarioGenerator([{"task": "Find the milk note", "difficulty": 2}]).start()
    try:
        monkeypatch.setenv("OPENROUTER_API_KEY", "sk-from-env")
        got = await generate_scenarios(NOTE_TOOLS, num_scenarios=1, show_preview=False,
                                       generator_base_url=generator.base_url)
        served = art.Model(name="writer", inference_base_url=generator.base_url, inference_api_key="sk-model")
        with art.Trajectory() as scope:  # generating inside a rollout's scope records nothing
            again = await generate_scenarios([t.to_dict() for t in NOTE_TOOLS], num_scenarios=1, show_preview=False,
                                             generator_model=served)
    finally:
        await generator.stop()
    assert got.to_dicts() == again.to_dicts() == [{"task": "Find the milk note", "difficulty": 2}]
    assert not scope.exchanges
    first, second = generator.requests
    assert first["authorization"] == "Bearer sk-from-env" and first["body"]["model"] == "openai/gpt-4.1-mini"
    assert second["authorization"] == "Bearer sk-model" and second["body"]["model"] == "writer"
    assert first["body"]["response_format"]["type"] == "json_schema"


async def test_generate_scenarios_refuses_what_it_cannot_do(monkeypatch) -> None:
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    with pytest.raises(ValueError, match="OPENROUTER_API_KEY"):
        await generate_scenarios(NOTE_TOOLS, num_scenarios=1)
    with pytest.raises(ValueError, match="at least one tool or resource"):
        await generate_scenarios([], [])


# ---- the rollout against the real stdio server ---------------------------------------------------

class ScriptedModel:
    """A model whose turns are scripted tool calls [(name, arguments JSON), ...] ([] = a plain answer)."""

    def __init__(self, turns: list[list[tuple[str, str]]]) -> None:
        self.turns, self.requests, self._ids = iter(turns), [], itertools.count()

    def get_inference_name(self) -> str:
        return "scripted"

    def openai_client(self) -> Any:
        return SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=self._create)))

    async def _create(self, **request: Any) -> Any:
        from openai.types.chat import ChatCompletion

        self.requests.append(copy.deepcopy(request))
        calls = [{"id": f"call_{next(self._ids)}", "type": "function", "function": {"name": n, "arguments": a}}
                 for n, a in next(self.turns)]
        message = {"role": "assistant", "content": None if calls else "I am done.", "tool_calls": calls or None}
        return ChatCompletion.model_validate({"id": "c", "object": "chat.completion", "created": 0,
                                              "model": "scripted", "choices": [{"index": 0, "finish_reason": "stop",
                                                                                "message": message}]})


@contextlib.asynccontextmanager
async def notes_session() -> AsyncIterator[Any]:
    mcp = pytest.importorskip("mcp")
    params = mcp.StdioServerParameters(command=sys.executable, args=[str(NOTES_SERVER)])
    async with mcp.stdio_client(params) as (read, write), mcp.ClientSession(read, write) as session:
        await session.initialize()
        yield session


def tool_results(request: dict[str, Any]) -> list[str]:
    return [m["content"] for m in request["messages"] if m["role"] == "tool"]


async def test_tool_calls_reach_the_server_and_its_answers_and_errors_reach_the_model() -> None:
    model = ScriptedModel([
        [("search_notes", '{"query": "milk"}'), ("add_note", '{"title": "", "text": "x"}')],
        [("add_note", "not json"), ("no_such_tool", "{}"), ("add_note", '{"title": "call", "text": "Ana"}')],
        [("search_notes", '{"query": "call"}')],
        [("complete_task", '{"summary": "saved the call note"}')],
    ])
    async with notes_session() as session:
        assert [t.name for t in await list_mcp_tools(session)] == ["search_notes", "add_note"]
        traj = await mcp_rollout(model, session, GeneratedScenario("Save a note to call Ana", 2), max_turns=5)
    assert traj.metrics == {**traj.metrics, "num_turns": 4, "tool_calls": 7, "tool_errors": 3,
                            "task_completed": True, "ran_out_of_turns": False}
    assert traj.metadata == {"task": "Save a note to call Ana", "difficulty": 2}
    first, second, third, fourth = model.requests
    assert [t["function"]["name"] for t in first["tools"]] == ["search_notes", "add_note", "complete_task"]
    assert first["messages"][1] == {"role": "user", "content": "Please complete this task: Save a note to call Ana"}
    assert tool_results(second) == ["groceries: eggs, milk, bread",
                                    "Error executing tool add_note: title must not be empty"]
    assert tool_results(third)[2:] == ["Error: the arguments are not a JSON object (Expecting value: line 1 column 1 "
                                       "(char 0))", "Unknown tool: no_such_tool", "saved 'call' (3 notes)"]
    assert tool_results(fourth)[-1] == "call: Ana"  # the server kept the note between calls
    assert fourth["messages"][:len(third["messages"])] == third["messages"]  # each request extends the last
    assert "Task completion attempted with summary: saved the call note" in traj.logs


async def test_the_rollout_stops_when_the_model_answers_or_runs_out_of_turns() -> None:
    async with notes_session() as session:
        answered = await mcp_rollout(ScriptedModel([[]]), session, "Say hi")
        looping = await mcp_rollout(ScriptedModel([[("search_notes", '{"query": "x"}')]] * 3), session, "Loop",
                                    max_turns=2)
        with art.Trajectory() as outer:  # inside an open scope, the rollout records into it
            inner = await mcp_rollout(ScriptedModel([[]]), session, "Inside")
    assert answered.metrics["num_turns"] == 1 and not answered.metrics["ran_out_of_turns"]
    assert looping.metrics["ran_out_of_turns"] and looping.metrics["tool_calls"] == 2
    assert inner is outer and outer.metadata["task"] == "Inside"
    with pytest.raises(ValueError, match="max_turns must be at least 1"):
        await mcp_rollout(ScriptedModel([]), session, "x", max_turns=0)


def test_tool_result_text_reads_both_mcp_major_versions() -> None:
    v2 = SimpleNamespace(content=[SimpleNamespace(type="text", text="a"), {"type": "image", "data": "b64"}])
    assert tool_result_text(v2) == 'a\n{"type": "image", "data": "b64"}'
    assert tool_result_text({"content": [{"type": "text", "text": "x"}], "isError": True}) == "x"
    assert complete_task_tool.to_tool_schema()["function"]["parameters"]["required"] == ["summary"]
