"""A tiny MCP server over stdio for the MCP-RL tests: an in-memory notes store with two tools.

Run as a subprocess (`python tests/fakes/notes_mcp_server.py`); each process starts with the same two
notes, so every rollout that opens its own server sees the same store. `add_note` refuses an empty
title as a tool error (is_error), so a rollout meets both kinds of result.
"""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("notes", log_level="ERROR")
NOTES: dict[str, str] = {"groceries": "eggs, milk, bread", "meeting": "Tuesday 10:00 with Ana"}


@server.tool()
def search_notes(query: str) -> str:
    """Find notes whose title or text contains the query (case-insensitive); lists `title: text` lines."""
    hits = [f"{title}: {text}" for title, text in sorted(NOTES.items())
            if query.lower() in title.lower() or query.lower() in text.lower()]
    return "\n".join(hits) or "no note matches"


@server.tool()
def add_note(title: str, text: str) -> str:
    """Save a note under a title (replacing a note of the same title)."""
    if not title.strip():
        raise ToolError("title must not be empty")
    NOTES[title] = text
    return f"saved {title!r} ({len(NOTES)} notes)"


if __name__ == "__main__":
    server.run("stdio")
