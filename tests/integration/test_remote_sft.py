"""`model.train_sft` through `RemoteBackend` and a real `art-nb serve` process (the tiny model on CPU):
what test_sft_real asserts of LocalBackend (the step advances, the demonstrated answer is served, a
checkpoint and "sft" history are written, the next GRPO step continues from it), seen from the client;
bad input refused at the door with a 400 naming the field, before anything is recorded; and, with a
backend that cannot do SFT or records what it gets, the error and argument paths of the same route."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import httpx
import pytest
from test_remote_backend import TINY, TOKEN, ServeProcess

import art_nb as art
from art_nb import events
from art_nb.local.server import start_server
from art_nb.remote.client import RemoteBackend, RemoteBackendError, RemoteTrainingError
from art_nb.remote.serve import create_serve_app
from art_nb.secrets import Secret
from art_nb.types import TrainResult

PROMPT = [{"role": "user", "content": "What is the secret word?"}]
ANSWER = "The secret word is pineapple."
ADAPTER = "adapter_model.safetensors"


def demos(n: int = 4) -> list[art.Trajectory]:
    return [art.Trajectory(messages_and_choices=[*PROMPT, {"role": "assistant", "content": ANSWER}])] * n


def make_model(name: str = "sft") -> art.TrainableModel:
    return art.TrainableModel(name=name, project="it", base_model=TINY,
                              config=art.ModelConfig(max_seq_len=256, lora=art.LoraConfig(rank=8, alpha=32)))


async def greedy(model: art.TrainableModel) -> str:
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=PROMPT, max_tokens=16, temperature=0)
    return completion.choices[0].message.content or ""


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("served_sft")
    process = ServeProcess(path)
    yield process, path
    assert process.stop() == 0


@pytest.mark.slow
async def test_train_sft_through_the_server_trains_serves_and_checkpoints(server, tmp_path):
    process, path = server
    backend = RemoteBackend(process.url, api_key=TOKEN, path=tmp_path)
    model = make_model()
    await model.register(backend)
    step = await model.get_step()
    served = path / "it/models/sft"
    before_weights = sha(served / f"checkpoints/{step:04d}" / ADAPTER)
    before_answer = await greedy(model)
    assert "pineapple" not in before_answer.lower()

    seen: list[dict] = []
    progress: list[dict] = []
    unsubscribe = events.subscribe(seen.append)
    try:
        result = await model.train_sft(demos(4), art.TrainSFTConfig(learning_rate=3e-3, batch_size=2),
                                       on_progress=progress.append)
    finally:
        unsubscribe()
    assert type(result) is TrainResult and result.step == step + 1 and await model.get_step() == step + 1
    assert result.metrics["sft_batches"] == 2 and result.metrics["tokens_trained"] > 0
    assert [p["done"] for p in progress] == [1, 2] and all(p["phase"] == "sft" for p in progress)
    streamed = [(e["type"], e.get("step"), e.get("sft")) for e in seen if e.get("remote") == process.url]
    assert ("train_started", step, True) in streamed and ("train_finished", step + 1, True) in streamed

    # the served model answers as demonstrated
    after_answer = await greedy(model)
    assert after_answer != before_answer and "pineapple" in after_answer.lower(), (before_answer, after_answer)

    # a checkpoint on the server, with new adapter weights, downloadable as any other step
    assert await backend.wait_for_checkpoint(model) == step + 1
    assert step + 1 in await backend.list_checkpoints(model)
    checkpoint = served / f"checkpoints/{step + 1:04d}"
    assert sha(checkpoint / ADAPTER) != before_weights
    local = await backend.download_checkpoint(model)
    assert sha(local / ADAPTER) == sha(checkpoint / ADAPTER)
    history = [json.loads(line) for line in (served / "history.jsonl").read_text().splitlines()]
    assert any(line["split"] == "sft" and "sft/loss" in line for line in history)
    assert (served / f"trajectories/sft/{step:04d}.jsonl").exists()

    # the next GRPO step continues from the SFT weights, through the same server
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=PROMPT, max_tokens=8, temperature=1.0, logprobs=True, seed=1)
    group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[*PROMPT, completion.choices[0]], reward=r)
                                 for r in (0.0, 1.0)])
    assert (await model.train([group], config=art.TrainConfig(learning_rate=1e-5))).step == step + 2


@pytest.mark.slow
async def test_bad_sft_input_is_a_400_naming_the_field_and_changes_nothing(server, tmp_path):
    process, path = server
    backend = RemoteBackend(process.url, api_key=TOKEN, path=tmp_path)
    model = make_model("sft_bad")
    await model.register(backend)
    one = [{"message": m} for m in [*PROMPT, {"role": "assistant", "content": ANSWER}]]
    good = {"messages_and_choices": one, "reward": 0.0}
    headers = {"Authorization": f"Bearer {TOKEN}", "X-Art-Nb-Version": art.__version__}
    async with httpx.AsyncClient(base_url=process.url, headers=headers, timeout=60) as raw:
        for body, word in [
            ({"trajectories": "x"}, "trajectories"),
            ({"trajectories": [{"messages_and_choices": [{"role": "user", "content": "hi"}]}]}, "trajectories"),
            ({"trajectories": [good], "config": {"batch_size": 0}}, "batch_size"),
            ({"trajectories": [good], "config": {"learning_rate": -1}}, "learning_rate"),
            ({"trajectories": [good], "config": {"learning_rate": [1e-3, 1e-3]}}, "learning_rate"),
            ({"trajectories": [good], "config": {"no_such_knob": 1}}, "no_such_knob"),
            ({"trajectories": [good], "verbose": "yes"}, "verbose"),
            ({"trajectories": [good], "dev_config": [1]}, "dev_config"),
        ]:
            response = await raw.post("/api/models/sft_bad/train_sft", json=body)
            assert response.status_code == 400, (body, response.text)
            message = response.json()["error"]["message"]
            assert word in message and str(path) not in response.text, (body, message)
        ghost = await raw.post("/api/models/ghost/train_sft", json={"trajectories": [good]})
        assert ghost.status_code == 404 and ghost.json()["error"]["code"] == "model_not_registered"
    with pytest.raises(RemoteBackendError, match="not registered on this server.*register"):
        await backend.train_sft(make_model("ghost"), demos(1))
    # the client checks what LocalBackend checks, before sending anything
    with pytest.raises(ValueError, match="learning_rate has 3 rates but the trajectories make 2 batches"):
        await model.train_sft(demos(4), art.TrainSFTConfig(learning_rate=[1e-3] * 3, batch_size=2))
    with pytest.raises(TypeError, match="trajectories\\[0\\] is a str"):
        await model.train_sft(["not a trajectory"])
    assert await model.get_step() == 0 and await backend.list_checkpoints(model) == [0]
    assert not (path / "it/models/sft_bad/trajectories/sft").exists()  # nothing recorded
    assert (await model.train_sft([])).step == 0  # nothing to learn from: no step, as on LocalBackend


class SFTOnlyBackend:
    """Just what the serve app's register and train_sft ask of a backend: records the arguments, or
    fails as a backend without a trainer would."""

    def __init__(self) -> None:
        self.step, self.received, self.fail_with = 0, [], None

    async def register(self, model) -> None:
        pass

    def choices(self, model) -> dict[str, str]:
        return {}

    def model_dir(self, model) -> Path:  # the serve app keeps server paths out of what a client sees
        return Path("/srv/art") / model.project / model.name

    async def get_step(self, model) -> int:
        return self.step

    async def train_sft(self, model, trajectories, config=None, _config=None, verbose=False, *, on_progress=None):
        if self.fail_with is not None:
            raise self.fail_with
        self.received.append((trajectories, config, _config, verbose))
        await asyncio.to_thread(on_progress, {"phase": "sft", "done": 1, "total": 1})
        events.emit("train_started", model=model.name, step=self.step, sft=True)
        self.step += 1
        return TrainResult(step=self.step, metrics={"sft_batches": 1.0})


async def test_sft_arguments_arrive_intact_and_a_backend_without_sft_fails_like_train():
    backend = SFTOnlyBackend()
    server = await start_server(create_serve_app(backend, token=Secret(TOKEN)), host="127.0.0.1", port=0)
    try:
        client = RemoteBackend(server.base_url, api_key=TOKEN)
        model = art.TrainableModel(name="m", project="p", base_model="tiny")
        await model.register(client)
        dev = {"metric_logging": {"enabled": True, "target_training_step": 3}}
        progress: list[dict] = []
        config = art.TrainSFTConfig(learning_rate=[1e-4, 2e-4], batch_size=1, assistant_turns="last")
        result = await model.train_sft(demos(2), config, dev, True, on_progress=progress.append)
        assert result == TrainResult(step=1, metrics={"sft_batches": 1.0})
        trajectories, arrived, arrived_dev, verbose = backend.received[0]
        assert trajectories == demos(2) and arrived == config and arrived_dev == dev and verbose is True
        assert progress == [{"phase": "sft", "done": 1, "total": 1}]

        backend.fail_with = NotImplementedError("this backend has no trainer for SFT")
        with pytest.raises(RemoteTrainingError, match="failed on .*no trainer for SFT") as info:
            await model.train_sft(demos(1))
        assert info.value.error_type == "NotImplementedError" and await model.get_step() == 1
        with pytest.raises(TypeError, match="config is a dict"):
            await model.train_sft(demos(1), {"learning_rate": 1e-4})
    finally:
        await server.stop()
