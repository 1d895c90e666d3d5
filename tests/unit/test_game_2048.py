"""2048: slide/merge rules by hand-made rows and boards, spawning, parsing, the game's end
conditions, reward ordering, seeded replay, and the rollout loop against a fake OpenAI client."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable

import pytest
from openai.types.chat.chat_completion import Choice
from conftest import FakeModel

from art_nb.envs import game_2048 as g2048
from art_nb.envs.game_2048 import Game2048, Game2048Scenario

EMPTY_ROW = (0, 0, 0, 0)


def board_of(*rows: tuple[int, ...]) -> g2048.Board:
    return tuple(rows) + (EMPTY_ROW,) * (4 - len(rows))


# --- sliding and merging --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ((2, 2, 2, 2), (4, 4, 0, 0)),  # two merges, not one 8
        ((2, 2, 4, 0), (4, 4, 0, 0)),  # a merged tile does not merge again in the same move
        ((4, 2, 2, 0), (4, 4, 0, 0)),
        ((2, 2, 2, 0), (4, 2, 0, 0)),  # the pair nearest the wall merges first
        ((0, 2, 0, 2), (4, 0, 0, 0)),  # gaps close before merging
        ((2, 0, 0, 2), (4, 0, 0, 0)),
        ((4, 4, 8, 8), (8, 16, 0, 0)),
        ((8, 0, 8, 8), (16, 8, 0, 0)),
        ((2, 4, 2, 4), (2, 4, 2, 4)),  # nothing to do
        ((0, 0, 0, 2), (2, 0, 0, 0)),
        (EMPTY_ROW, EMPTY_ROW),
    ],
)
def test_slide_row_left(row, expected):
    assert g2048.slide_row_left(row) == expected


def test_slide_each_direction_on_one_board():
    board = (
        (2, 2, 0, 4),
        (0, 2, 0, 0),
        (2, 0, 0, 4),
        (4, 0, 0, 8),
    )
    assert g2048.slide(board, "left") == ((4, 4, 0, 0), (2, 0, 0, 0), (2, 4, 0, 0), (4, 8, 0, 0))
    assert g2048.slide(board, "right") == ((0, 0, 4, 4), (0, 0, 0, 2), (0, 0, 2, 4), (0, 0, 4, 8))
    assert g2048.slide(board, "up") == ((4, 4, 0, 8), (4, 0, 0, 8), (0, 0, 0, 0), (0, 0, 0, 0))
    assert g2048.slide(board, "down") == ((0, 0, 0, 0), (0, 0, 0, 0), (4, 0, 0, 8), (4, 4, 0, 8))


def test_right_merges_the_pair_nearest_the_right_wall_first():
    assert g2048.slide(board_of((2, 2, 2, 0)), "right")[0] == (0, 0, 2, 4)
    assert g2048.slide(board_of((2, 2, 2, 2)), "right")[0] == (0, 0, 4, 4)


def test_slide_rejects_an_unknown_direction():
    with pytest.raises(ValueError, match="direction is 'north'"):
        g2048.slide(board_of(), "north")  # type: ignore[arg-type]


def test_valid_moves_are_those_that_change_the_board():
    assert g2048.valid_moves(board_of((2, 0, 0, 0))) == ["right", "down"]
    assert g2048.valid_moves(board_of((2, 4, 0, 0))) == ["right", "down"]
    assert g2048.valid_moves(board_of((2, 2, 0, 0))) == ["left", "right", "down"]
    locked = ((2, 4, 2, 4), (4, 2, 4, 2), (2, 4, 2, 4), (4, 2, 4, 2))
    assert g2048.valid_moves(locked) == []


# --- spawning -------------------------------------------------------------------------------------


def test_spawn_fills_one_empty_cell_with_a_2_or_a_4():
    board = board_of((2, 0, 4, 0), (8, 8, 8, 8), (16, 0, 0, 2), (2, 2, 2, 2))
    for seed in range(50):
        after = g2048.spawn_tile(board, random.Random(seed))
        changed = [(r, c) for r in range(4) for c in range(4) if after[r][c] != board[r][c]]
        assert len(changed) == 1
        r, c = changed[0]
        assert board[r][c] == 0 and after[r][c] in (2, 4)


def test_spawn_is_seeded_and_mostly_2s():
    rng = random.Random(0)
    values = [max(max(row) for row in g2048.spawn_tile(board_of(), rng)) for _ in range(4000)]
    assert 0.08 < values.count(4) / len(values) < 0.12
    first = g2048.spawn_tile(board_of(), random.Random(5))
    assert all(g2048.spawn_tile(board_of(), random.Random(5)) == first for _ in range(3))


def test_spawn_on_a_full_board_is_an_error():
    with pytest.raises(ValueError, match="full"):
        g2048.spawn_tile(((2, 4, 2, 4),) * 4, random.Random(0))


def test_a_new_board_has_two_tiles():
    board = g2048.new_board(random.Random(3))
    assert sum(v != 0 for row in board for v in row) == 2


def test_render_aligns_columns_to_the_widest_tile():
    board = board_of((2, 0, 0, 16), (0, 128, 0, 0))
    assert g2048.render(board) == "  2   .   .  16\n  . 128   .   .\n  .   .   .   .\n  .   .   .   ."


# --- parsing --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "direction"),
    [
        ("<move>left</move>", "left"),
        ("<move>UP</move>", "up"),
        ("<Move> Down </MOVE>", "down"),
        ("Merging the 2s: <move>right</move>", "right"),
    ],
)
def test_parse_move_forgives_case_space_and_surrounding_text(text, direction):
    assert g2048.parse_move(text) == direction


@pytest.mark.parametrize(
    "text",
    ["left", "", "<move>left", "<move>left</move><move>up</move>", "<move>north</move>", "<move>l</move>",
     "<move>left right</move>", "<move></move>"],
)
def test_parse_move_rejects_anything_but_one_tag_with_one_direction(text):
    assert g2048.parse_move(text) is None


# --- the game -------------------------------------------------------------------------------------


def play_first_valid(scenario: Game2048Scenario) -> list[g2048.Board]:
    game, boards = Game2048(scenario), []
    while not game.over:
        game.play(g2048.valid_moves(game.board)[0])
        boards.append(game.board)
    return boards


def test_same_seed_and_moves_replay_the_same_game():
    assert play_first_valid(Game2048Scenario(4)) == play_first_valid(Game2048Scenario(4))
    openings = {Game2048(Game2048Scenario(seed)).board for seed in range(10)}
    assert len(openings) > 1


def test_a_valid_move_slides_then_spawns_one_tile():
    game = Game2048(Game2048Scenario(0))
    game.board = board_of((2, 2, 0, 0))
    game.play("left")
    assert game.board[0][0] == 4 and game.moves == 1
    assert g2048.board_value(game.board) in (6, 8)  # 4 plus a spawned 2 or 4


@pytest.mark.parametrize("direction", [None, "left"])
def test_an_invalid_move_ends_the_game_with_a_negative_reward(direction):
    game = Game2048(Game2048Scenario(0))
    game.board = board_of((2, 4, 0, 0))  # left changes nothing
    game.play(direction)
    assert game.over and game.invalid and game.board == board_of((2, 4, 0, 0))
    assert -1.0 < game.reward() < 0
    assert game.metrics() == {"max_tile": 4, "board_value": 6, "moves": 0, "invalid": 1, "win": 0}
    with pytest.raises(RuntimeError, match="over"):
        game.play("right")


def test_reaching_the_target_wins_with_reward_one():
    game = Game2048(Game2048Scenario(0, target=16))
    game.board = board_of((8, 8, 0, 0))
    assert not game.over
    game.play("right")
    assert game.won and game.over
    assert game.reward() == 1.0
    assert game.metrics()["win"] == 1 and game.metrics()["max_tile"] == 16


def test_a_locked_board_ends_the_game_without_penalty():
    game = Game2048(Game2048Scenario(0))
    game.board = ((2, 4, 2, 4), (4, 2, 4, 2), (2, 4, 2, 4), (4, 2, 4, 2))
    assert game.over and not game.invalid
    assert 0 < game.reward() < 1


def test_the_turn_cap_ends_the_game():
    boards = play_first_valid(Game2048Scenario(1, max_turns=3))
    assert len(boards) == 3


@pytest.mark.parametrize(("field", "value"), [("target", 100), ("target", 4), ("max_turns", 0)])
def test_scenario_rejects_bad_settings(field, value):
    with pytest.raises(ValueError, match=field):
        Game2048Scenario(0, **{field: value})


# --- reward ---------------------------------------------------------------------------------------


def test_score_grows_with_the_largest_tile_and_with_the_sum():
    small = board_of((8, 2, 0, 0))
    bigger_tile = board_of((16, 2, 0, 0))
    bigger_sum = board_of((8, 2, 2, 2))
    assert g2048.board_score(bigger_tile, 64) > g2048.board_score(small, 64)
    assert g2048.board_score(bigger_sum, 64) > g2048.board_score(small, 64)


def test_win_beats_every_unfinished_board_and_every_valid_game_beats_every_invalid_one():
    best_loser = ((32, 32, 32, 32),) * 4  # just short of 64, as full as a board gets
    assert g2048.board_score(best_loser, 64) < 1.0 == g2048.board_score(board_of((64,)), 64)
    worst_valid = g2048.board_score(board_of((2, 2)), 64)
    assert worst_valid > 0 > g2048.INVALID_REWARD + 0.5 * g2048.board_score(best_loser, 64)


def test_an_invalid_move_after_progress_beats_one_at_once():
    early, late = Game2048(Game2048Scenario(0)), Game2048(Game2048Scenario(0))
    early.board = board_of((2, 4, 0, 0))
    late.board = board_of((16, 4, 0, 0))  # left changes neither
    early.play("left")
    late.play("left")
    assert early.invalid and late.invalid
    assert late.reward() > early.reward()


def test_reward_of_a_finished_game_matches_its_score():
    game = Game2048(Game2048Scenario(2, max_turns=5))
    while not game.over:
        game.play(g2048.valid_moves(game.board)[0])
    progress = math.log2(g2048.max_tile(game.board)) / math.log2(64)
    expected = 0.8 * progress + 0.2 * g2048.board_value(game.board) / 128
    assert game.reward() == pytest.approx(expected)


# --- rollout against a fake endpoint --------------------------------------------------------------

Policy = Callable[[str], str]


def first_valid(board_message: str) -> str:
    direction = re.search(r"Valid moves: (\w+)", board_message).group(1)
    return f"<move>{direction}</move>"



async def test_rollout_plays_until_the_turn_cap_one_user_message_per_board():
    model = FakeModel(first_valid)
    scenario = Game2048Scenario(3, max_turns=6)
    trajectory = await g2048.rollout(model, scenario, temperature=0.7)

    items = trajectory.messages_and_choices
    assert items[0] == {"role": "system", "content": g2048.SYSTEM_PROMPT}
    assert items[1:3] == g2048.EXAMPLE_TURN
    assert [type(m) for m in items[3:]] == [dict, Choice] * 6
    assert len(model.calls) == 6
    assert all(call["temperature"] == 0.7 and call["logprobs"] is True for call in model.calls)
    assert model.calls[-1]["messages"] == trajectory.messages()[:-1]

    boards = play_first_valid(scenario)
    assert trajectory.metrics["moves"] == 6 and trajectory.metrics["invalid"] == 0
    assert trajectory.metrics["board_value"] == g2048.board_value(boards[-1])
    assert trajectory.reward == pytest.approx(g2048.board_score(boards[-1], 64))


async def test_rollout_stops_at_a_move_that_changes_nothing():
    # "up" on the first board is valid only if some tile can rise; keep saying it until it cannot.
    model = FakeModel(lambda _: "<move>up</move>")
    trajectory = await g2048.rollout(model, Game2048Scenario(0, max_turns=40))
    assert trajectory.metrics["invalid"] == 1
    assert trajectory.reward < 0
    assert len(model.calls) == trajectory.metrics["moves"] + 1
