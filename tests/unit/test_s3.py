"""S3 push/pull of a model's directory against a local S3-compatible server (moto), as ART lays it out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

s3fs = pytest.importorskip("s3fs", reason="the s3 extra (pip install art-nb[s3]) is not installed")
moto_server = pytest.importorskip("moto.server", reason="moto[server] (in the dev extra) is not installed")

import art_nb as art
from art_nb.local import s3
from art_nb.store import ModelStore


@pytest.fixture(scope="module")
def endpoint():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws(endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("BACKUP_BUCKET", "art-backups")
    return endpoint


def make_run(root: Path, project: str = "2048", name: str = "agent-001") -> Path:
    """A model directory as a LocalBackend leaves it: two checkpoints, records, a lock and a temporary."""
    store = ModelStore(root, project, name)
    for step in (0, 1):
        store.write_checkpoint(step, lambda d, step=step: (d / "adapter_model.safetensors").write_bytes(bytes([step]) * 64))
    store.append_history({"step": 0, "split": "train", "train/reward": 0.5})
    store.append_trajectories("train", 0, [{"group": 0, "reward": 0.5}])
    (store.dir / ".writer.lock").write_text("123")
    (store.checkpoints / ".tmp-0002-1-2").mkdir()
    (store.checkpoints / ".tmp-0002-1-2" / "adapter_model.safetensors").write_bytes(b"half")
    return store.dir


def listing(url: str) -> list[str]:
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
    return sorted(key[len(url) + 1:] for key in fs.find(url))


def test_push_sends_the_run_but_no_hidden_file_and_resends_nothing(aws, tmp_path):
    local = make_run(tmp_path / "a")
    url = s3.model_url("2048", "agent-001", None, "runs/")
    assert url == "art-backups/runs/2048/models/agent-001"
    sent = s3.push(local, url)
    expected = ["checkpoints/0000/adapter_model.safetensors", "checkpoints/0000/meta.json",
                "checkpoints/0001/adapter_model.safetensors", "checkpoints/0001/meta.json", "history.jsonl",
                "trajectories/train/0000.jsonl"]
    assert listing(url) == expected == sent
    assert s3.push(local, url) == []  # a sync: same sizes, nothing sent again


def test_pull_restores_the_run_and_register_would_resume_from_it(aws, tmp_path):
    url = s3.model_url("2048", "agent-001", "art-backups", None)
    s3.push(make_run(tmp_path / "a"), url)
    target = tmp_path / "b" / "2048" / "models" / "agent-001"
    s3.pull(url, target)
    store = ModelStore(tmp_path / "b", "2048", "agent-001")
    assert store.steps() == [0, 1]
    assert (store.checkpoint_dir(1) / "adapter_model.safetensors").read_bytes() == bytes([1]) * 64
    assert store.read_history()[0]["train/reward"] == 0.5
    assert s3.pull(url, target) == []


def test_pull_only_latest_and_exclude(aws, tmp_path):
    url = s3.model_url("2048", "agent-001", "art-backups", "only")
    s3.push(make_run(tmp_path / "a"), url)
    target = tmp_path / "b"
    s3.pull(url, target, only_step="latest", exclude=["trajectories"])
    assert sorted(p.name for p in (target / "checkpoints").iterdir()) == ["0001"]
    assert (target / "history.jsonl").exists() and not (target / "trajectories").exists()
    with pytest.raises(FileNotFoundError, match="no checkpoint 7"):
        s3.pull(url, tmp_path / "c", only_step=7)
    with pytest.raises(ValueError, match="exclude"):
        s3.pull(url, tmp_path / "c", exclude=["weights"])


def test_a_checkpoint_pulled_halfway_never_appears(aws, tmp_path, monkeypatch):
    url = s3.model_url("2048", "agent-001", "art-backups", "crash")
    s3.push(make_run(tmp_path / "a"), url)
    calls = []
    real_get = s3fs.S3FileSystem.get_file

    def flaky_get(self, remote, local, *args, **kwargs):
        calls.append(remote)
        if len(calls) == 2:  # the second file of the first checkpoint
            raise ConnectionError("network dropped")
        return real_get(self, remote, local, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "get_file", flaky_get)
    target = tmp_path / "b" / "2048" / "models" / "agent-001"
    with pytest.raises(ConnectionError):
        s3.pull(url, target)
    store = ModelStore(tmp_path / "b", "2048", "agent-001")
    assert store.steps() == []  # only a hidden temporary, which the next writer removes
    store.acquire_writer()
    assert [p.name for p in store.checkpoints.iterdir()] == []
    store.release_writer()


async def test_backend_methods_push_and_pull_before_register(aws, tmp_path):
    make_run(tmp_path / "a")
    source, target = art.LocalBackend(path=tmp_path / "a"), art.LocalBackend(path=tmp_path / "b")
    model = art.TrainableModel(name="agent-001", project="2048", base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    await source._experimental_push_to_s3(model)
    await target._experimental_pull_from_s3(model, verbose=True)
    assert ModelStore(tmp_path / "b", "2048", "agent-001").steps() == [0, 1]
    assert target.model_dir(model) == tmp_path.resolve() / "b" / "2048" / "models" / "agent-001"


def test_no_bucket_and_no_s3fs_are_clear_errors(monkeypatch, tmp_path):
    monkeypatch.delenv("BACKUP_BUCKET", raising=False)
    with pytest.raises(ValueError, match="BACKUP_BUCKET"):
        s3.model_url("p", "m", None, None)
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if not installed
    with pytest.raises(ImportError, match=r"art-nb\[s3\]"):
        s3.push(make_run(tmp_path), "bucket/p/models/m")
