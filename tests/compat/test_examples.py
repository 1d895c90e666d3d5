"""Real ART examples, each copied with only the import, the base model and the sizes changed (each
file's header names its source, commit and changes), run for two training steps on the CPU model.

What is asserted is what the example itself relies on: it runs to the end, the model reached step 2,
the run's records are on disk once per step, and the checkpoints it keeps are there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import art_nb as art
from art_nb.store import HISTORY_FILE, checkpoint_steps, read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.compat]

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"


def history(model_dir: Path) -> list[dict]:
    return read_jsonl(model_dir / HISTORY_FILE)


async def test_tic_tac_toe_notebook(example):
    script = example("tic_tac_toe_notebook", "tic_tac_toe")
    model, lora_model_path = await script.main()
    assert await model.get_step() == 2 and model.get_inference_name() == "001-script@2"
    model_dir = Path(".art/tic-tac-toe/models/001-script")
    assert Path(lora_model_path).exists() and checkpoint_steps(model_dir / "checkpoints") == [2]
    train_lines = [line for line in history(model_dir) if line["split"] == "train"]
    # Per step: the rollouts (recorded by backend.train) and the trainer's metrics; model.log added nothing.
    assert [line["step"] for line in train_lines] == [0, 0, 1, 1]
    assert sum("train/reward" in line for line in train_lines) == 2
    assert all(line["train/exceptions"] == 0 for line in train_lines if "train/exceptions" in line)

    # ART's benchmark pattern (examples/tic_tac_toe/train.py, GENERATE_BENCHMARKS): a comparison model
    # behind an endpoint, registered for logging, plays through the same rollout. Here the baseline is
    # the base model, which the endpoint serves under its hub name.
    baseline = art.Model(name="base-model", project="tic-tac-toe", inference_model_name=TINY,
                         inference_base_url=model.inference_base_url, inference_api_key=model.inference_api_key)
    await baseline.register(script.backend)
    trajectories = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(script.rollout(baseline, script.TicTacToeScenario(step=0)) for _ in range(2))
         for _ in range(1)), pbar_desc="gather base-model", max_exceptions=1)
    await baseline.log(trajectories, split="val")
    logged = history(Path(".art/tic-tac-toe/models/base-model"))
    assert logged[-1]["val/trajectories"] == 2 and logged[-1]["val/exceptions"] == 0


async def test_2048_notebook(example):
    script = example("twenty48_notebook", "twenty48")
    model = await script.main()
    assert await model.get_step() == 2
    model_dir = Path(".art/2048/models/agent-001")
    lines = history(model_dir)
    # delete_checkpoints("train/reward"): the served step and the step whose rollouts scored best
    rewards = {line["step"]: line["train/reward"] for line in lines if "train/reward" in line}
    best = max(rewards, key=lambda step: (rewards[step], step))
    assert checkpoint_steps(model_dir / "checkpoints") == sorted({best, 2})
    records = read_jsonl(model_dir / "trajectories" / "train" / "0000.jsonl")
    assert len(records) == 4 and all(r["messages"][0]["role"] == "system" for r in records)
    # No rollout failed (max_exceptions=18 would have hidden it): e.g. the rollout reads
    # payload["prompt_token_ids"] and payload["choices"][0]["token_ids"], vLLM's extra_body fields.
    assert [line["train/exceptions"] for line in lines if "train/exceptions" in line] == [0.0, 0.0]
    trajectory = await script.rollout(model, script.Scenario2048(step=2))
    choice = trajectory.choices()[0]
    assert choice.model_extra["token_ids"] and all(isinstance(i, int) for i in choice.model_extra["prompt_token_ids"])


async def test_art_e_email_agent(example):
    script = example("art_e", "train")
    await script.train()
    model_dir = Path(".art/art-e/models/art-e-email-search-001")
    lines = history(model_dir)
    val = [line for line in lines if line["split"] == "val"]
    assert [line["step"] for line in val] == [0, 1] and all(line["val/trajectories"] == 3 for line in val)
    assert all(line.get("val/exceptions", 0) == 0 and line.get("train/exceptions", 0) == 0 for line in lines)
    # delete_checkpoints() before each train keeps the served step and the best by val/reward; then
    # step 2, whose checkpoint is finished in the background after train returns.
    model = art.TrainableModel(name="art-e-email-search-001", project="art-e", base_model=TINY)
    assert await art.LocalBackend().wait_for_checkpoint(model) == 2
    steps = checkpoint_steps(model_dir / "checkpoints")
    assert steps[-1] == 2 and len(steps) <= 2
    trajectories = read_jsonl(model_dir / "trajectories" / "train" / "0001.jsonl")
    assert len(trajectories) == 6 and {t["metadata"]["scenario_id"] for t in trajectories} == {
        "quarterly-budget-owner", "customer-escalation-time", "contract-renewal-discount"}


async def test_2048_training_script_backs_up_to_s3_and_resumes_from_it(example, s3_bucket, tmp_path, monkeypatch):
    import s3fs

    script = example("twenty48_s3", "train")
    await script.main()  # a first machine: nothing to pull yet; pushes before each step
    assert await script.model.get_step() == 2
    bucket = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
    remote = f"{s3_bucket}/2048/models/tutorial-001"
    assert {p.rsplit("/", 1)[-1] for p in bucket.ls(f"{remote}/checkpoints")} == {"0000", "0001"}
    first = Path(".art").resolve()
    await art.LocalBackend(path=first).close()

    second = tmp_path / "second-machine"
    second.mkdir()
    monkeypatch.chdir(second)  # a new machine: the run comes back from S3 and training resumes at step 1
    await script.main()
    model_dir = Path(".art/2048/models/tutorial-001")
    assert await art.LocalBackend().wait_for_checkpoint(script.model) == 2  # step 2's, finished in the background
    lines = history(model_dir)
    assert {line["step"] for line in lines if line["split"] == "train"} == {0, 1}  # step 0's records came back
    assert all(line.get("train/exceptions", 0) == 0 for line in lines)
    # Resumed, not retrained: checkpoint 1 is the first machine's, byte for byte, and step 2 was trained here.
    adapter = "checkpoints/0001/adapter_model.safetensors"
    assert (model_dir / adapter).read_bytes() == (first / "2048/models/tutorial-001" / adapter).read_bytes()
    assert checkpoint_steps(model_dir / "checkpoints") == [1, 2]
    await art.LocalBackend(path=second / ".art").close()


async def test_yes_no_maybe(example, monkeypatch):
    for name, value in {"BASE_MODEL": TINY, "MODEL_NAME": "012", "NUM_STEPS": "2"}.items():
        monkeypatch.setenv(name, value)
    script = example("yes_no_maybe", "yes_no_maybe")
    with pytest.warns(UserWarning, match="tinker_args"):
        await script.main()
    assert await script.model.get_step() == 2
    model_dir = Path(".art/yes-no-maybe/models/012")
    rollouts = [line for line in history(model_dir) if "train/exceptions" in line]  # the rollouts' summary lines
    assert [(line["step"], line["train/trajectories"]) for line in rollouts] == [(0, 96.0), (1, 96.0)]


async def test_rock_paper_tool_use_notebook(example):
    script = example("rock_paper_tool_use", "rock_paper_tool_use")
    model = await script.main()
    assert await model.get_step() == 2
    model_dir = Path(".art/rock-paper-tool-use/models/001")
    lines = history(model_dir)
    # Every rollout ran to its end (max_exceptions=4 would have hidden a failure) and trained.
    assert [line["train/exceptions"] for line in lines if "train/exceptions" in line] == [0.0, 0.0]
    records = read_jsonl(model_dir / "trajectories" / "train" / "0000.jsonl")
    assert len(records) == 4 and all(r["tools"][0]["function"]["name"] == "play_move" for r in records)
    # The notebook's pattern: a round without a tool call is answered as tool_call_id "n/a" (SmolLM2-135M
    # rarely calls the tool), and the next round is played with that history.
    results = [m for r in records for m in r["messages"] if m["role"] == "tool"]
    assert results and all(m["tool_call_id"] == "n/a" or m["tool_call_id"].startswith("call") for m in results)
    assert any(m["tool_call_id"] == "n/a" for m in results)
