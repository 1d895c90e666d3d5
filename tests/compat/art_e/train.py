# Source: OpenPipe/ART, examples/art_e/train.py, commit cf58445bee624b54fb954fc7f3c0b3e5bf933613.
# Changed (each changed line says `# CHANGED:`): the import (`art` is art_nb), the base model (the
# offline SmolLM2-135M-Instruct instead of Qwen2.5-3B-Instruct) and the sizes (2 steps instead of 30,
# 2 rollouts a scenario instead of 12, 1 validation rollout instead of 3).
from __future__ import annotations

import asyncio
import random

from dotenv import load_dotenv
from rollout import rollout
from scenarios import SCENARIOS

import art_nb as art  # CHANGED: import art
from art_nb.local import LocalBackend  # CHANGED: from art.local import LocalBackend

load_dotenv()

random.seed(42)

TRAIN_STEPS = 2  # CHANGED: 30
SIMULTANEOUS_ROLLOUTS = 2  # CHANGED: 12
VALIDATION_ROLLOUTS = 1  # CHANGED: 3


async def train() -> None:
    backend = LocalBackend()

    model = art.TrainableModel(
        name="art-e-email-search-001",
        project="art-e",
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",  # CHANGED: Qwen/Qwen2.5-3B-Instruct
    )

    await model.register(backend)

    scenarios = list(SCENARIOS)
    for step in range(await model.get_step(), TRAIN_STEPS):
        random.shuffle(scenarios)

        train_groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(
                    rollout(model, scenario, step=step, is_validation=False)
                    for _ in range(SIMULTANEOUS_ROLLOUTS)
                )
                for scenario in scenarios
            ),
            pbar_desc="train",
            max_exceptions=10,
        )

        val_groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(
                    rollout(model, scenario, step=step, is_validation=True)
                    for _ in range(VALIDATION_ROLLOUTS)
                )
                for scenario in SCENARIOS
            ),
            pbar_desc="val",
            max_exceptions=10,
        )

        await model.log(val_groups)
        await model.delete_checkpoints()
        result = await backend.train(model, train_groups, learning_rate=1e-5)
        await model.log(
            train_groups,
            metrics=result.metrics,
            step=result.step,
            split="train",
        )


if __name__ == "__main__":
    asyncio.run(train())
