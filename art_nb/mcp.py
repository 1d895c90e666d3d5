"""`art_nb.mcp`, ART's MCP helpers: the data types (`MCPTool`, `MCPResource`, scenarios) work as in
ART; `generate_scenarios` (an LLM writes training tasks for an MCP server's tools) is not built yet
and raises NotImplementedError naming that when called, never at import.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GeneratedScenario", "GeneratedScenarioCollection", "MCPResource", "MCPTool", "complete_task_tool",
           "generate_scenarios"]


@dataclass
class MCPTool:
    """A tool an MCP server offers."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MCPTool:
        return cls(name=data.get("name", ""), description=data.get("description", ""),
                   parameters=data.get("parameters", {}))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def to_tool_schema(self) -> dict[str, Any]:
        """The tool as OpenAI's `tools=` takes it."""
        return {"type": "function", "function": self.to_dict()}


@dataclass
class MCPResource:
    """A resource an MCP server offers."""

    uri: str
    name: str
    description: str
    mime_type: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MCPResource:
        return cls(uri=data.get("uri", ""), name=data.get("name", ""), description=data.get("description", ""),
                   mime_type=data.get("mimeType") or data.get("mime_type"))

    def to_dict(self) -> dict[str, Any]:
        result = {"uri": self.uri, "name": self.name, "description": self.description}
        if self.mime_type:
            result["mimeType"] = self.mime_type
        return result


@dataclass
class GeneratedScenario:
    """A task for an agent, with a difficulty from 1 to 5."""

    task: str
    difficulty: int

    def __post_init__(self) -> None:
        if not isinstance(self.difficulty, int) or not 1 <= self.difficulty <= 5:
            raise ValueError(f"difficulty must be an integer from 1 to 5; got {self.difficulty!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GeneratedScenario:
        return cls(task=data["task"], difficulty=data["difficulty"])

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "difficulty": self.difficulty}


class GeneratedScenarioCollection:
    """Scenarios, as ART's `generate_scenarios` returns them."""

    def __init__(self, scenarios: list[GeneratedScenario]) -> None:
        self.scenarios = scenarios

    @classmethod
    def from_dicts(cls, data: list[dict[str, Any]]) -> GeneratedScenarioCollection:
        return cls([GeneratedScenario.from_dict(item) for item in data])

    @classmethod
    def from_json(cls, text: str) -> GeneratedScenarioCollection:
        data = json.loads(text)
        return cls.from_dicts(data["scenarios"] if isinstance(data, dict) and "scenarios" in data else data)

    def to_dicts(self) -> list[dict[str, Any]]:
        return [s.to_dict() for s in self.scenarios]

    def __len__(self) -> int:
        return len(self.scenarios)

    def __iter__(self) -> Iterator[GeneratedScenario]:
        return iter(self.scenarios)


complete_task_tool = MCPTool(
    name="complete_task", description="Complete a task",
    parameters={"type": "object", "properties": {"summary": {"type": "string", "description": "Summary of accomplishments"}},
                "required": ["summary"]},
)


async def generate_scenarios(tools: list[MCPTool] | list[dict[str, Any]], resources: Any = (),
                             num_scenarios: int = 24, **kwargs: Any) -> GeneratedScenarioCollection:
    """ART's LLM-written training tasks for MCP tools: not built yet (NotImplementedError)."""
    raise NotImplementedError(
        "generate_scenarios: writing scenarios with an LLM for MCP tools is not built in art_nb yet; build a "
        "GeneratedScenarioCollection.from_dicts([{'task': ..., 'difficulty': 1-5}, ...]) by hand")
