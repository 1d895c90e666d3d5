"""Tic-tac-toe: board rules by hand-made boards, move parsing, reward ordering, seeded replay,
and the rollout/evaluate loop against a fake OpenAI client that answers by a scripted policy."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from openai.types.chat.chat_completion import Choice
from conftest import FakeModel

from art_nb.envs import tic_tac_toe as ttt
from art_nb.envs.tic_tac_toe import TicTacToeGame, TicTacToeScenario


def board_of(rows: str) -> ttt.Board:
    """'XO. ... ...' (three rows, spaces between) -> a Board."""
    cells = tuple(rows.replace(" ", ""))
    assert len(cells) == 9
    return cells


# --- board ----------------------------------------------------------------------------------------


def test_cells_are_column_letter_then_row_number_in_reading_order():
    assert ttt.CELLS == ("A1", "B1", "C1", "A2", "B2", "C2", "A3", "B3", "C3")


def test_render_puts_a1_top_left_and_c3_bottom_right():
    board = ttt.place(ttt.place(ttt.empty_board(), "A1", "X"), "C3", "O")
    assert ttt.render(board) == "   A B C\n1  X . .\n2  . . .\n3  . . O"


def test_place_writes_one_cell_and_refuses_a_taken_one():
    board = ttt.place(ttt.empty_board(), "B3", "O")
    assert board == board_of("... ... .O.")
    with pytest.raises(ValueError, match="B3 is already taken by O"):
        ttt.place(board, "B3", "X")


def test_legal_moves_are_the_free_cells_in_order():
    assert ttt.legal_moves(board_of("XO. .X. O..")) == ["C1", "A2", "C2", "B3", "C3"]
    assert ttt.legal_moves(board_of("XOX XOO OXX")) == []


@pytest.mark.parametrize(
    "rows",
    [
        *("XXX ... ...", "... XXX ...", "... ... XXX"),  # rows
        *("X.. X.. X..", ".X. .X. .X.", "..X ..X ..X"),  # columns
        *("X.. .X. ..X", "..X .X. X.."),  # diagonals
    ],
)
def test_every_line_wins(rows):
    assert ttt.winner(board_of(rows)) == "X"
    assert ttt.winner(board_of(rows.replace("X", "O"))) == "O"


@pytest.mark.parametrize("rows", ["... ... ...", "XX. OO. ...", "XOX XOO OXX", "X.O .O. X.."])
def test_no_line_no_winner(rows):
    assert ttt.winner(board_of(rows)) is None


# --- parsing --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "cell"),
    [
        ("<move>B2</move>", "B2"),
        ("<move>c3</move>", "C3"),
        ("<MOVE> a1 </Move>", "A1"),
        ("< move >B1</ move >", "B1"),
        ("I take the center. <move>B2</move> Good luck!", "B2"),
        ("<move>\nA3\n</move>", "A3"),
    ],
)
def test_parse_move_forgives_case_space_and_surrounding_text(text, cell):
    assert ttt.parse_move(text) == cell


@pytest.mark.parametrize(
    "text",
    [
        "B2",  # no tag
        "",
        "<move>B2",  # truncated
        "<move>B2</move><move>C3</move>",  # two tags
        "<move>A1<move>B2</move>",  # nested: the tag holds "A1<move>B2"
        "<move>D1</move>",  # off the board
        "<move>A4</move>",
        "<move>B 2</move>",
        "<move>B22</move>",
        "<move></move>",
        "<position>B2</position>",
    ],
)
def test_parse_move_rejects_anything_but_one_tag_with_one_cell(text):
    assert ttt.parse_move(text) is None


# --- the game -------------------------------------------------------------------------------------


def test_the_seed_decides_who_opens_and_both_happen():
    openers = {seed: TicTacToeGame(TicTacToeScenario(seed)).board.count("O") for seed in range(40)}
    assert set(openers.values()) == {0, 1}
    assert all(TicTacToeGame(TicTacToeScenario(s)).board.count("O") == n for s, n in openers.items())


def test_same_seed_and_moves_replay_the_same_game():
    def boards(seed: int) -> list[ttt.Board]:
        game, seen = TicTacToeGame(TicTacToeScenario(seed)), []
        while not game.over:
            game.play(ttt.legal_moves(game.board)[0])
            seen.append(game.board)
        return seen

    assert boards(7) == boards(7)
    assert len({tuple(boards(s)) for s in range(10)}) > 1  # the opponent really is seeded


def test_model_move_then_opponent_reply():
    game = next(g for s in range(20) if not (g := TicTacToeGame(TicTacToeScenario(s))).board.count("O"))
    game.play("B2")
    assert game.board[4] == "X"
    assert game.board.count("O") == 1 and game.valid_moves == 1 and not game.over


@pytest.mark.parametrize("reply", [None, "taken"])
def test_an_invalid_move_ends_the_game_with_a_negative_reward(reply):
    game = TicTacToeGame(TicTacToeScenario(1))
    game.play("A1" if game.board[0] == "." else "B1")  # one valid move first
    taken = next(c for c, m in zip(ttt.CELLS, game.board) if m != ".")
    before = game.board
    game.play(taken if reply == "taken" else None)
    assert game.over and game.outcome == "invalid"
    assert game.board == before  # the opponent does not move after an invalid reply
    assert game.reward() == pytest.approx(-1.0 + 0.1)
    assert game.metrics() == {"win": 0, "draw": 0, "loss": 0, "invalid": 1, "moves": 1}
    with pytest.raises(RuntimeError, match="over"):
        game.play("C3")


def test_reward_before_the_end_is_an_error():
    with pytest.raises(RuntimeError, match="not over"):
        TicTacToeGame(TicTacToeScenario(0)).reward()


def finished_games() -> list[TicTacToeGame]:
    return [ttt.play_random_game(TicTacToeScenario(seed), player_seed=seed) for seed in range(200)]


def test_random_games_end_in_each_outcome_consistent_with_the_board():
    games = finished_games()
    assert {g.outcome for g in games} == {"win", "draw", "loss"}
    for game in games:
        metrics = game.metrics()
        assert metrics[game.outcome] == 1 and sum(metrics[k] for k in ("win", "draw", "loss", "invalid")) == 1
        assert metrics["moves"] == game.board.count("X")
        expected = {"win": "X", "loss": "O", "draw": None}[game.outcome]
        assert ttt.winner(game.board) == expected
        if game.outcome == "draw":
            assert not ttt.legal_moves(game.board)


def test_reward_orders_win_draw_valid_loss_invalid():
    by_outcome = {g.outcome: g.reward() for g in finished_games()}
    assert by_outcome == {"win": 1.0, "draw": 0.5, "loss": 0.0}
    # the best invalid game: four valid moves, then a bad fifth (the most a game allows before it ends)
    best_invalid = ttt.OUTCOME_REWARD["invalid"] + 4 * ttt.VALID_MOVE_CREDIT
    assert by_outcome["win"] > by_outcome["draw"] > by_outcome["loss"] >= 0 > best_invalid


def test_an_invalid_move_later_beats_one_at_once():
    early, late = TicTacToeGame(TicTacToeScenario(3)), TicTacToeGame(TicTacToeScenario(3))
    early.play(None)
    late.play(ttt.legal_moves(late.board)[0])
    late.play(None)
    assert early.reward() == -1.0
    assert late.reward() > early.reward()


# --- rollout and evaluate against a fake endpoint --------------------------------------------------

Policy = Callable[[str], str]


def first_legal(board_message: str) -> str:
    cell = re.search(r"Legal moves: (\w+)", board_message).group(1)
    return f"<move>{cell}</move>"



async def test_rollout_plays_a_whole_game_one_user_message_per_board():
    model = FakeModel(first_legal)
    trajectory = await ttt.rollout(model, TicTacToeScenario(5), max_completion_tokens=12)

    items = trajectory.messages_and_choices
    assert items[0] == {"role": "system", "content": ttt.SYSTEM_PROMPT}
    assert items[1:3] == ttt.EXAMPLE_TURN
    game_part = items[3:]
    assert [type(m) for m in game_part] == [dict, Choice] * len(model.calls)
    assert all(m["role"] == "user" and "Legal moves:" in m["content"] for m in game_part[::2])

    replay = TicTacToeGame(TicTacToeScenario(5))
    while not replay.over:
        replay.play(ttt.legal_moves(replay.board)[0])
    assert trajectory.reward == replay.reward()
    assert trajectory.metrics == replay.metrics()
    assert trajectory.metrics["invalid"] == 0 and trajectory.metrics["moves"] == len(model.calls)

    first, last = model.calls[0], model.calls[-1]
    assert first["model"] == "tiny@3" and first["logprobs"] is True
    assert first["max_completion_tokens"] == 12 and first["temperature"] == 1.0
    assert last["messages"] == trajectory.messages()[:-1]  # each request carries the whole game so far


async def test_rollout_stops_at_the_first_invalid_reply():
    model = FakeModel(lambda _: "I think the center is best")
    trajectory = await ttt.rollout(model, TicTacToeScenario(0))
    assert len(model.calls) == 1 and len(trajectory.choices()) == 1
    assert trajectory.reward == -1.0
    assert trajectory.metrics == {"win": 0, "draw": 0, "loss": 0, "invalid": 1, "moves": 0}


async def test_rollout_is_reproducible_from_the_scenario():
    a = await ttt.rollout(FakeModel(first_legal), TicTacToeScenario(11))
    b = await ttt.rollout(FakeModel(first_legal), TicTacToeScenario(11))
    assert a.messages() == b.messages() and a.reward == b.reward


async def test_evaluate_is_greedy_and_counts_rates():
    model = FakeModel(first_legal)
    result = await ttt.evaluate(model, n_games=12, seed=100, inference_name="tiny@0", concurrency=3)
    assert {call["temperature"] for call in model.calls} == {0.0}
    assert {call["model"] for call in model.calls} == {"tiny@0"}
    assert result["games"] == 12 and result["valid_move_rate"] == 1.0 and result["invalid"] == 0
    assert result["win"] + result["draw"] + result["loss"] == pytest.approx(1.0)


async def test_evaluate_valid_move_rate_counts_moves_not_games():
    # Always C3: legal once (unless the opponent opened there), then the next reply is invalid.
    result = await ttt.evaluate(FakeModel(lambda _: "<move>C3</move>"), n_games=20, seed=0)
    games = [TicTacToeGame(TicTacToeScenario(s)) for s in range(20)]
    valid = sum(g.board[8] == "." for g in games)
    assert 0 < valid < 20
    assert result["invalid"] == 1.0
    assert result["valid_move_rate"] == pytest.approx(valid / (valid + 20))


async def test_evaluate_needs_a_game():
    with pytest.raises(ValueError, match="at least one game"):
        await ttt.evaluate(FakeModel(first_legal), n_games=0)
