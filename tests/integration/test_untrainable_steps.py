"""On the real tiny model: rollouts that keep the assistant turn as a dict instead of the
returned Choice. All of them: the step is refused, nothing recorded or saved. Some: the rest train and
the history says how many could not."""

import json
import logging

import pytest

import art_nb as art
from art_nb.records import UNTRAINABLE_FIX

pytestmark = pytest.mark.slow

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPT = [{"role": "user", "content": "Say a colour."}]


@pytest.fixture(scope="module")
async def registered(tmp_path_factory):
    path = tmp_path_factory.mktemp("art")
    backend = art.LocalBackend(path=path)
    model = art.TrainableModel(name="u", project="it", base_model=TINY,
                               config=art.ModelConfig(max_seq_len=256, lora=art.LoraConfig(rank=4, alpha=8)))
    await model.register(backend)
    yield backend, model, path / "it" / "models" / "u"
    await backend.close()


async def rollout(model: art.TrainableModel, seed: int, reward: float, as_dict: bool) -> art.Trajectory:
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=PROMPT, max_tokens=4, temperature=1.0, seed=seed)
    choice = completion.choices[0]
    turn = {"role": "assistant", "content": choice.message.content or ""} if as_dict else choice
    return art.Trajectory(messages_and_choices=[*PROMPT, turn], reward=reward)


def history(model_dir) -> list[dict]:
    return [json.loads(line) for line in (model_dir / "history.jsonl").read_text().splitlines()]


async def test_a_step_of_dict_turns_is_refused_before_anything_is_written(registered):
    _, model, model_dir = registered
    step = await model.get_step()
    lines = len(history(model_dir)) if (model_dir / "history.jsonl").exists() else 0
    groups = [art.TrajectoryGroup([await rollout(model, i, float(i), as_dict=True) for i in range(2)])]
    with pytest.raises(ValueError, match="0 trainable tokens.*Keep the Choice the endpoint returned"):
        await model.train(groups)
    assert await model.get_step() == step
    assert not (model_dir / "checkpoints" / f"{step + 1:04d}").exists()
    assert (len(history(model_dir)) if (model_dir / "history.jsonl").exists() else 0) == lines


async def test_a_step_with_some_dict_turns_trains_the_rest_and_records_the_count(registered, caplog):
    _, model, model_dir = registered
    step = await model.get_step()
    group = [await rollout(model, 1, 1.0, as_dict=False), await rollout(model, 2, 0.0, as_dict=False),
             await rollout(model, 3, 0.5, as_dict=True)]
    with caplog.at_level(logging.WARNING, logger="art_nb"):
        result = await model.train([art.TrajectoryGroup(group)], config=art.TrainConfig(learning_rate=1e-3))
    assert result.step == step + 1
    assert result.metrics["untrainable_trajectories"] == 1.0
    assert result.metrics["groups"] == 1.0 and "skipped_empty" not in result.metrics  # the two Choices trained
    assert any("1 of 3 trajectories have 0 trainable tokens" in r.getMessage() and UNTRAINABLE_FIX in r.getMessage()
               for r in caplog.records)
    update = [line for line in history(model_dir) if "train/time/train" in line][-1]
    assert update["step"] == step and update["train/untrainable_trajectories"] == 1.0
