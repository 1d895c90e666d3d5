"""2048 on a 4x4 board: a longer multi-turn environment with a graded reward.

Each turn the model sees the board (rows top to bottom, "." for an empty cell) and the moves that
would change it, and answers with one tag: `<move>left</move>`, `right`, `up` or `down`. Tiles
slide that way; two equal tiles that meet merge once per move, nearest the wall first, so
[2, 2, 2, 2] slides left to [4, 4, 0, 0] and [2, 2, 4, 0] to [4, 4, 0, 0], never [8, ...]. After
every move a new tile appears on a random empty cell: 2 with probability 0.9, else 4.

The game ends when the largest tile reaches the scenario's target (a win), when no move changes
the board, after `max_turns` moves (to keep CPU rollouts short), or at the first invalid reply
(unparseable, or a move that changes nothing).

Reward: a win scores 1. Any other finished game scores in [0, 1): 0.8 for the largest tile's
progress toward the target on a log scale plus 0.2 for the sum of the tiles, which grows by about
2.2 a move and so rewards surviving. An invalid reply scores -1 plus half that board score, so any
game that ran its course beats any invalid one, and an invalid one late beats one early.

Defaults suit a small model on a CPU: reaching 64 takes at least ~27 moves (the tiles must add up
to 64, and each move adds 2.2 on average), so target 64 with 40 turns is reachable; 2048 is not.
The scenario's seed fixes every spawned tile, so a game replays exactly given the same moves.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from art_nb.trajectories import Trajectory

if TYPE_CHECKING:
    from art_nb.model import Model

__all__ = [
    "DIRECTIONS",
    "EXAMPLE_TURN",
    "SYSTEM_PROMPT",
    "Game2048",
    "Game2048Scenario",
    "board_score",
    "new_board",
    "parse_move",
    "render",
    "rollout",
    "slide",
    "slide_row_left",
    "spawn_tile",
    "user_message",
    "valid_moves",
]

Board = tuple[tuple[int, ...], ...]
"""Four rows of four tile values, top row first; 0 is an empty cell."""
Direction = Literal["left", "right", "up", "down"]
DIRECTIONS: tuple[Direction, ...] = get_args(Direction)

INVALID_REWARD = -1.0


# --- the game, pure -------------------------------------------------------------------------------


def slide_row_left(row: tuple[int, ...]) -> tuple[int, ...]:
    """One row after a move to the left: tiles packed left, each equal pair merged once."""
    tiles = [value for value in row if value]
    merged: list[int] = []
    i = 0
    while i < len(tiles):
        if i + 1 < len(tiles) and tiles[i] == tiles[i + 1]:
            merged.append(2 * tiles[i])
            i += 2
        else:
            merged.append(tiles[i])
            i += 1
    return tuple(merged + [0] * (len(row) - len(merged)))


def _transpose(board: Board) -> Board:
    return tuple(zip(*board))


def _mirror(board: Board) -> Board:
    return tuple(row[::-1] for row in board)


def slide(board: Board, direction: Direction) -> Board:
    """The board after every tile slides toward `direction` (no new tile yet).

    Every direction is "left" seen in a mirror and/or with rows and columns swapped.
    """
    if direction == "left":
        return tuple(slide_row_left(row) for row in board)
    if direction == "right":
        return _mirror(slide(_mirror(board), "left"))
    if direction == "up":
        return _transpose(slide(_transpose(board), "left"))
    if direction == "down":
        return _transpose(slide(_transpose(board), "right"))
    raise ValueError(f"direction is {direction!r}; expected one of {DIRECTIONS}")


def valid_moves(board: Board) -> list[Direction]:
    """The directions that change the board; an empty list means the game is lost."""
    return [direction for direction in DIRECTIONS if slide(board, direction) != board]


def spawn_tile(board: Board, rng: random.Random) -> Board:
    """The board with a new tile on a random empty cell: 2 with probability 0.9, else 4."""
    empty = [(r, c) for r, row in enumerate(board) for c, value in enumerate(row) if value == 0]
    if not empty:
        raise ValueError("the board is full; there is nowhere to spawn a tile")
    r, c = rng.choice(empty)
    rows = [list(row) for row in board]
    rows[r][c] = 2 if rng.random() < 0.9 else 4
    return tuple(tuple(row) for row in rows)


def new_board(rng: random.Random) -> Board:
    """An empty board with the two tiles every game opens with."""
    board: Board = ((0,) * 4,) * 4
    return spawn_tile(spawn_tile(board, rng), rng)


def max_tile(board: Board) -> int:
    return max(max(row) for row in board)


def board_value(board: Board) -> int:
    """The sum of all tiles (merges keep it; each spawn adds 2 or 4)."""
    return sum(sum(row) for row in board)


def board_score(board: Board, target: int) -> float:
    """How far a game got, in [0, 1]: 1 once the target tile is on the board, below 1 before."""
    if max_tile(board) >= target:
        return 1.0
    progress = math.log2(max_tile(board)) / math.log2(target)
    fill = min(board_value(board) / (2 * target), 1.0)
    return 0.8 * progress + 0.2 * fill


def render(board: Board) -> str:
    """Rows of right-aligned tiles, "." for empty, wide enough for the largest tile."""
    width = len(str(max_tile(board)))
    return "\n".join(" ".join(f"{value or '.':>{width}}" for value in row) for row in board)


_MOVE_TAG = re.compile(r"<\s*move\s*>(.*?)<\s*/\s*move\s*>", re.IGNORECASE | re.DOTALL)


def parse_move(text: str) -> Direction | None:
    """The direction in the reply's single `<move>…</move>` tag, lower-cased; None if malformed."""
    tags = _MOVE_TAG.findall(text)
    if len(tags) != 1:
        return None
    direction = tags[0].strip().lower()
    return direction if direction in DIRECTIONS else None


@dataclass(frozen=True)
class Game2048Scenario:
    """One game's setup. The seed fixes the opening tiles and every tile spawned after a move."""

    seed: int
    target: int = 64
    max_turns: int = 40

    def __post_init__(self) -> None:
        if self.target < 8 or self.target & (self.target - 1):
            raise ValueError(f"target is {self.target}; use a power of two of at least 8, e.g. 64")
        if self.max_turns < 1:
            raise ValueError(f"max_turns is {self.max_turns}; the model needs at least one turn")


class Game2048:
    """A game in progress: `play` a direction, a new tile spawns, until the game is over."""

    def __init__(self, scenario: Game2048Scenario) -> None:
        self.scenario = scenario
        self._rng = random.Random(scenario.seed)
        self.board = new_board(self._rng)
        self.moves = 0
        self.invalid = False

    @property
    def won(self) -> bool:
        return max_tile(self.board) >= self.scenario.target

    @property
    def over(self) -> bool:
        return (
            self.invalid
            or self.won
            or self.moves >= self.scenario.max_turns
            or not valid_moves(self.board)
        )

    def play(self, direction: Direction | None) -> None:
        """Apply the model's move (None = unparseable); a move that changes nothing is invalid."""
        if self.over:
            raise RuntimeError("the game is over; start a new one")
        after = slide(self.board, direction) if direction is not None else self.board
        if after == self.board:
            self.invalid = True
            return
        self.board = spawn_tile(after, self._rng)
        self.moves += 1

    def reward(self) -> float:
        score = board_score(self.board, self.scenario.target)
        return INVALID_REWARD + 0.5 * score if self.invalid else score

    def metrics(self) -> dict[str, int]:
        return {
            "max_tile": max_tile(self.board),
            "board_value": board_value(self.board),
            "moves": self.moves,
            "invalid": int(self.invalid),
            "win": int(self.won),
        }


# --- talking to the model -------------------------------------------------------------------------

SYSTEM_PROMPT = """\
You are playing 2048. Moving slides every tile as far as it goes; two equal tiles that meet merge.
Reply with one valid move inside a move tag and nothing else, for example: <move>left</move>"""


def user_message(board: Board) -> str:
    """What the model sees each turn: the board, the moves that change it, and the format again."""
    return (
        f"{render(board)}\n\n"
        f"Valid moves: {', '.join(valid_moves(board))}\n"
        "Reply with one valid move in a move tag, like <move>left</move>."
    )


_EXAMPLE_BOARD: Board = ((2, 0, 0, 2), (0, 4, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0))
EXAMPLE_TURN: list[dict[str, str]] = [
    {"role": "user", "content": user_message(_EXAMPLE_BOARD)},
    {"role": "assistant", "content": "<move>right</move>"},
]
"""A worked turn shown before the game: a small model follows a shown exchange far more often than
an instruction (with it, 6 of 24 first replies SmolLM2-135M-Instruct sampled at temperature 1 were
valid moves). Context only (an assistant dict, not a Choice), so it is never trained on."""


async def rollout(
    model: Model,
    scenario: Game2048Scenario,
    *,
    temperature: float = 1.0,
    max_completion_tokens: int = 16,
    inference_name: str | None = None,
) -> Trajectory:
    """Play one game of 2048; the trajectory holds every board and every reply."""
    client = model.openai_client()
    game = Game2048(scenario)
    trajectory = Trajectory(
        messages_and_choices=[{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLE_TURN],
        metadata={"seed": scenario.seed, "target": scenario.target},
    )
    while not game.over:
        trajectory.messages_and_choices.append({"role": "user", "content": user_message(game.board)})
        completion = await client.chat.completions.create(
            model=inference_name or model.get_inference_name(),
            messages=trajectory.messages(),
            max_completion_tokens=max_completion_tokens,
            temperature=temperature,
            logprobs=True,
        )
        choice = completion.choices[0]
        trajectory.messages_and_choices.append(choice)
        game.play(parse_move(choice.message.content or ""))

    trajectory.reward = game.reward()
    trajectory.metrics = game.metrics()
    return trajectory
