# Source: OpenPipe/art-notebooks, examples/2048/2048.ipynb,
# commit db49d0952cbb6d78f9d9b934739064221a36e911 (the notebook's code cells, in order).
#
# Changed, and nothing else (each changed line says `# CHANGED:`):
# - the import: `art` is art_nb (`import art_nb as art`, `from art_nb.utils.strip_logprobs import ...`);
# - the backend: the notebook trains on W&B's ServerlessBackend, which needs the internet and a W&B key;
#   here LocalBackend (art_nb's point: the backend object is the only thing that changes);
# - the base model: the offline SmolLM2-135M-Instruct instead of Qwen/Qwen3.6-27B;
# - the sizes: 2 steps instead of 20, 4 rollouts a step instead of 18, 32 completion tokens instead of 128;
# - the notebook's top-level `await` cells are the body of `main()`.
# Left out, for needing the internet and a W&B key: the cell that requires WANDB_API_KEY, weave tracing
# (`import weave`, `weave.init(...)`, `@weave.op`) and the last cell (a replay video logged to W&B).
# The install cell too (art_nb is installed).

import random
import string
import xml.etree.ElementTree as ET
from typing import Literal, TypedDict

from dotenv import load_dotenv
from PIL import Image, ImageDraw, ImageFont

load_dotenv()

WINNING_VALUE = 64


# Class that keeps track of state for a single game of 2048
class TwentyFortyEightGame(TypedDict):
    id: str
    board: list[list[int | None]]


# Randomly populates a cell on the board with a 2 or 4
def populate_random_cell(game: TwentyFortyEightGame) -> None:
    all_clear_coordinates = [
        (i, j)
        for i in range(len(game["board"]))
        for j in range(len(game["board"][i]))
        if game["board"][i][j] is None
    ]
    random_clear_coordinates = random.choice(all_clear_coordinates)
    # 90% chance to populate a 2, 10% chance to populate a 4
    game["board"][random_clear_coordinates[0]][random_clear_coordinates[1]] = (
        2 if random.random() < 0.9 else 4
    )


# Generates a new game of 2048
def generate_game(board_length: int = 4) -> TwentyFortyEightGame:
    # random 6 character string
    id = "".join(random.choices(string.ascii_letters + string.digits, k=6))
    game = {
        "id": id,
        "board": [[None for _ in range(board_length)] for _ in range(board_length)],
    }

    # populate two random cells
    populate_random_cell(game)
    populate_random_cell(game)

    return game


# Renders the board in a human-readable format
def render_board(game: TwentyFortyEightGame) -> str:
    board = game["board"]
    # print something like this:
    # _    | 2    | _    | 4
    # 4    | 8    | 2    | 16
    # 16   | 32   | 64   | 128
    # _    | 2    | 2    | 4
    # where _ is an empty cell

    max_cell_width = max(
        [len(str(cell)) for row in board for cell in row if cell is not None]
    )

    board_str = ""
    for row in board:
        # pad the cells with spaces to make them the same width
        board_str += "|".join(
            [
                str(cell).rjust(max_cell_width)
                if cell is not None
                else "_".rjust(max_cell_width)
                for cell in row
            ]
        )
        board_str += "\n"
    return board_str


# condense, privileging matches at the start of the sequence
# sequences should be passed starting with cells that are the furthest in the direction in which the board is being condensed
def condense_sequence(sequence: list[int | None]) -> list[int | None]:
    condensed_sequence = []

    gapless_sequence = [cell for cell in sequence if cell is not None]

    i = 0
    while i < len(gapless_sequence):
        if (
            i + 1 < len(gapless_sequence)
            and gapless_sequence[i] == gapless_sequence[i + 1]
        ):
            condensed_sequence.append(gapless_sequence[i] * 2)
            i += 2
        else:
            condensed_sequence.append(gapless_sequence[i])
            i += 1

    # pad the sequence with None at the end
    return condensed_sequence + [None] * (4 - len(condensed_sequence))


# Condenses the board in a given direction
def condense_board(
    game: TwentyFortyEightGame, direction: Literal["left", "right", "up", "down"]
) -> None:
    if direction == "left":
        for row in game["board"]:
            condensed_row = condense_sequence(row)
            for i in range(len(row)):
                row[i] = condensed_row[i]

    if direction == "right":
        for row in game["board"]:
            reversed_row = row[::-1]
            # reverse the row before and after condensing
            condensed_row = condense_sequence(reversed_row)[::-1]
            for i in range(len(row)):
                row[i] = condensed_row[i]

    if direction == "up":
        for col_index in range(len(game["board"][0])):
            column = [row[col_index] for row in game["board"]]

            condensed_column = condense_sequence(column)
            for row_index in range(len(column)):
                game["board"][row_index][col_index] = condensed_column[row_index]

    if direction == "down":
        for col_index in range(len(game["board"][0])):
            column = [row[col_index] for row in game["board"]]
            reversed_column = column[::-1]
            condensed_column = condense_sequence(reversed_column)[::-1]
            for row_index in range(len(column)):
                game["board"][row_index][col_index] = condensed_column[row_index]


# Applies an agent move to the game board
def apply_agent_move(game: TwentyFortyEightGame, move_xml: str) -> None:
    direction = None
    # parse the move
    try:
        root = ET.fromstring(move_xml)
        direction = root.text
    except Exception:
        raise ValueError("Invalid xml")

    if direction not in ["left", "right", "up", "down"]:
        raise ValueError("Invalid direction")

    condense_board(game, direction)

    populate_random_cell(game)


# Returns the maximum cell value on the board
def max_cell_value(game: TwentyFortyEightGame) -> int:
    return max([cell for row in game["board"] for cell in row if cell is not None])


# Returns True if the game is finished
def check_game_finished(game: TwentyFortyEightGame) -> bool:
    if max_cell_value(game) >= WINNING_VALUE:
        return True

    # check if any cell is empty
    if any(cell is None for row in game["board"] for cell in row):
        return False

    return True


# Returns the sum of all the cell values on the board
def total_board_value(game: TwentyFortyEightGame) -> int:
    return sum([cell for row in game["board"] for cell in row if cell is not None])


# Visual style mixing the CoreWeave and Weights & Biases brand palettes:
# W&B: Moon-900 #171A1F, Gold-450 #FCBC32, Moon-50 #FDFDFD, Teal-450 #10BFCC
# CoreWeave: Royal Blue #2741E7, Black #000000, Catskill White #F9FAFC
MOON_900 = (23, 26, 31)  # W&B Moon-900
MOON_50 = (253, 253, 253)  # W&B Moon-50
GOLD_450 = (252, 188, 50)  # W&B Gold-450
TEAL_450 = (16, 191, 204)  # W&B Teal-450
ROYAL_BLUE = (39, 65, 231)  # CoreWeave Royal Blue

BOARD_BACKGROUND_COLOR = MOON_900
EMPTY_TILE_COLOR = (43, 48, 56)  # Moon-900 lifted toward W&B Moon-450 gray
DARK_TEXT_COLOR = MOON_900  # used on bright tiles
LIGHT_TEXT_COLOR = MOON_50  # used on dark tiles
GOLD_COLOR = GOLD_450

# value: (tile fill, text color) — white through W&B golds and teals
# into CoreWeave royal blues, with 2048 crowned in W&B gold
TILE_STYLES = {
    2: (MOON_50, DARK_TEXT_COLOR),
    4: ((254, 227, 164), DARK_TEXT_COLOR),  # soft gold tint
    8: (GOLD_450, DARK_TEXT_COLOR),
    16: ((235, 156, 21), DARK_TEXT_COLOR),  # deep amber gold
    32: (TEAL_450, DARK_TEXT_COLOR),
    64: ((11, 150, 161), LIGHT_TEXT_COLOR),  # deep teal
    128: ((99, 122, 240), LIGHT_TEXT_COLOR),  # light royal blue
    256: (ROYAL_BLUE, LIGHT_TEXT_COLOR),
    512: ((31, 52, 190), LIGHT_TEXT_COLOR),  # deep royal blue
    1024: ((24, 41, 150), LIGHT_TEXT_COLOR),  # navy royal blue
    2048: (GOLD_450, DARK_TEXT_COLOR),
}
SUPER_TILE_STYLE = ((0, 0, 0), GOLD_450)  # values > 2048: CoreWeave black + gold


def _load_font(font_size: int) -> ImageFont.ImageFont:
    for font_name in ["DejaVuSans-Bold.ttf", "DejaVuSans.ttf", "Arial.ttf"]:
        try:
            return ImageFont.truetype(font_name, font_size)
        except OSError:
            continue
    return ImageFont.load_default()


# Renders the board as a PIL image in the classic 2048 style
def render_board_image(game: TwentyFortyEightGame, size: int = 400) -> Image.Image:
    board = game["board"]
    board_length = len(board)

    image = Image.new("RGB", (size, size), BOARD_BACKGROUND_COLOR)
    draw = ImageDraw.Draw(image)

    padding = size // 40
    tile_size = (size - padding * (board_length + 1)) // board_length
    corner_radius = max(2, tile_size // 12)

    for row_index in range(board_length):
        for col_index in range(board_length):
            value = board[row_index][col_index]
            x0 = padding + col_index * (tile_size + padding)
            y0 = padding + row_index * (tile_size + padding)
            x1 = x0 + tile_size
            y1 = y0 + tile_size

            if value is None:
                tile_color, text_color = EMPTY_TILE_COLOR, LIGHT_TEXT_COLOR
            else:
                tile_color, text_color = TILE_STYLES.get(value, SUPER_TILE_STYLE)

            draw.rounded_rectangle(
                [x0, y0, x1, y1], radius=corner_radius, fill=tile_color
            )

            if value is None:
                continue

            text = str(value)
            # adaptive font size: smaller text for longer numbers
            if len(text) <= 1:
                font_size = tile_size // 2
            elif len(text) == 2:
                font_size = int(tile_size / 2.5)
            else:
                font_size = tile_size // 3
            font = _load_font(font_size)

            text_bbox = draw.textbbox((0, 0), text, font=font)
            text_width = text_bbox[2] - text_bbox[0]
            text_height = text_bbox[3] - text_bbox[1]
            draw.text(
                (
                    x0 + (tile_size - text_width) / 2 - text_bbox[0],
                    y0 + (tile_size - text_height) / 2 - text_bbox[1],
                ),
                text,
                font=font,
                fill=text_color,
            )

    return image


# Renders a final scoreboard screen as a PIL image
def render_end_screen(
    won: bool, max_value: int, board_value: int, moves: int, size: int = 400
) -> Image.Image:
    image = Image.new("RGB", (size, size), BOARD_BACKGROUND_COLOR)
    draw = ImageDraw.Draw(image)

    # scoreboard frame
    frame_margin = size // 10
    draw.rounded_rectangle(
        [frame_margin, frame_margin, size - frame_margin, size - frame_margin],
        radius=size // 25,
        fill=EMPTY_TILE_COLOR,
    )

    title = "You win!" if won else "Game over"
    title_color = GOLD_COLOR if won else (99, 122, 240)  # gold win, royal blue loss
    title_font = _load_font(size // 9)
    title_bbox = draw.textbbox((0, 0), title, font=title_font)
    title_width = title_bbox[2] - title_bbox[0]
    draw.text(
        (
            (size - title_width) / 2 - title_bbox[0],
            frame_margin + size // 16,
        ),
        title,
        font=title_font,
        fill=title_color,
    )

    lines = [
        f"moves: {moves}",
        f"max tile: {max_value}",
        f"board value: {board_value}",
        f"target: {WINNING_VALUE}",
    ]
    line_font = _load_font(size // 16)
    line_y = frame_margin + size // 4
    line_spacing = size // 10
    for line in lines:
        line_bbox = draw.textbbox((0, 0), line, font=line_font)
        line_width = line_bbox[2] - line_bbox[0]
        draw.text(
            ((size - line_width) / 2 - line_bbox[0], line_y),
            line,
            font=line_font,
            fill=LIGHT_TEXT_COLOR,
        )
        line_y += line_spacing

    return image


from dotenv import load_dotenv

import art_nb as art  # CHANGED: import art
from art_nb.local import LocalBackend  # CHANGED: from art.serverless.backend import ServerlessBackend

load_dotenv()

random.seed(42)

import math

import requests
from openai import AsyncOpenAI
from pydantic import BaseModel

import art_nb as art  # CHANGED: import art
from art_nb.utils.strip_logprobs import strip_logprobs  # CHANGED: from art.utils.strip_logprobs

class Scenario2048(BaseModel):
    step: int


@art.retry(exceptions=(requests.ReadTimeout))
async def rollout(model: art.Model, scenario: Scenario2048) -> art.Trajectory:
    client = AsyncOpenAI(
        base_url=model.inference_base_url,
        api_key=model.inference_api_key,
    )
    game = generate_game()

    move_number = 0

    trajectory = art.Trajectory(
        messages_and_choices=[
            {
                "role": "system",
                "content": "You are an excellent 2048 player. Always choose the move most likely to lead to combine cells to eventually reach the number 2048. Optional moves are 'left', 'right', 'up', 'down'. Return your move as an XML object with a single property 'move', like so: <move>left</move>",
            }
        ],
        metadata={
            "game_id": game["id"],
            "notebook-id": "2048",
            "step": scenario.step,
        },
        reward=0,
    )

    while True:
        trajectory.messages_and_choices.append(
            {"role": "user", "content": render_board(game)}
        )

        try:
            messages = trajectory.messages()
            chat_completion = await client.chat.completions.create(
                max_completion_tokens=32,  # CHANGED: 128
                messages=messages,
                model=model.get_inference_name(),
                extra_body={
                    "return_token_ids": True,
                    "return_tokens_as_token_ids": True,
                },
            )
        except Exception as e:
            print("caught exception generating chat completion", e)
            raise e

        choice = chat_completion.choices[0]
        payload = chat_completion.model_dump(mode="python")
        choice.model_extra["prompt_token_ids"] = payload["prompt_token_ids"]
        choice.model_extra["token_ids"] = payload["choices"][0]["token_ids"]
        content = choice.message.content
        assert isinstance(content, str)
        trajectory.messages_and_choices.append(choice)

        try:
            apply_agent_move(game, content)
            move_number += 1
        except ValueError:
            trajectory.reward = -1
            break

        if check_game_finished(game):
            max_value = max_cell_value(game)
            board_value = total_board_value(game)
            trajectory.metrics["max_value"] = max_value
            trajectory.metrics["board_value"] = board_value
            trajectory.metrics["move_number"] = move_number

            # try to get as close to the winning value as possible
            # otherwise, try to maximize number of high cells on board
            # but above all else: WIN THE GAME!
            if max_value < WINNING_VALUE:
                # scale max value logarithmically between 0 for 2 and 1 for WINNING_VALUE
                max_value_reward = (math.log(max_value, 2) - 1) / (
                    math.log(WINNING_VALUE, 2) - 1
                )
                # scale board value logarithmically between 0 for 2 * 16 and 1 for WINNING_VALUE * 16
                board_value_reward = (math.log(board_value, 2) - 1) / (
                    math.log(WINNING_VALUE * 16, 2) - 1
                )
                # combine the two rewards, with max value having a higher weight
                trajectory.reward = max_value_reward + (board_value_reward * 0.2)
            else:
                # double reward if the agent wins
                trajectory.reward = 2
            break

    return trajectory


async def main():  # CHANGED: the notebook's top-level await cells, in order
    # Declare the model
    model = art.TrainableModel(
        name="agent-001",
        project="2048",
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",  # CHANGED: Qwen/Qwen3.6-27B
    )

    # Initialize the server
    # Training and inference will run on Weights & Biases servers
    backend = LocalBackend()  # CHANGED: ServerlessBackend()

    # Register the model with the Serverless Backend (sets up logging, inference, and training)
    await model.register(backend)

    for i in range(await model.get_step(), 2):  # CHANGED: 20
        train_groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(rollout(model, Scenario2048(step=i)) for _ in range(4))  # CHANGED: 18
                for _ in range(1)
            ),
            pbar_desc="gather",
            max_exceptions=18,
        )
        train_result = await backend.train(
            model,
            train_groups,
            learning_rate=1e-5,
        )

        await model.log(
            train_groups,
            metrics=train_result.metrics,
            step=train_result.step,
            split="train",
        )

        await model.delete_checkpoints("train/reward")
    return model
