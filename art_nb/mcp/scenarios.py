"""ART's `generate_scenarios`: a model writes training tasks for an MCP server's tools.

MCP-RL needs tasks but no answers (RULER judges the attempts against each other), so a capable
model is shown the server's tools and resources and asked for N realistic tasks with a difficulty,
held to a JSON schema. The prompt, the schema and the parsing are ART's, written here as pure
functions; the one call goes through the openai SDK to any OpenAI-compatible endpoint.

The generator, as in ART: a model name with `generator_base_url` (default OpenRouter) and
`generator_api_key` (default `OPENROUTER_API_KEY`). art_nb's addition: `generator_model` may be an
art_nb `Model`, asked at its own endpoint under its inference name (another model you serve, or
a hosted one given as `Model(name=..., inference_base_url=..., inference_api_key=...)`). The call is
made under `no_capture()`, so generating inside a rollout's scope never trains on the generator's
words.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

from ..capture import no_capture
from ..model import Model
from .types import GeneratedScenarioCollection, MCPResource, MCPTool

__all__ = ["generate_scenarios", "parse_scenarios", "scenario_prompt", "scenario_response_format"]

OPENROUTER_BASE_URL = "https://openrouter.ai/api/v1"


def _tool_info(tool: MCPTool | dict[str, Any]) -> dict[str, Any]:
    return (tool if isinstance(tool, MCPTool) else MCPTool.from_dict(tool)).to_dict()


def _resource_info(resource: MCPResource | dict[str, Any]) -> dict[str, Any]:
    return resource.to_dict() if isinstance(resource, MCPResource) else dict(resource)


def scenario_prompt(tools: Sequence[dict[str, Any]], resources: Sequence[dict[str, Any]], num_scenarios: int,
                    custom_instructions: str | None = None) -> str:
    """ART's request for `num_scenarios` tasks, listing the tools and resources as JSON."""
    resources_text = json.dumps(list(resources), indent=2) if resources else "No resources available"
    return (
        "You are an expert at creating realistic scenarios for testing AI agents that interact with MCP (Model "
        "Context Protocol) servers.\n\n"
        f"Given the following available tools and resources from an MCP server, generate {num_scenarios} diverse, "
        "realistic scenarios that a user might want to accomplish using these tools.\n\n"
        f"AVAILABLE TOOLS:\n{json.dumps(list(tools), indent=2)}\n\n"
        f"AVAILABLE RESOURCES:\n{resources_text}\n\n"
        "Requirements for scenarios:\n"
        "1. Each scenario should be a task that can be accomplished using the available tools\n"
        "2. Scenarios should vary in complexity - some simple (1-2 tool calls), some complex (multiple tool calls)\n"
        "3. Scenarios should cover different use cases and tool combinations (though the task should not specify "
        "which tools to use)\n"
        "4. Each scenario should be realistic - something a real user might actually want to do\n"
        "5. Assign a difficulty rating from 1 (easy, single tool call) to 5 (hard, complex multi-step analysis)\n"
        "6. The task should always include generating a summary of the work done and a thorough analysis and "
        "report of the results\n\n"
        f'You must respond with a JSON object containing a "scenarios" array of exactly {num_scenarios} objects. '
        "Each object must have:\n"
        '- "task": string describing the scenario\n'
        '- "difficulty": integer from 1-5 representing complexity\n'
    ) + (f"\n\nPay close attention to the following instructions when generating scenarios:\n\n{custom_instructions}"
         if custom_instructions else "")


def scenario_response_format(num_scenarios: int) -> dict[str, Any]:
    """The JSON schema the generator is held to: exactly `num_scenarios` {task, difficulty 1-5}."""
    item = {"type": "object", "properties": {"task": {"type": "string"},
                                             "difficulty": {"type": "integer", "minimum": 1, "maximum": 5}},
            "required": ["task", "difficulty"], "additionalProperties": False}
    schema = {"type": "object", "properties": {"scenarios": {"type": "array", "items": item, "minItems": num_scenarios,
                                                             "maxItems": num_scenarios}},
              "required": ["scenarios"], "additionalProperties": False}
    return {"type": "json_schema", "json_schema": {"name": "scenario_list", "schema": schema}}


def parse_scenarios(content: str | None, num_scenarios: int) -> GeneratedScenarioCollection:
    """The generator's reply as scenarios: too few is an error (ART's), too many are cut to `num_scenarios`."""
    if not content:
        raise ValueError("the scenario generator replied with no content")
    try:
        data = json.loads(content)
    except ValueError as error:
        raise ValueError(f"the scenario generator's reply is not JSON ({error}); it begins {content[:200]!r}") from None
    if isinstance(data, dict):
        data = data["scenarios"] if "scenarios" in data else next(iter(data.values()), [])
    if not isinstance(data, list):
        raise ValueError(f"the scenario generator's reply holds no list of scenarios; it begins {content[:200]!r}")
    if len(data) < num_scenarios:
        raise ValueError(f"expected {num_scenarios} scenarios, the generator wrote {len(data)}")
    return GeneratedScenarioCollection.from_dicts(data[:num_scenarios])


async def generate_scenarios(
    tools: Sequence[MCPTool] | Sequence[dict[str, Any]],
    resources: Sequence[MCPResource] | Sequence[dict[str, Any]] | None = (),
    num_scenarios: int = 24,
    show_preview: bool = True,
    custom_instructions: str | None = None,
    generator_model: str | Model = "openai/gpt-4.1-mini",
    generator_api_key: str | None = None,
    generator_base_url: str = OPENROUTER_BASE_URL,
) -> GeneratedScenarioCollection:
    """`num_scenarios` tasks for these tools and resources, written by `generator_model` (see the module docstring)."""
    if not tools and not resources:
        raise ValueError("generate_scenarios: give at least one tool or resource (art_nb.mcp.list_mcp_tools(session))")
    if num_scenarios < 1:
        raise ValueError(f"num_scenarios must be at least 1; got {num_scenarios}")
    started = time.perf_counter()
    prompt = scenario_prompt([_tool_info(t) for t in tools], [_resource_info(r) for r in resources or ()],
                             num_scenarios, custom_instructions)
    request = {"messages": [{"role": "user", "content": prompt}], "max_completion_tokens": 8000,
               "response_format": scenario_response_format(num_scenarios)}
    with no_capture():
        if isinstance(generator_model, Model):
            response = await generator_model.openai_client().chat.completions.create(
                model=generator_model.get_inference_name(), **request)
        else:
            response = await _hosted_completion(generator_model, generator_api_key, generator_base_url, request)
    scenarios = parse_scenarios(response.choices[0].message.content if response.choices else None, num_scenarios)
    if show_preview:
        scenarios.print_difficulty_distribution()
        scenarios.preview(n=min(5, num_scenarios))
        print(f"Generated {len(scenarios)} scenarios in {time.perf_counter() - started:.1f}s")
    return scenarios


async def _hosted_completion(name: str, api_key: str | None, base_url: str, request: dict[str, Any]) -> Any:
    from openai import AsyncOpenAI

    api_key = api_key or os.environ.get("OPENROUTER_API_KEY")
    if not api_key:
        raise ValueError("generate_scenarios: no key for the generator: pass generator_api_key=..., set "
                         "OPENROUTER_API_KEY, or pass an art_nb Model as generator_model")
    async with AsyncOpenAI(api_key=api_key, base_url=base_url, max_retries=2, timeout=600.0) as client:
        return await client.chat.completions.create(model=name, **request)
