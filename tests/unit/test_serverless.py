"""ServerlessBackend against a local server speaking the W&B Training API (tests/fakes/wandb_server.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import pickle

import pytest
from conftest import make_choice
from fakes.wandb_server import FakeArtifacts, FakeWandbServer

import art_nb as art
from art_nb import events
from art_nb.records import UnknownMetricError
from art_nb.secrets import MissingSecretError
from art_nb.serverless import ServerlessBackend, ServerlessError, TrainingJobFailed
from art_nb.wire import RetryPolicy

KEY = "wandb-test-key-8c1f2e9a7b5d"  # must never show up in any output
FAST = RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05)
PROMPT = [{"role": "user", "content": "Say a colour."}]


@pytest.fixture
async def fake(tmp_path):
    server = await FakeWandbServer(KEY, FakeArtifacts(tmp_path / "artifacts")).start()
    yield server
    await server.stop()


def backend_for(fake, tmp_path, key=KEY, **kwargs) -> ServerlessBackend:
    options = {"retry": FAST, "poll_interval": 0.01, **kwargs}
    return ServerlessBackend(key, base_url=fake.base_url, path=tmp_path / "local", artifacts=fake.artifacts, **options)


def make_model(name: str = "agent") -> art.TrainableModel:
    return art.TrainableModel(name=name, project="proj", base_model="OpenPipe/Qwen3-14B-Instruct")


def make_groups(tokenizer, n_groups: int = 2, per_group: int = 2) -> list[art.TrajectoryGroup]:
    return [art.TrajectoryGroup(
        art.Trajectory(messages_and_choices=[*PROMPT, make_choice(tokenizer, f"red {g} {i}")], reward=float(i))
        for i in range(per_group)) for g in range(n_groups)]


@pytest.fixture
def recorded():
    seen: list[dict] = []
    unsubscribe = events.subscribe(seen.append)
    yield seen
    unsubscribe()


async def test_documented_routes_train_progress_and_inference(fake, tmp_path, chatml_tokenizer, recorded):
    backend, model = backend_for(fake, tmp_path), make_model()
    await model.register(backend)
    created = fake.calls("POST", "/v1/preview/models")[0]
    assert created["headers"]["authorization"] == f"Bearer {KEY}"
    assert created["body"] == {"entity": None, "project": "proj", "name": "agent",
                               "base_model": "OpenPipe/Qwen3-14B-Instruct", "return_existing": True}
    assert model.get_inference_name() == "wandb-artifact:///fake-entity/proj/agent"
    assert model.get_inference_name(3) == "wandb-artifact:///fake-entity/proj/agent:step3"
    assert await model.get_step() == 0

    progress: list[dict] = []
    result = await model.train(make_groups(chatml_tokenizer), config=art.TrainConfig(learning_rate=1e-5),
                               on_progress=progress.append)
    assert result.step == 1 and await model.get_step() == 1
    assert isinstance(result, art.ServerlessTrainResult) and result.artifact_name == "fake-entity/proj/agent:step1"
    assert result.metrics["loss"] == pytest.approx((0.1 + 0.2 + 0.3 + 0.4) / 4)
    assert [(p["done"], p["total"]) for p in progress] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    kinds = [e["type"] for e in recorded if e.get("model") == "agent"]
    assert kinds[0] == "log" and "train_started" in kinds and kinds[-1] == "train_finished"
    job = fake.calls("POST", "/v1/preview/training-jobs")[0]
    assert job["headers"]["idempotency-key"]
    assert job["body"]["experimental_config"]["learning_rate"] == 1e-5
    sent_choice = job["body"]["trajectory_groups"][0]["trajectories"][0]["messages_and_choices"][1]
    assert sent_choice["token_ids"] == make_choice(chatml_tokenizer, "red 0 0").model_extra["token_ids"]
    polls = fake.calls("GET", "/v1/preview/training-jobs/")
    assert len(polls) >= 6 and polls[-1]["query"].get("after")  # one event per poll, cursor advanced

    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(1), messages=PROMPT, max_tokens=4)
    assert completion.choices[0].model_extra["token_ids"] == [101, 102, 2]


async def test_429_waits_as_long_as_retry_after_says(fake, tmp_path):
    fake.fail("POST", "/v1/preview/models", 429, retry_after="1")
    await make_model().register(backend_for(fake, tmp_path))
    first, second = fake.calls("POST", "/v1/preview/models")
    assert second["time"] - first["time"] >= 0.95


async def test_500s_then_success_make_one_job_with_one_idempotency_key(fake, tmp_path, chatml_tokenizer):
    model = make_model()
    await model.register(backend_for(fake, tmp_path))
    # The first 500 comes *after* the job was created: only the key stops a second job.
    fake.fail("POST", "/v1/preview/training-jobs", 500, after_effect=True)
    fake.fail("POST", "/v1/preview/training-jobs", 502)
    result = await model.train(make_groups(chatml_tokenizer))
    attempts = fake.calls("POST", "/v1/preview/training-jobs")
    assert len(attempts) == 3 and result.step == 1
    assert len({a["headers"]["idempotency-key"] for a in attempts}) == 1
    assert len(fake.jobs) == 1


async def test_retries_are_bounded_and_the_error_names_the_status(fake, tmp_path):
    model = make_model()
    await model.register(backend_for(fake, tmp_path))
    fake.fail("GET", "/v1/preview/models/", 503, times=10, message="upstream unavailable")
    with pytest.raises(ServerlessError, match="HTTP 503.*upstream unavailable"):
        await model.get_step()
    assert len(fake.calls("GET", "/v1/preview/models/")) == FAST.attempts


async def test_a_failed_job_raises_the_service_message_and_leaves_no_pending_job(fake, tmp_path, chatml_tokenizer):
    backend, model = backend_for(fake, tmp_path), make_model()
    await model.register(backend)
    fake.fail_next_job("CUDA out of memory on the trainer")
    with pytest.raises(TrainingJobFailed, match="CUDA out of memory on the trainer"):
        await model.train(make_groups(chatml_tokenizer))
    assert "pending_job" not in json.loads(backend._state_path(model).read_text())
    assert await model.get_step() == 0
    assert (await model.train(make_groups(chatml_tokenizer))).step == 1  # the next job goes through


async def test_polling_resumes_on_the_existing_job_after_a_kernel_restart(fake, tmp_path, chatml_tokenizer):
    before = backend_for(fake, tmp_path, poll_interval=0.05)
    model = make_model()
    await model.register(before)
    task = asyncio.ensure_future(model.train(make_groups(chatml_tokenizer)))
    state_file = before._state_path(model)
    while not (state_file.exists() and "pending_job" in json.loads(state_file.read_text())):
        await asyncio.sleep(0.01)
    task.cancel()  # the kernel dies mid-poll; the job runs on
    with pytest.raises(asyncio.CancelledError):
        await task
    job_id = json.loads(state_file.read_text())["pending_job"]["id"]
    assert fake.jobs[job_id].revealed < len(fake.jobs[job_id].events)

    after, fresh = backend_for(fake, tmp_path), make_model()  # a new kernel: new objects, same disk
    await fresh.register(after)
    assert await fresh.get_step() == 1  # waited for the old job instead of starting over
    assert len(fake.calls("POST", "/v1/preview/training-jobs")) == 1
    assert "pending_job" not in json.loads(state_file.read_text())
    assert (await fresh.train(make_groups(chatml_tokenizer))).step == 2


async def test_delete_checkpoints_keeps_the_latest(fake, tmp_path, chatml_tokenizer):
    model = make_model()
    await model.register(backend_for(fake, tmp_path))
    for _ in range(3):
        await model.train(make_groups(chatml_tokenizer, 1, 2))
    assert await model.backend.list_checkpoints(model) == [1, 2, 3]
    assert await model.delete_checkpoints(keep_last=1) == [1, 2]
    assert fake.calls("DELETE", "/v1/preview/models/")[0]["body"] == {"steps": [1, 2]}
    assert await model.backend.list_checkpoints(model) == [3]
    assert await model.delete_checkpoints(steps=[3]) == []  # the served step stays


async def test_delete_by_a_metric_no_step_has_is_refused_and_deletes_nothing(fake, tmp_path, chatml_tokenizer):
    """The same rule as LocalBackend's (both decide through records.best_step): a typo deletes nothing."""
    model = make_model()
    await model.register(backend_for(fake, tmp_path))
    for _ in range(3):
        await model.train(make_groups(chatml_tokenizer, 1, 2))
    await model.log(make_groups(chatml_tokenizer), split="val")
    with pytest.raises(UnknownMetricError, match="did you mean 'val/reward'"):
        await model.delete_checkpoints("val/rewrad")
    assert not fake.calls("DELETE", "/v1/preview/models/")
    assert await model.backend.list_checkpoints(model) == [1, 2, 3]


async def test_log_stays_local_and_goes_to_the_service(fake, tmp_path, chatml_tokenizer):
    backend, model = backend_for(fake, tmp_path), make_model()
    await model.register(backend)
    summary = await model.log(make_groups(chatml_tokenizer), split="val")
    assert summary["reward"] == 0.5
    assert fake.logged[0]["split"] == "val" and len(fake.logged[0]["trajectory_groups"]) == 2
    history = (tmp_path / "local/proj/models/agent/history.jsonl").read_text()
    assert '"val/reward": 0.5' in history
    quiet, model2 = backend_for(fake, tmp_path, log_remote=False), make_model("other")
    await model2.register(quiet)
    await model2.log(make_groups(chatml_tokenizer))
    assert len(fake.logged) == 1


def _local_checkpoints(root, steps):
    base = root / "proj/models/agent/checkpoints"
    for step in steps:
        directory = base / f"{step:04d}"
        directory.mkdir(parents=True)
        (directory / "adapter_model.safetensors").write_bytes(f"weights of step {step}".encode())
        (directory / "adapter_config.json").write_text('{"r": 8}')
        (directory / "trainer_state.pt").write_bytes(b"optimizer state that stays here")
        (directory / "meta.json").write_text("{}")


async def test_handoff_continues_from_the_local_lora_and_pull_brings_it_back(fake, tmp_path, chatml_tokenizer):
    local_root = tmp_path / "trained-locally"
    _local_checkpoints(local_root, [0, 1, 2, 3])
    backend, model = backend_for(fake, tmp_path), make_model()
    assert await backend.handoff(model, local_path=local_root) == 3
    ref, run_id, files = fake.artifacts.uploads[0]
    assert ref.path == "fake-entity/proj/agent:step3" and run_id == "run-model-1"
    assert files == ["adapter_config.json", "adapter_model.safetensors"]  # no optimizer state, no logs
    assert model.backend is backend and await model.get_step() == 3

    assert (await model.train(make_groups(chatml_tokenizer))).step == 4
    trained = fake.artifacts.dir(backend.artifact(model, 4))
    assert json.loads((trained / "trained_from.json").read_text())["parent"] == 3
    pulled = await backend.pull_checkpoint(model)
    assert pulled == tmp_path / "local/proj/models/agent/checkpoints/0004"
    assert (pulled / "adapter_model.safetensors").read_bytes() == b"weights of step 3"  # the fake copies its parent
    assert json.loads((pulled / "meta.json").read_text())["pulled_from"].endswith("agent:step4")

    with pytest.raises(ServerlessError, match="already has checkpoint 4"):
        await backend.handoff(model, local_path=local_root)


async def test_handoff_without_a_local_checkpoint_says_where_it_looked(fake, tmp_path):
    with pytest.raises(FileNotFoundError, match="no local checkpoint"):
        await backend_for(fake, tmp_path).handoff(make_model(), local_path=tmp_path / "empty")


class _TrainedElsewhere:
    """The backend a model was trained on, as `handoff` sees it: a run directory and a checkpoint to wait for."""

    def __init__(self, root, model_name="agent"):
        self.root, self.waited = root, []
        self.directory = root / "proj/models" / model_name

    async def wait_for_checkpoint(self, model):
        _local_checkpoints(self.root, [5])  # the background write lands only now
        self.waited.append(model.name)
        return 5

    def model_dir(self, model):
        return self.directory


async def test_handoff_from_the_source_backend_waits_for_its_checkpoint(fake, tmp_path):
    source, backend, model = _TrainedElsewhere(tmp_path / "elsewhere"), backend_for(fake, tmp_path), make_model()
    assert await backend.handoff(model, source=source) == 5  # the step written while handoff waited
    assert source.waited == ["agent"]
    ref, _, files = fake.artifacts.uploads[0]
    assert ref.step == 5 and files == ["adapter_config.json", "adapter_model.safetensors"]
    assert model.backend is backend and await model.get_step() == 5


async def test_the_whole_backend_protocol(fake, tmp_path, chatml_tokenizer):
    from art_nb.backend import Backend

    backend, model = backend_for(fake, tmp_path), make_model()
    assert isinstance(backend, Backend)
    assert backend.model_dir(model) == (tmp_path / "local/proj/models/agent").resolve()  # before register too
    await model.register(backend)
    assert backend.choices(model) == {}  # the service decides; nothing was picked on this machine
    assert await backend.wait_for_checkpoint(model) == 0
    await model.train(make_groups(chatml_tokenizer))
    assert await backend.wait_for_checkpoint(model) == 1


async def test_rollouts_are_on_disk_before_the_job_is_submitted(fake, tmp_path, chatml_tokenizer, recorded):
    backend, model = backend_for(fake, tmp_path), make_model()
    await model.register(backend)
    fake.fail("POST", "/v1/preview/training-jobs", 400, message="bad groups")
    with pytest.raises(ServerlessError, match="bad groups"):
        await model.train(make_groups(chatml_tokenizer, n_groups=2, per_group=2))
    run = backend.model_dir(model)
    lines = [json.loads(line) for line in (run / "trajectories/train/0000.jsonl").read_text().splitlines()]
    assert [(r["group"], r["reward"]) for r in lines] == [(0, 0.0), (0, 1.0), (1, 0.0), (1, 1.0)]
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert history[0]["split"] == "train" and history[0]["train/reward"] == 0.5
    assert [e["metrics"]["trajectories"] for e in recorded if e["type"] == "log"] == [4.0]


def test_missing_key_says_where_to_put_it(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(MissingSecretError, match="WANDB_API_KEY.*|Colab"):
        ServerlessBackend()


async def test_the_key_never_appears_in_output_logs_events_or_errors(fake, tmp_path, chatml_tokenizer, caplog,
                                                                      capsys, recorded):
    caplog.set_level(logging.DEBUG)
    backend, model = backend_for(fake, tmp_path), make_model()
    texts = [repr(backend), str(backend), f"{backend._key}", repr(backend._key)]
    fake.fail("POST", "/v1/preview/models", 429, retry_after="0")  # a logged retry
    await model.register(backend)
    texts.append(repr(model.backend.inference_endpoint(model)))
    # A server that quotes the key back: the client scrubs it.
    fake.fail("POST", "/v1/preview/training-jobs", 400, message=f"malformed request signed with {KEY}")
    with pytest.raises(ServerlessError) as bad_request:
        await model.train(make_groups(chatml_tokenizer))
    fake.fail_next_job(f"trainer crashed, env WANDB_API_KEY={KEY}")
    with pytest.raises(TrainingJobFailed) as failed_job:
        await model.train(make_groups(chatml_tokenizer))
    await model.train(make_groups(chatml_tokenizer), on_progress=lambda p: texts.append(repr(p)))
    wrong = backend_for(fake, tmp_path, key="not-the-key")
    with pytest.raises(ServerlessError, match="rejected the key from argument") as rejected:
        await make_model("x").register(wrong)
    with pytest.raises(TypeError):
        pickle.dumps(backend._key)
    texts += [str(bad_request.value), str(failed_job.value), str(rejected.value), repr(bad_request.value)]
    texts += [caplog.text, json.dumps(recorded, default=str), *capsys.readouterr()]
    assert "********" in str(bad_request.value) and "********" in str(failed_job.value)
    for text in texts:
        assert KEY not in text


async def test_a_key_echoed_at_the_cut_is_redacted_before_the_message_is_cut(fake, tmp_path, chatml_tokenizer):
    """The client keeps 1,000 characters of a server's error; cutting first left most of a key quoted there."""
    backend, model = backend_for(fake, tmp_path), make_model()
    await model.register(backend)
    padding = "x" * (1000 - 10 - len("HTTP 400"))  # the key starts 10 characters before the cut
    fake.fail("POST", "/v1/preview/training-jobs", 400, message=f"{padding} {KEY} and more")
    with pytest.raises(ServerlessError) as error:
        await model.train(make_groups(chatml_tokenizer))
    text = str(error.value)
    assert not any(KEY[i:i + 8] in text for i in range(len(KEY) - 7)), text[-80:]


async def test_art_style_train_arguments_reach_the_job(fake, tmp_path, chatml_tokenizer):
    """ART's `backend.train(model, groups, learning_rate=...)` works on the hosted backend too."""
    backend, model = backend_for(fake, tmp_path), make_model()
    await model.register(backend)
    result = await backend.train(model, make_groups(chatml_tokenizer), learning_rate=3e-6)
    assert result.step == 1
    assert fake.calls("POST", "/v1/preview/training-jobs")[0]["body"]["experimental_config"]["learning_rate"] == 3e-6


def test_losses_the_service_has_no_name_for_are_refused_before_sending() -> None:
    from art_nb.serverless.api import experimental_config

    assert experimental_config(art.TrainConfig(loss="ppo"))["ppo"] is True
    for loss in ("dapo", "dr_grpo", "gspo"):
        with pytest.raises(ValueError, match="LocalBackend only"):
            experimental_config(art.TrainConfig(loss=loss))
