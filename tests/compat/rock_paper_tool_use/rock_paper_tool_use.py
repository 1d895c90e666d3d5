# Source: OpenPipe/ART, examples/rock-paper-tool-use.ipynb, commit a160e006b1b7f1c9b80b6df73dc22ad5e1b6f11b
# (the notebook's code cell; the two cells before it are `%autoreload` and a style sheet).
#
# Changed, and nothing else (each changed line says `# CHANGED:`):
# - the import: `art` is art_nb (`import art_nb as art`, `from art_nb.local import LocalBackend`);
# - the base model: the offline SmolLM2-135M-Instruct instead of Qwen2.5-7B-Instruct;
# - the sizes: 4 rollouts a step instead of 64, at most 3 rounds instead of 10, 16 completion tokens
#   instead of 100, and 2 training steps instead of a loop to step 1,000;
# - the notebook's top-level `await`s are the body of `main()` (a script cannot await at top level).
# What it relies on: a round where the model made no tool call is answered with a tool message whose
# `tool_call_id` is "n/a" (ART accepts it), and the base model plays the trained one through the same
# endpoint, under its hub name.
import art_nb as art  # CHANGED: import art
from art_nb.local import LocalBackend  # CHANGED: from art.local import LocalBackend
import asyncio
from dotenv import load_dotenv
import json
from openai.types.chat.chat_completion import ChatCompletion

load_dotenv()

MODEL_NAME = "001"
BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # CHANGED: "Qwen/Qwen2.5-7B-Instruct"

model = art.TrainableModel(
    name=MODEL_NAME, project="rock-paper-tool-use", base_model=BASE_MODEL
)


def get_tool_call_id_and_move(chat_completion: ChatCompletion) -> tuple[str, str]:
    tool_calls = chat_completion.choices[0].message.tool_calls
    if not tool_calls:
        return "n/a", "nothing"
    tool_call = tool_calls[0]
    try:
        return tool_call.id, json.loads(tool_call.function.arguments)["move"]
    except json.JSONDecodeError:
        return tool_call.id, "nothing"
    except KeyError:
        return tool_call.id, "nothing"


async def rollout() -> art.Trajectory:
    tools: art.Tools = [
        {
            "type": "function",
            "function": {
                "name": "play_move",
                "description": "Play a move in rock-paper-scissors",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "move": {
                            "type": "string",
                            "enum": ["rock", "paper", "scissors"],
                            "description": "The move to play",
                        }
                    },
                    "required": ["move"],
                },
            },
        }
    ]
    trajectories = [
        art.Trajectory(
            messages_and_choices=[
                {
                    "role": "system",
                    "content": "You are a rock-paper-scissors playing agent. Use the play_move function tool to declare your moves.",
                },
                {
                    "role": "user",
                    "content": "What will your first move be?",
                },
            ],
            tools=tools,
            reward=0,
            metrics={
                "num_rounds": 0,
                "rock": 0,
                "paper": 0,
                "scissors": 0,
                "nothing": 0,
            },
        )
        for _ in range(2)
    ]
    for _ in range(3):  # CHANGED: range(10)
        chat_completions = await asyncio.gather(
            *[
                client.chat.completions.create(
                    messages=trajectory.messages(),
                    model=model,
                    tools=tools,
                    max_completion_tokens=16,  # CHANGED: 100
                )
                for trajectory, model in zip(trajectories, (MODEL_NAME, BASE_MODEL))
            ]
        )
        for trajectory, chat_completion in zip(trajectories, chat_completions):
            trajectory.messages_and_choices.append(chat_completion.choices[0])
        (id0, move0), (id1, move1) = list(
            map(get_tool_call_id_and_move, chat_completions)
        )
        beats = {
            "rock": "scissors",
            "paper": "rock",
            "scissors": "paper",
            "nothing": None,
        }
        if beats[move0] == move1:
            trajectories[0].reward += 1
        elif beats[move1] == move0:
            trajectories[1].reward += 1
        for trajectory in trajectories:
            trajectory.metrics["num_rounds"] += 1
        trajectories[0].metrics[move0] += 1
        trajectories[1].metrics[move1] += 1
        if max(t.reward for t in trajectories) > 2:
            break
        trajectories[0].messages_and_choices.extend(
            (
                {
                    "role": "tool",
                    "tool_call_id": id0,
                    "content": f"The other player played {move1}.",
                },
                {
                    "role": "user",
                    "content": "What will your next move be?",
                },
            )
        )
        trajectories[1].messages_and_choices.extend(
            (
                {
                    "role": "tool",
                    "tool_call_id": id1,
                    "content": f"The other player played {move0}.",
                },
                {
                    "role": "user",
                    "content": "What will your next move be?",
                },
            )
        )
    return trajectories[0]


async def main() -> art.TrainableModel:  # CHANGED: the notebook's top-level awaits
    global client
    await model.register(LocalBackend())
    client = model.openai_client()
    for i in range(await model.get_step(), 2):  # CHANGED: 1_000
        trajectories = await art.gather_trajectories(
            (rollout() for _ in range(4)), max_exceptions=4  # CHANGED: 64, 64
        )
        await model.train(
            [art.TrajectoryGroup(trajectories)],
            config=art.TrainConfig(learning_rate=5e-5),
        )
    return model
