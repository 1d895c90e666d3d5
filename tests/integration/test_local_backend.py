"""The whole loop on the real tiny model on CPU: endpoint, train, checkpoint, swap, resume."""

import asyncio
import gc
import json
import subprocess
import sys
import textwrap
import threading

import pytest
from safetensors.torch import load_file

import art_nb as art

pytestmark = pytest.mark.slow

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPT = [{"role": "user", "content": "Say a colour."}]


def make_model(name: str) -> art.TrainableModel:
    return art.TrainableModel(
        name=name, project="it", base_model=TINY,
        config=art.ModelConfig(max_seq_len=512, lora=art.LoraConfig(rank=8, alpha=32)),
    )


async def rollout(model: art.TrainableModel, i: int) -> art.Trajectory:
    client = model.openai_client()
    completion = await client.chat.completions.create(
        model=model.get_inference_name(), messages=PROMPT, max_tokens=8, temperature=1.0, logprobs=True, seed=i,
    )
    choice = completion.choices[0]
    text = choice.message.content or ""
    # Any reward that varies within the group will do: prefer short answers containing 'e'.
    return art.Trajectory(messages_and_choices=[*PROMPT, choice], reward=float("e" in text.lower()) - 0.05 * len(text))


async def greedy(model: art.TrainableModel, name: str) -> list[int]:
    completion = await model.openai_client().chat.completions.create(
        model=name, messages=PROMPT, max_tokens=8, temperature=0)
    return completion.choices[0].model_extra["token_ids"]


@pytest.fixture(scope="module")
async def trained(tmp_path_factory):
    path = tmp_path_factory.mktemp("art")
    backend = art.LocalBackend(path=path)
    model = make_model("m1")
    await model.register(backend)
    yield backend, model, path
    await backend.close()


async def test_endpoint_serves_token_ids_and_logprobs(trained):
    backend, model, _ = trained
    client = model.openai_client()
    listed = [m.id async for m in client.models.list()]
    assert "m1" in listed and "m1@0" in listed
    completion = await client.chat.completions.create(model="m1", messages=PROMPT, max_tokens=6, n=2, logprobs=True)
    for choice in completion.choices:
        ids = choice.model_extra["token_ids"]
        assert 0 < len(ids) <= 6
        assert len(choice.logprobs.content) == len(ids)
        assert all(entry.logprob <= 0 for entry in choice.logprobs.content)


async def test_two_steps_change_adapter_and_served_model_and_requests_during_training_succeed(trained):
    backend, model, path = trained
    assert await model.get_step() == 0
    base_greedy = await greedy(model, "m1@0")
    first_adapter = load_file(backend.checkpoint_dir(model, 0) / "adapter_model.safetensors")
    config = art.TrainConfig(learning_rate=5e-3)
    for expected_step in (1, 2):
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, 10 * g + i) for i in range(4)) for g in range(2)], pbar_desc=None)
        # Requests sent while the step trains wait and then complete: none fails.
        during = [asyncio.ensure_future(rollout(model, 100 + i)) for i in range(6)]
        result = await model.train(groups, config=config)
        finished = await asyncio.gather(*during)
        assert result.step == expected_step and len(finished) == 6
        assert result.metrics["tokens_trained"] > 0
    assert await model.get_step() == 2
    latest = load_file(backend.checkpoint_dir(model) / "adapter_model.safetensors")
    changed = [k for k in latest if not (latest[k] == first_adapter[k]).all()]
    assert changed, "training did not change the adapter"
    assert await greedy(model, "m1@0") == base_greedy  # step 0 still served as the base
    assert await greedy(model, "m1") != base_greedy or await greedy(model, "m1@2") != base_greedy
    history = [json.loads(line) for line in (path / "it/models/m1/history.jsonl").read_text().splitlines()]
    assert {r["step"] for r in history if "train/reward" in r} == {0, 1}
    assert (path / "it/models/m1/trajectories/train/0001.jsonl").exists()


async def test_register_is_idempotent(trained):
    backend, model, _ = trained
    engine = backend._state(model).engine
    again = make_model("m1")
    await again.register(art.LocalBackend(path=backend.path))  # a re-run cell: a new backend object
    assert backend._state(model).engine is engine
    assert await again.get_step() == await model.get_step()


async def test_unknown_model_is_404(trained):
    import openai

    _, model, _ = trained
    with pytest.raises(openai.NotFoundError):
        await model.openai_client().chat.completions.create(model="nope", messages=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        await model.openai_client().chat.completions.create(model="m1@99", messages=PROMPT, max_tokens=2)


async def test_art_loop_unchanged(trained):
    """ART's current loop on the real model: register fills the inference fields, a baseline plays the
    base model by its hub name and is logged, backend.train takes ART's arguments (a real KL penalty to
    the base model among them), model.log after it records nothing twice, and names carry the step."""
    from openai import AsyncOpenAI

    backend, _, path = trained
    model = make_model("m2")
    await model.register(backend)
    assert (model.inference_base_url, model.inference_model_name) == (backend.inference_endpoint(model).base_url, "m2@0")
    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
    assert TINY in [m.id async for m in client.models.list()]

    baseline = art.Model(name="base", project="it", inference_model_name=TINY,
                         inference_base_url=model.inference_base_url, inference_api_key=model.inference_api_key)
    await baseline.register(backend)
    played = await client.chat.completions.create(model=baseline.get_inference_name(), messages=PROMPT, max_tokens=4)
    assert played.model == TINY
    await baseline.log([art.Trajectory(messages_and_choices=[*PROMPT, played.choices[0]], reward=1.0)])
    assert json.loads((path / "it/models/base/history.jsonl").read_text().splitlines()[-1])["val/reward"] == 1.0

    history = path / "it/models/m2/history.jsonl"
    for expected in (1, 2):
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, 10 * g + i) for i in range(4)) for g in range(2)], pbar_desc=None)
        result = await backend.train(model, groups, learning_rate=5e-3, loss_fn="ppo", kl_penalty_coef=0.05)
        lines = len(history.read_text().splitlines())
        await model.log(groups, metrics=result.metrics, step=result.step, split="train")
        assert len(history.read_text().splitlines()) == lines  # recorded by train already: not again
        assert result.step == expected and model.get_inference_name() == f"m2@{expected}"
        assert result.checkpoint_path.endswith(f"checkpoints/{expected:04d}")
    # Step 2 trained away from the base model (step 1 moved the LoRA off the identity): a KL to it.
    assert result.metrics["reference_kl"] > 0
    assert await model.delete_checkpoints() == [0, 1]  # no val/reward yet: only the served step stays


RESUME = textwrap.dedent('''
    import asyncio, sys, torch
    import art_nb as art
    async def main():
        model = art.TrainableModel(name="m1", project="it", base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
            config=art.ModelConfig(max_seq_len=512, lora=art.LoraConfig(rank=8, alpha=32)))
        backend = art.LocalBackend(path=sys.argv[1])
        await model.register(backend)
        trainer = backend._state(model).trainer
        state = trainer._pending_optimizer_state
        print("STEP", await model.get_step(), "OPTSTATE", 0 if state is None else len(state["state"]))
        print("CHOICE", backend.choices(model).get("resume", ""))
    asyncio.run(main())
''')


async def test_new_process_resumes_from_latest_step_with_optimizer_state(trained):
    backend, model, path = trained
    assert await model.get_step() == 2
    # As after a kernel restart: this process lets go of the run first (one writer per model directory).
    await backend.close()
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", RESUME, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("STEP"))
    step, optimizer_tensors = int(line.split()[1]), int(line.split()[3])
    assert step == 2 and optimizer_tensors > 0
    assert "resumed at step 2" in out.stdout


async def test_close_ends_the_backend_thread_and_the_backend_registers_again(tmp_path):
    """A notebook that closes a backend gets its thread and memory back and can register on it again."""
    def backend_threads() -> int:
        return sum(t.name == "art_nb-backend" and t.is_alive() for t in threading.enumerate())

    before = backend_threads()
    backend = art.LocalBackend(path=tmp_path)
    model = make_model("again")
    gc.unfreeze()  # another test's backend left open
    await model.register(backend)
    assert backend_threads() == before + 1
    # what register built is out of the collector's passes while it serves, and back in them once closed
    assert gc.get_freeze_count() > 10_000
    await backend.close()
    assert backend_threads() == before and gc.get_freeze_count() == 0
    await backend.close()  # closing twice is harmless
    await model.register(backend)
    assert await model.get_step() == 0 and await greedy(model, model.get_inference_name())
    await backend.close()
    assert backend_threads() == before
