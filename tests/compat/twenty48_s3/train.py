# Source: OpenPipe/ART, examples/2048/train.py, commit 6e283d55658e3248fdc6a98b68cd2eec15e50cf9
# (ART's 2048 training script: S3 backups and the older `model.train(config=, _config=)` call).
# Changed (each changed line says `# CHANGED:`): the import (`art` is art_nb), the base model (the
# offline SmolLM2-135M-Instruct instead of Qwen2.5-3B-Instruct) and the sizes (2 steps instead of
# 40, 4 rollouts a step instead of 48). S3 is whatever BACKUP_BUCKET and the AWS_* variables point
# at: the test runs a local S3-compatible server (moto).
import asyncio
import os
from dotenv import load_dotenv
import random

import art_nb as art  # CHANGED: import art
from art_nb.local import LocalBackend  # CHANGED: from art.local import LocalBackend
from rollout import rollout

load_dotenv()

random.seed(42)

# Declare the model
model = art.TrainableModel(
    name="tutorial-001",
    project="2048",
    base_model="HuggingFaceTB/SmolLM2-135M-Instruct",  # CHANGED: Qwen/Qwen2.5-3B-Instruct
)


async def main():
    # Initialize the server
    backend = LocalBackend()

    print(f"Pulling from S3 bucket: `{os.environ['BACKUP_BUCKET']}`")
    await backend._experimental_pull_from_s3(
        model,
        verbose=True,
    )

    # Register the model with the local backend (sets up logging, inference, and training)
    await model.register(backend)

    for i in range(await model.get_step(), 2):  # CHANGED: 40
        train_groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(
                    rollout(model, i, is_validation=False) for _ in range(4)  # CHANGED: 48
                )
                for _ in range(1)
            ),
            pbar_desc="gather",
            max_exceptions=10,
        )
        await model.delete_checkpoints()
        await backend._experimental_push_to_s3(
            model,
        )
        await model.train(
            train_groups,
            config=art.TrainConfig(learning_rate=3e-5),
            # Lowering the logprob_calculation_chunk_size is a memory saving measure
            # to allow longer sequences (up to 4096 tokens) to be processed on a T4.
            _config={"logprob_calculation_chunk_size": 8},
        )


if __name__ == "__main__":
    asyncio.run(main())
