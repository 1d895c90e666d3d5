"""Example environments, written to be copied: pure game logic, a prompt, a parser, a reward, and
an ordinary async `rollout(model, scenario)` that talks to the model through its OpenAI client.

- `tic_tac_toe`: three to five turns against a seeded random opponent; `evaluate` gives a fixed
  before/after table. The demo trains on it.
- `game_2048`: a longer game (tens of turns) with a reward graded by the largest tile.
- `orders`: a shop's orders in SQLite, three lookup tools, questions with known answers and a
  checker with partial credit, for a tool-using agent in any framework (the tool-agent notebook).

The games show the one example turn a small model needs before it answers in the `<move>…</move>`
format at all, and both score an invalid reply below any finished game.
"""

from __future__ import annotations

from art_nb.envs import game_2048, orders, tic_tac_toe

__all__ = ["game_2048", "orders", "tic_tac_toe"]
