# Source: OpenPipe/ART, examples/2048/rollout.py, commit 01f7316aff4d3769c46b64c4dd199194a4dd301b.
# Changed (each changed line says `# CHANGED:`): the import (`art` is art_nb) and the size (32
# completion tokens instead of 128). Left out: W&B's weave tracing (`import weave`, `@weave.op`),
# which needs the internet and a W&B key.
import openai
import math
import requests
from dotenv import load_dotenv

import art_nb as art  # CHANGED: import art
from utils import (
    apply_agent_move,
    check_game_finished,
    generate_game,
    max_cell_value,
    total_board_value,
    render_board,
    WINNING_VALUE,
)

load_dotenv()


@art.retry(exceptions=(openai.LengthFinishReasonError, requests.ReadTimeout))
async def rollout(model: art.Model, step: int, is_validation: bool) -> art.Trajectory:
    game = generate_game()

    move_number = 0

    trajectory = art.Trajectory(
        messages_and_choices=[
            {
                "role": "system",
                "content": "You are an excellent 2048 player. Always choose the move most likely to lead to combine cells to eventually reach the number 2048. Optional moves are 'left', 'right', 'up', 'down'. Return your move as an XML object with a single property 'move', like so: <move>left</move>",
            },
        ],
        metadata={
            "game_id": game["id"],
            "step": step,
            "validation": is_validation,
        },
        reward=0,
    )

    while True:
        trajectory.messages_and_choices.append(
            {"role": "user", "content": render_board(game)}
        )

        async def get_completion():
            client = model.openai_client()
            return await client.chat.completions.create(
                max_completion_tokens=32,  # CHANGED: 128
                messages=trajectory.messages(),
                model=model.name,
            )

        try:
            chat_completion = await get_completion()
        except openai.LengthFinishReasonError as e:
            raise e
        except Exception as e:
            print("caught exception generating chat completion", e)
            raise e

        choice = chat_completion.choices[0]
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
            trajectory.metrics["num_moves"] = move_number

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
                trajectory.metrics["win"] = 0
            else:
                # double reward if the agent wins
                trajectory.reward = 2
                trajectory.metrics["win"] = 1
            break

    return trajectory
