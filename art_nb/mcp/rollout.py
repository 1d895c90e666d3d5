"""The MCP-RL rollout: the model works a task with an MCP server's tools until it calls `complete_task`.

This is the rollout of ART's MCP-RL notebook, over capture: the tools the server lists are offered
to the model with ART's `complete_task`; each tool call the model makes is sent to the server
through the client session and its result goes back as a tool message; the loop ends when the
model completes the task, answers without a tool call, or runs out of turns. Every model call is
recorded with the engine's token ids (art_nb.capture), so the trajectory trains on exactly what was
sampled. The reward is left at 0: RULER compares a group's attempts (`ruler_score_group`), as in ART.

`session` is any connected MCP client session (the `mcp` package's `ClientSession` or `Client`, 1.x
or 2.x): only `list_tools()`, `list_resources()` and `call_tool(name, arguments)` are used, and
the field names of both major versions are read. Opening it is the caller's (`stdio_client` +
`ClientSession`): one per rollout keeps a stateful server's rollouts apart.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from ..model import Model
from ..scopes import current_trajectory
from ..trajectories import Trajectory
from .types import GeneratedScenario, MCPResource, MCPTool, complete_task_tool

__all__ = ["SYSTEM_PROMPT", "list_mcp_resources", "list_mcp_tools", "mcp_rollout", "tool_result_text"]

SYSTEM_PROMPT = (
    "You are an MCP (Model Context Protocol) agent.\n\nYou have access to MCP tools through the server. Use them "
    "to complete your task.\n\nYou have a total of {max_turns} turns. Only use tool calls, do not write any "
    "content. When you have completed the task, call the 'complete_task' function with a summary of what you "
    "accomplished. Call complete_task by itself, not in conjunction with any other tools."
)


def _field(obj: Any, *names: str, default: Any = None) -> Any:
    """The first of `names` that `obj` has (mcp 2.x names fields in snake_case, 1.x in camelCase)."""
    for name in names:
        # third-party: an mcp result or listing, whose field names depend on the mcp major version
        value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
        if value is not None:
            return value
    return default


async def list_mcp_tools(session: Any) -> list[MCPTool]:
    """The tools the server lists (its first page), as `MCPTool`s ready for `generate_scenarios` and `tools=`."""
    listed = await session.list_tools()
    return [MCPTool(name=tool.name, description=_field(tool, "description", default="") or f"MCP tool: {tool.name}",
                    parameters=_field(tool, "input_schema", "inputSchema", default=None)
                    or {"type": "object", "properties": {}})
            for tool in _field(listed, "tools", default=listed)]


async def list_mcp_resources(session: Any) -> list[MCPResource]:
    """The resources the server lists (its first page); [] for a server that offers none."""
    listed = await session.list_resources()
    return [MCPResource(uri=str(resource.uri), name=resource.name or "",
                        description=_field(resource, "description", default=""),
                        mime_type=_field(resource, "mime_type", "mimeType"))
            for resource in _field(listed, "resources", default=listed)]


def tool_result_text(result: Any) -> str:
    """A `call_tool` result as the text a tool message carries: its text blocks joined, other blocks as JSON."""
    blocks = _field(result, "content", default=None)
    if not isinstance(blocks, list):
        return str(result)
    parts = []
    for block in blocks:
        text = _field(block, "text")
        # third-party: an mcp content block (a pydantic model) or, from a plain client, a dict
        data = block.model_dump(mode="json") if hasattr(block, "model_dump") else block
        parts.append(text if isinstance(text, str) else json.dumps(data, default=str))
    return "\n".join(parts)


async def mcp_rollout(model: Model, session: Any, scenario: GeneratedScenario | str, *, max_turns: int = 10,
                      system_prompt: str = SYSTEM_PROMPT, **completion_kwargs: Any) -> Trajectory:
    """One attempt at `scenario` with the server's tools (see the module docstring); returns the trajectory.

    Recorded into the open capture scope if there is one (`await art.trajectory(...)`), else into a
    scope of its own. `completion_kwargs` go to every chat completion (`max_tokens`, `temperature`...).
    Metrics: `task_completed`, `ran_out_of_turns`, `num_turns`, `tool_calls`, `tool_errors`; a tool
    that fails answers the model with its error (as ART's notebook does), counted in `tool_errors`.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be at least 1; got {max_turns}")
    task = scenario.task if isinstance(scenario, GeneratedScenario) else str(scenario)
    outer = current_trajectory()
    trajectory = outer if outer is not None else Trajectory()
    trajectory.metadata["task"] = task
    if isinstance(scenario, GeneratedScenario):
        trajectory.metadata["difficulty"] = scenario.difficulty
    tools = [t.to_tool_schema() for t in await list_mcp_tools(session)] + [complete_task_tool.to_tool_schema()]
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt.format(max_turns=max_turns)},
                                      {"role": "user", "content": f"Please complete this task: {task}"}]
    with contextlib.nullcontext() if outer is not None else trajectory:
        counts, completed = await _work(model, session, messages, tools, max_turns, trajectory, completion_kwargs)
    trajectory.metrics.update(counts, task_completed=completed,
                              ran_out_of_turns=not completed and counts["num_turns"] == max_turns)
    return trajectory


async def _work(model: Model, session: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                max_turns: int, trajectory: Trajectory, completion_kwargs: dict[str, Any]
                ) -> tuple[dict[str, int], bool]:
    """The turns: ask the model, answer its tool calls, until it completes, stops calling tools or runs out."""
    counts = {"num_turns": 0, "tool_calls": 0, "tool_errors": 0}
    completed = False
    client = model.openai_client()
    while counts["num_turns"] < max_turns and not completed:
        counts["num_turns"] += 1
        response = await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                         tools=tools, **completion_kwargs)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            counts["tool_calls"] += 1
            text, failed, completed_now = await _answer(session, call, trajectory)
            counts["tool_errors"] += failed
            completed = completed or completed_now
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    return counts, completed


async def _answer(session: Any, call: Any, trajectory: Trajectory) -> tuple[str, bool, bool]:
    """The tool message for one call: (text, whether it failed, whether it completed the task)."""
    name = call.function.name
    try:
        arguments = json.loads(call.function.arguments or "{}")
        if not isinstance(arguments, dict):
            raise ValueError("arguments must be a JSON object")
    except ValueError as error:
        trajectory.log(f"{name}: arguments are not a JSON object: {error}")
        return f"Error: the arguments are not a JSON object ({error})", True, False
    if name == complete_task_tool.name:
        trajectory.log(f"Task completion attempted with summary: {arguments.get('summary', '')}")
        return "Task marked complete.", False, True
    try:
        result = await session.call_tool(name, arguments)
    except Exception as error:  # noqa: BLE001 - the server's failure is the model's to read, as in ART
        trajectory.log(f"Tool call error: {name}: {error}")
        return f"Error: {error}", True, False
    failed = bool(_field(result, "is_error", "isError", default=False))
    if failed:
        trajectory.log(f"Tool call error: {name}: {tool_result_text(result)[:200]}")
    return tool_result_text(result), failed, False
