# Source: OpenPipe/art-notebooks, examples/tic_tac_toe/tic-tac-toe.ipynb,
# commit db49d0952cbb6d78f9d9b934739064221a36e911 (the notebook's code cells, in order).
#
# Changed, and nothing else (each changed line says `# CHANGED:`):
# - the import: `art` is art_nb (`import art_nb as art`, `from art_nb.local import LocalBackend`);
# - the base model: the offline SmolLM2-135M-Instruct instead of Qwen2.5-3B-Instruct;
# - the sizes: 4 rollouts a step instead of 48, 32 completion tokens instead of 128;
# - the notebook's top-level `await` cells are the body of `main()` (a script cannot await at top level).
# Left out: the install cell (art_nb is installed), W&B's weave tracing (`import weave`, `weave.init`,
# `@weave.op`: it needs the internet and a W&B key; nothing is traced), and the last cell, which loads
# the checkpoint with Unsloth on CUDA to play a game (no GPU here; the checkpoint it loads is checked
# by the test instead).

import os

# Optional
WANDB_API_KEY = ""
if WANDB_API_KEY:
    os.environ["WANDB_API_KEY"] = WANDB_API_KEY

import random
import xml.etree.ElementTree as ET
from typing import Literal, TypedDict


class TicTacToeGame(TypedDict):
    board: list[list[str]]
    agent_symbol: Literal["x", "o"]
    opponent_symbol: Literal["x", "o"]


def generate_game(board_length: int = 3) -> TicTacToeGame:
    board = [["_" for _ in range(board_length)] for _ in range(board_length)]
    agent_symbol = random.choice(["x", "o"])
    opponent_symbol = "x" if agent_symbol == "o" else "o"
    return {
        "board": board,
        "agent_symbol": agent_symbol,
        "opponent_symbol": opponent_symbol,
    }


def render_board(game: TicTacToeGame) -> str:
    board = game["board"]
    board_length = len(board)
    # print something like this:
    #    1   2   3
    # A  _ | x | x
    # B  o | _ | _
    # C  _ | o | _
    # where _ is an empty cell

    board_str = "   " + "   ".join([str(i + 1) for i in range(board_length)]) + "\n"
    for i in range(board_length):
        board_str += f"{chr(65 + i)}  {board[i][0]} | {board[i][1]} | {board[i][2]}\n"
    return board_str


def get_opponent_move(game: TicTacToeGame) -> tuple[int, int]:
    # get a random empty cell
    empty_cells = [
        (i, j) for i in range(3) for j in range(3) if game["board"][i][j] == "_"
    ]
    return random.choice(empty_cells)


def apply_agent_move(game: TicTacToeGame, move: str) -> None:
    board_length = len(game["board"])

    try:
        root = ET.fromstring(move)
        square = root.text
    except Exception:
        raise ValueError("Invalid xml")

    try:
        row_index = ord(square[0]) - 65
        col_index = int(square[1]) - 1
    except Exception as e:
        print(e)
        raise ValueError("Unable to parse square")

    if (
        row_index < 0
        or row_index >= board_length
        or col_index < 0
        or col_index >= board_length
    ):
        raise ValueError(
            f"Invalid move, row or column out of bounds: {row_index}, {col_index}"
        )

    # check if the move is valid
    if game["board"][row_index][col_index] != "_":
        raise ValueError("Square already occupied")

    game["board"][row_index][col_index] = game["agent_symbol"]


def check_winner(board: list[list[str]]) -> Literal["x", "o", "draw", None]:
    board_length = len(board)
    # check rows
    for row in board:
        if row.count(row[0]) == board_length and row[0] != "_":
            return row[0]
    # check columns
    for col in range(board_length):
        if [board[row][col] for row in range(board_length)].count(
            board[0][col]
        ) == board_length and board[0][col] != "_":
            return board[0][col]

    # top right to bottom left
    upward_diagonal = [board[i][board_length - i - 1] for i in range(board_length)]
    if (
        upward_diagonal.count(upward_diagonal[0]) == board_length
        and upward_diagonal[0] != "_"
    ):
        return upward_diagonal[0]

    # top left to bottom right
    downward_diagonal = [board[i][i] for i in range(board_length)]
    if (
        downward_diagonal.count(downward_diagonal[0]) == board_length
        and downward_diagonal[0] != "_"
    ):
        return downward_diagonal[0]

    # check for draw
    if all(cell != "_" for row in board for cell in row):
        return "draw"
    return None


from dotenv import load_dotenv

import art_nb as art  # CHANGED: import art
from art_nb.local import LocalBackend  # CHANGED: from art.local import LocalBackend

load_dotenv()

random.seed(42)

backend = LocalBackend(path="./.art")

import math

import openai
from openai import AsyncOpenAI
from pydantic import BaseModel


class TicTacToeScenario(BaseModel):
    step: int


@art.retry(exceptions=(openai.LengthFinishReasonError,))
async def rollout(model: art.Model, scenario: TicTacToeScenario) -> art.Trajectory:
    game = generate_game()

    trajectory = art.Trajectory(
        messages_and_choices=[
            {
                "role": "system",
                "content": f"You are a tic-tac-toe player. You are playing against an opponent. Always choose the move most likely to lead to an eventual win. Return your move as an XML object with a single property 'move', like so: <move>A1</move>. Optional moves are 'A1', 'B3', 'C2', etc. You are the {game['agent_symbol']} symbol.",
            }
        ],
        metadata={
            "notebook-id": "tic-tac-toe",
            "step": scenario.step,
        },
        reward=0,
    )

    move_number = 0

    if game["agent_symbol"] == "o":
        starting_opponent_move = get_opponent_move(game)
        game["board"][starting_opponent_move[0]][starting_opponent_move[1]] = game[
            "opponent_symbol"
        ]

    while check_winner(game["board"]) is None:
        trajectory.messages_and_choices.append(
            {"role": "user", "content": render_board(game)}
        )

        messages = trajectory.messages()

        try:
            client = AsyncOpenAI(
                base_url=model.inference_base_url,
                api_key=model.inference_api_key,
            )

            chat_completion = await client.chat.completions.create(
                model=model.get_inference_name(),
                messages=messages,
                max_completion_tokens=32,  # CHANGED: 128
            )
        except openai.LengthFinishReasonError as e:
            raise e
        except Exception as e:
            print("caught exception generating chat completion")
            print(e)
            global failing_trajectory
            failing_trajectory = trajectory
            raise e

        choice = chat_completion.choices[0]
        content = choice.message.content
        assert isinstance(content, str)
        trajectory.messages_and_choices.append(choice)

        try:
            apply_agent_move(game, content)
        except ValueError:
            trajectory.reward = -1 + (math.log(move_number + 1) / math.log(100))
            break

        move_number += 1
        if check_winner(game["board"]) is not None:
            break

        opponent_move = get_opponent_move(game)
        game["board"][opponent_move[0]][opponent_move[1]] = game["opponent_symbol"]

    winner = check_winner(game["board"])

    if winner == game["agent_symbol"]:
        trajectory.reward = 1
        trajectory.metrics["win"] = 1
    elif winner == game["opponent_symbol"]:
        trajectory.reward = 0
        trajectory.metrics["win"] = 0
    elif winner == "draw":
        trajectory.reward = 0.5
        trajectory.metrics["win"] = 0.5

    trajectory.metrics["num_moves"] = move_number

    return trajectory


async def main():  # CHANGED: the notebook's top-level await cells, in order
    global model

    model = art.TrainableModel(
        name="001-script",
        project="tic-tac-toe",
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",  # CHANGED: Qwen/Qwen2.5-3B-Instruct
    )
    await model.register(backend)

    TRAINING_STEPS = 2
    ROLLOUTS_PER_STEP = 4  # CHANGED: 48
    LEARNING_RATE = 5e-5

    for i in range(await model.get_step(), TRAINING_STEPS):
        train_groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(
                    rollout(model, TicTacToeScenario(step=i))
                    for _ in range(ROLLOUTS_PER_STEP)
                )
                for _ in range(1)
            ),
            pbar_desc="gather",
        )
        train_result = await backend.train(
            model,
            train_groups,
            learning_rate=LEARNING_RATE,
        )

        await model.log(
            train_groups,
            metrics=train_result.metrics,
            step=train_result.step,
            split="train",
        )

        await model.delete_checkpoints()

    from pathlib import Path

    # example: .art/tic-tac-toe/models/002/checkpoints/0003
    lora_model_path = (
        f".art/{model.project}/models/{model.name}/checkpoints/{await model.get_step():04d}"
    )
    return model, lora_model_path
