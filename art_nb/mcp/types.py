"""ART's MCP data types: a server's tools and resources, and the scenarios written for them.

Same names, fields and methods as ART's `art.mcp.types`, so scenario files and code that handles
them port unchanged. Plain dataclasses: they hold what an MCP server lists and what a generator
wrote, nothing of the `mcp` package (which loads only when a session is read, see rollout.py).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GeneratedScenario", "GeneratedScenarioCollection", "MCPResource", "MCPTool", "complete_task_tool"]


@dataclass
class MCPTool:
    """A tool an MCP server offers: its name, description and JSON schema of arguments."""

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
    """A task for an agent, with a difficulty from 1 (one tool call) to 5 (a multi-step analysis)."""

    task: str
    difficulty: int

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not self.task.strip():
            raise ValueError(f"task must be a non-empty string; got {self.task!r}")
        if isinstance(self.difficulty, bool) or not isinstance(self.difficulty, int) or not 1 <= self.difficulty <= 5:
            raise ValueError(f"difficulty must be an integer from 1 to 5; got {self.difficulty!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GeneratedScenario:
        missing = [key for key in ("task", "difficulty") if key not in data]
        if missing:
            raise ValueError(f"a scenario needs 'task' and 'difficulty'; {missing} missing from {data!r}")
        return cls(task=data["task"], difficulty=data["difficulty"])

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "difficulty": self.difficulty}

    def preview(self, max_length: int = 120) -> str:
        """The task, cut to `max_length` characters with an ellipsis."""
        return self.task if len(self.task) <= max_length else self.task[:max_length].strip() + "…"


class GeneratedScenarioCollection:
    """Scenarios, as ART's `generate_scenarios` returns them: iterate, index, split, filter, preview."""

    def __init__(self, scenarios: list[GeneratedScenario]) -> None:
        self.scenarios = scenarios

    @classmethod
    def from_dicts(cls, data: list[dict[str, Any]]) -> GeneratedScenarioCollection:
        return cls([GeneratedScenario.from_dict(item) for item in data])

    @classmethod
    def from_json(cls, text: str) -> GeneratedScenarioCollection:
        """From `{"scenarios": [...]}`, a bare list, or an object whose first value is the list."""
        data = json.loads(text)
        if isinstance(data, dict):
            data = data["scenarios"] if "scenarios" in data else next(iter(data.values()), [])
        return cls.from_dicts(data)

    def to_dicts(self) -> list[dict[str, Any]]:
        return [s.to_dict() for s in self.scenarios]

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps({"scenarios": self.to_dicts()}, indent=indent)

    def __len__(self) -> int:
        return len(self.scenarios)

    def __iter__(self) -> Iterator[GeneratedScenario]:
        return iter(self.scenarios)

    def __getitem__(self, index: int) -> GeneratedScenario:
        return self.scenarios[index]

    def shuffle(self) -> GeneratedScenarioCollection:
        """A new collection in random order (this one is left as it is)."""
        return GeneratedScenarioCollection(random.sample(self.scenarios, len(self.scenarios)))

    def split(self, train_size: int) -> tuple[GeneratedScenarioCollection, GeneratedScenarioCollection]:
        """The first `train_size` scenarios, and the rest (e.g. for validation)."""
        if not 0 <= train_size <= len(self.scenarios):
            raise ValueError(f"train_size ({train_size}) must be between 0 and the {len(self.scenarios)} scenarios")
        return (GeneratedScenarioCollection(self.scenarios[:train_size]),
                GeneratedScenarioCollection(self.scenarios[train_size:]))

    def filter_by_difficulty(self, min_difficulty: int = 1, max_difficulty: int = 5) -> GeneratedScenarioCollection:
        kept = [s for s in self.scenarios if min_difficulty <= s.difficulty <= max_difficulty]
        return GeneratedScenarioCollection(kept)

    def get_difficulty_distribution(self) -> Counter[int]:
        return Counter(s.difficulty for s in self.scenarios)

    def get_summary(self) -> dict[str, Any]:
        count = len(self.scenarios)
        return {"total_scenarios": count, "difficulty_distribution": dict(self.get_difficulty_distribution()),
                "avg_difficulty": sum(s.difficulty for s in self.scenarios) / count if count else 0,
                "avg_task_length": sum(len(s.task) for s in self.scenarios) / count if count else 0}

    def preview(self, n: int = 5, max_task_length: int = 120) -> None:
        """Print the first `n` tasks with their difficulty."""
        for i, scenario in enumerate(self.scenarios[:n], 1):
            print(f"   {i}. {scenario.preview(max_task_length)}  (difficulty {scenario.difficulty}/5)")

    def print_difficulty_distribution(self) -> None:
        """Print how many scenarios each difficulty has, as a bar per level."""
        counts = self.get_difficulty_distribution()
        print("Difficulty distribution:")
        for level in range(1, 6):
            print(f"   {level}/5: {counts.get(level, 0):3d}  {'█' * min(counts.get(level, 0), 30)}")


complete_task_tool = MCPTool(
    name="complete_task", description="Complete a task",
    parameters={"type": "object",
                "properties": {"summary": {"type": "string", "description": "Summary of accomplishments"}},
                "required": ["summary"]},
)
