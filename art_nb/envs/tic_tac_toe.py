"""Tic-tac-toe against a seeded random opponent: the smallest multi-turn environment.

The model plays X, a random opponent plays O. Cells are named like a spreadsheet: a column letter
A-C (left to right) then a row number 1-3 (top to bottom), so A1 is the top-left corner and C3 the
bottom-right::

       A B C
    1  X . .
    2  . O .
    3  . . .

Every turn the model gets one user message with the board and the list of legal moves, and answers
with exactly one tag such as `<move>B2</move>`. A reply that does not name a free cell ends the game.

Reward: win 1, draw 0.5, loss 0. An invalid move scores -1 plus 0.1 per valid move made before it,
so any finished game (even a loss, >= 0) beats any invalid one (<= -0.6), and lasting longer beats
failing at once. That small credit matters: an untrained small model mostly fails the format, and
GRPO only learns from groups whose rewards differ.

The scenario's seed fixes who starts and every opponent choice, so evaluation is reproducible.
"""

from __future__ import annotations

import asyncio
import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from art_nb.trajectories import Trajectory

if TYPE_CHECKING:
    from art_nb.model import Model

__all__ = [
    "CELLS",
    "EXAMPLE_TURN",
    "SYSTEM_PROMPT",
    "TicTacToeGame",
    "TicTacToeScenario",
    "empty_board",
    "evaluate",
    "legal_moves",
    "parse_move",
    "place",
    "play_random_game",
    "render",
    "rollout",
    "user_message",
    "winner",
]

Board = tuple[str, ...]
"""Nine cells in reading order (A1, B1, C1, A2, ...), each "X", "O" or "."."""
Outcome = Literal["win", "draw", "loss", "invalid"]

MODEL_MARK, OPPONENT_MARK, EMPTY = "X", "O", "."
CELLS: tuple[str, ...] = tuple(f"{column}{row}" for row in "123" for column in "ABC")
_LINES = (
    (0, 1, 2), (3, 4, 5), (6, 7, 8),  # rows
    (0, 3, 6), (1, 4, 7), (2, 5, 8),  # columns
    (0, 4, 8), (2, 4, 6),  # diagonals
)  # fmt: skip

OUTCOME_REWARD: dict[Outcome, float] = {"win": 1.0, "draw": 0.5, "loss": 0.0, "invalid": -1.0}
VALID_MOVE_CREDIT = 0.1
"""Added per valid move to an invalid game's reward; 4 valid moves at most keep it below 0."""


# --- the game, pure -------------------------------------------------------------------------------


def empty_board() -> Board:
    return (EMPTY,) * 9


def legal_moves(board: Board) -> list[str]:
    """Names of the free cells, in reading order."""
    return [cell for cell, mark in zip(CELLS, board) if mark == EMPTY]


def place(board: Board, cell: str, mark: str) -> Board:
    """The board after `mark` is written on the free `cell`."""
    index = CELLS.index(cell)
    if board[index] != EMPTY:
        raise ValueError(f"cell {cell} is already taken by {board[index]}")
    return board[:index] + (mark,) + board[index + 1 :]


def winner(board: Board) -> str | None:
    """The mark that owns a full line, or None."""
    for a, b, c in _LINES:
        if board[a] != EMPTY and board[a] == board[b] == board[c]:
            return board[a]
    return None


def render(board: Board) -> str:
    """The board as a small text grid with column letters and row numbers."""
    rows = [f"{row}  " + " ".join(board[3 * (row - 1) : 3 * row]) for row in (1, 2, 3)]
    return "\n".join(["   A B C", *rows])


_MOVE_TAG = re.compile(r"<\s*move\s*>(.*?)<\s*/\s*move\s*>", re.IGNORECASE | re.DOTALL)


def parse_move(text: str) -> str | None:
    """The cell named by the reply's single `<move>…</move>` tag, upper-cased; None if malformed.

    Case and spaces are forgiven (`<Move> b2 </move>` is B2); zero tags, two tags, or a tag that
    does not hold exactly one cell name are not. Whether the cell is free is the game's business.
    """
    tags = _MOVE_TAG.findall(text)
    if len(tags) != 1:
        return None
    cell = tags[0].strip().upper()
    return cell if cell in CELLS else None


@dataclass(frozen=True)
class TicTacToeScenario:
    """One game's setup. The seed decides who opens and every move the random opponent makes."""

    seed: int


class TicTacToeGame:
    """A game in progress, from the model's side: `play` the model's move, the opponent replies."""

    def __init__(self, scenario: TicTacToeScenario) -> None:
        self._rng = random.Random(scenario.seed)
        self.board = empty_board()
        self.outcome: Outcome | None = None
        self.valid_moves = 0
        if self._rng.random() < 0.5:
            self._opponent_moves()

    @property
    def over(self) -> bool:
        return self.outcome is not None

    def play(self, cell: str | None) -> None:
        """Apply the model's move (None = unparseable); then the opponent's, unless the game ended."""
        if self.over:
            raise RuntimeError(f"the game is over ({self.outcome}); start a new one")
        if cell is None or cell not in legal_moves(self.board):
            self.outcome = "invalid"
            return
        self.board = place(self.board, cell, MODEL_MARK)
        self.valid_moves += 1
        if not self._settle():
            self._opponent_moves()

    def reward(self) -> float:
        if self.outcome is None:
            raise RuntimeError("the game is not over yet")
        if self.outcome == "invalid":
            return OUTCOME_REWARD["invalid"] + VALID_MOVE_CREDIT * self.valid_moves
        return OUTCOME_REWARD[self.outcome]

    def metrics(self) -> dict[str, int]:
        outcomes = {name: int(self.outcome == name) for name in ("win", "draw", "loss", "invalid")}
        return {**outcomes, "moves": self.valid_moves}

    def _opponent_moves(self) -> None:
        self.board = place(self.board, self._rng.choice(legal_moves(self.board)), OPPONENT_MARK)
        self._settle()

    def _settle(self) -> bool:
        """Record the outcome if the last move ended the game; say whether it did."""
        mark = winner(self.board)
        if mark is not None:
            self.outcome = "win" if mark == MODEL_MARK else "loss"
        elif not legal_moves(self.board):
            self.outcome = "draw"
        return self.over


def play_random_game(scenario: TicTacToeScenario, player_seed: int = 0) -> TicTacToeGame:
    """A finished game where the model's side picks uniformly among legal moves: the baseline."""
    player = random.Random(player_seed)
    game = TicTacToeGame(scenario)
    while not game.over:
        game.play(player.choice(legal_moves(game.board)))
    return game


# --- talking to the model -------------------------------------------------------------------------

SYSTEM_PROMPT = """\
You are playing tic-tac-toe as X. Cells are named by column (A, B, C) and row (1, 2, 3).
Reply with one legal move inside a move tag and nothing else, for example: <move>B2</move>"""


def user_message(board: Board) -> str:
    """What the model sees each turn: the board, its legal moves, and the answer format again."""
    return (
        f"{render(board)}\n\n"
        f"Legal moves: {', '.join(legal_moves(board))}\n"
        "Reply with one legal move in a move tag, like <move>B2</move>."
    )


EXAMPLE_TURN: list[dict[str, str]] = [
    {"role": "user", "content": user_message(place(empty_board(), "A1", OPPONENT_MARK))},
    {"role": "assistant", "content": "<move>C3</move>"},
]
"""A worked turn shown before the game. Instructions alone do not reach SmolLM2-135M-Instruct:
0 of 40 first replies sampled at temperature 1 were legal moves. After this one example, 14 of 40
were, so rewards within a group differ and GRPO has something to learn from. It is context only
(an assistant dict, not a Choice), so it is never trained on."""


async def rollout(
    model: Model,
    scenario: TicTacToeScenario,
    *,
    temperature: float = 1.0,
    max_completion_tokens: int = 16,
    inference_name: str | None = None,
) -> Trajectory:
    """Play one game with the model as X; the trajectory holds every board and every reply."""
    client = model.openai_client()
    game = TicTacToeGame(scenario)
    trajectory = Trajectory(
        messages_and_choices=[{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLE_TURN],
        metadata={"seed": scenario.seed},
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


async def evaluate(
    model: Model,
    n_games: int,
    seed: int = 10_000,
    *,
    inference_name: str | None = None,
    concurrency: int = 8,
) -> dict[str, float]:
    """Greedy (temperature 0) play on `n_games` fixed scenarios: a before/after table that holds still.

    Scenarios use seeds `seed .. seed + n_games - 1`; keep them apart from the training seeds.
    Pass `inference_name="{name}@0"` to score the base model after training has moved on.
    Returns rates of win/draw/loss/invalid per game, `valid_move_rate` (valid model moves over
    all model moves) and the mean reward.
    """
    if n_games < 1:
        raise ValueError(f"n_games is {n_games}; evaluate needs at least one game")
    slots = asyncio.Semaphore(concurrency)

    async def one(game_seed: int) -> Trajectory:
        async with slots:
            return await rollout(
                model,
                TicTacToeScenario(seed=game_seed),
                temperature=0.0,
                inference_name=inference_name,
            )

    trajectories = await asyncio.gather(*(one(seed + i) for i in range(n_games)))
    outcomes = ("win", "draw", "loss", "invalid")
    count = {key: sum(t.metrics[key] for t in trajectories) for key in (*outcomes, "moves")}
    return {
        "games": n_games,
        # A game makes at least one attempt, and only its last attempt can be invalid.
        "valid_move_rate": count["moves"] / (count["moves"] + count["invalid"]),
        **{key: count[key] / n_games for key in outcomes},
        "reward": sum(t.reward for t in trajectories) / n_games,
    }
