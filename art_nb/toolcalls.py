"""Moved to `art_nb.server.toolcalls` (the endpoint's pipeline is its only user); kept importable here."""

from .server.toolcalls import new_tool_call_id, parse_tool_calls

__all__ = ["new_tool_call_id", "parse_tool_calls"]
