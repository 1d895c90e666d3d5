"""`art_nb.mcp`, ART's MCP-RL: train an agent on an MCP server from its tools alone.

The loop, as in ART: list the server's tools (`list_mcp_tools(session)`), have a capable model
write tasks for them (`generate_scenarios`), let the model attempt each task a few times with the
tools (`mcp_rollout`, the rollout of ART's MCP-RL notebook, recorded by capture), score each group's
attempts against each other with RULER (`art_nb.rewards.ruler_score_group`), train. ART's names
(`MCPTool`, `MCPResource`, `GeneratedScenario`, `GeneratedScenarioCollection`, `complete_task_tool`,
`generate_scenarios`) are here with ART's signatures; `list_mcp_tools`, `list_mcp_resources`,
`tool_result_text` and `mcp_rollout` are art_nb's, for what ART's notebook writes by hand.

Importing this loads neither the `mcp` package nor LangChain: a session is whatever the caller
opened with `mcp` (`pip install 'art-nb[agents]'`).
"""

from __future__ import annotations

from .rollout import SYSTEM_PROMPT, list_mcp_resources, list_mcp_tools, mcp_rollout, tool_result_text
from .scenarios import generate_scenarios
from .types import GeneratedScenario, GeneratedScenarioCollection, MCPResource, MCPTool, complete_task_tool

__all__ = ["SYSTEM_PROMPT", "GeneratedScenario", "GeneratedScenarioCollection", "MCPResource", "MCPTool",
           "complete_task_tool", "generate_scenarios", "list_mcp_resources", "list_mcp_tools", "mcp_rollout",
           "tool_result_text"]
