"""A second round of attacks and careless use against the store and the client, through a real
`art-nb serve` process on loopback (the tiny model): links planted under --path, a typo in
`best_metric`, a damaged history line, the token a loopback server has by default, and a token
on the command line.

Each test failed before its fix: the server truncated a file outside --path through a linked
`.writer.lock` and served one through a linked checkpoint entry; a typo deleted checkpoints and a
latin-1 byte in history.jsonl made the delete route answer 500; a loopback server had no token
(any account of the machine could train, download and delete); `--token VALUE` started a server
whose token every local user could read in /proc/<pid>/cmdline.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import art_nb as art
from art_nb.records import UnknownMetricError
from art_nb.remote.client import RemoteBackend, RemoteBackendError
from faults.conftest import gather_groups, tiny_trainable

pytestmark = pytest.mark.slow

SECRET_TEXT = "outside --path: must never be served or written"


class Served:
    """`art-nb serve` in a subprocess, exactly as a user starts it (no token options)."""

    def __init__(self, path: Path, config: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("ART_NB_SERVE_TOKEN", "ART_NB_API_KEY")}
        env.update(XDG_CONFIG_HOME=str(config), ART_NB_CPU_THREADS="1", HF_HUB_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "art_nb.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--path", str(path),
             "--allow-local-models"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.output: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()
        self.url = self._wait_for(r"listening on (http://[\d.]+:\d+)")
        generated = re.search(r"generated one \(shown once\): (\S+)", "".join(self.output))
        self.token = generated.group(1) if generated else None

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self._lines.put(line)

    def _wait_for(self, pattern: str) -> str:
        while True:
            try:
                line = self._lines.get(timeout=120)
            except queue.Empty:
                raise AssertionError("art-nb serve did not start:\n" + "".join(self.output)) from None
            if match := re.search(pattern, line):
                return match.group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # our own child, by its id
        self.proc.wait(60)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Path, Path]]:
    path, config = tmp_path_factory.mktemp("served"), tmp_path_factory.mktemp("config")
    server = Served(path, config)
    yield server, path, config
    server.stop()


@pytest.fixture
def client_config(served, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test process sees the same ~/.config as the server: a RemoteBackend on this machine."""
    _, _, config = served
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    monkeypatch.delenv("ART_NB_API_KEY", raising=False)
    return config


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text(SECRET_TEXT)
    return secret


def raw(server: Served, token: str | None) -> httpx.AsyncClient:
    headers = {"X-Art-Nb-Version": art.__version__, **({"Authorization": f"Bearer {token}"} if token else {})}
    return httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120)


# --- the token a loopback server has by default -------------------------------------------------


async def test_a_loopback_server_generates_a_token_prints_it_once_and_a_local_client_finds_it(
        served, client_config, tiny_model_dir):
    server, _, config = served
    assert server.token is not None, "no token generated:\n" + "".join(server.output)
    assert "".join(server.output).count(server.token) == 1 and len(server.token) >= 40
    port = int(server.url.rsplit(":", 1)[1])
    saved = config / "art-nb" / f"serve-{port}.token"
    assert saved.read_text().strip() == server.token
    assert saved.stat().st_mode & 0o777 == 0o600 and saved.parent.stat().st_mode & 0o777 == 0o700
    async with raw(server, None) as stranger:  # another account of this machine, without the file
        for route in ("/api/health", "/api/models/m/checkpoints", "/v1/models"):
            assert (await stranger.get(route)).status_code == 401, route
    backend = RemoteBackend(server.url)  # no api_key: read from the file, as the server said
    assert server.token not in repr(backend) and server.token not in str(backend.__dict__.get("_key"))
    model = tiny_trainable("m", tiny_model_dir)
    await model.register(backend)
    assert await model.get_step() == 0
    assert server.token not in "".join(server.output[1:])  # printed once, never logged after


def test_a_token_on_the_command_line_is_refused_with_the_way_to_pass_it(tmp_path):
    token = "cmdline-token-3f9a0c1b7e5d2a64"
    done = subprocess.run([sys.executable, "-m", "art_nb.cli", "serve", "--port", "0", "--path", str(tmp_path),
                           "--token", token], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "listening" not in done.stdout
    assert "--token-file PATH" in done.stderr and "ART_NB_SERVE_TOKEN" in done.stderr
    assert token not in done.stdout + done.stderr


# --- links planted under --path -----------------------------------------------------------------


async def test_a_linked_writer_lock_is_refused_and_the_file_outside_is_untouched(
        served, client_config, tiny_model_dir, outside):
    server, path, _ = served
    model_dir = path / "faults" / "models" / "victim"
    model_dir.mkdir(parents=True)
    (model_dir / ".writer.lock").symlink_to(outside)
    with pytest.raises(RemoteBackendError, match=r"faults/models/victim/\.writer\.lock is a symbolic link"):
        await tiny_trainable("victim", tiny_model_dir).register(RemoteBackend(server.url))
    assert outside.read_text() == SECRET_TEXT


async def test_a_linked_checkpoint_entry_is_never_served(served, client_config, tiny_model_dir, outside):
    server, path, _ = served
    model = tiny_trainable("m", tiny_model_dir)
    await model.register(RemoteBackend(server.url))
    checkpoints = path / "faults" / "models" / "m" / "checkpoints"
    (checkpoints / "0000" / "notes.txt").symlink_to(outside)
    os.link(outside, checkpoints / "0000" / "hard.txt")
    (checkpoints / "0042").symlink_to(outside.parent, target_is_directory=True)
    try:
        async with raw(server, server.token) as client:
            listing = (await client.get("/api/models/m/checkpoints/0/files")).json()["files"]
            assert {f["name"] for f in listing} >= {"adapter_model.safetensors", "adapter_config.json"}
            assert not {"notes.txt", "hard.txt"} & {f["name"] for f in listing}
            for name in ("notes.txt", "hard.txt"):
                answer = await client.get(f"/api/models/m/checkpoints/0/files/{name}")
                assert answer.status_code == 404 and SECRET_TEXT not in answer.text
            assert 42 not in (await client.get("/api/models/m/checkpoints")).json()["steps"]
            answer = await client.get("/api/models/m/checkpoints/42/files/secret.txt")
            assert answer.status_code == 404 and SECRET_TEXT not in answer.text
            adapter = await client.get("/api/models/m/checkpoints/0/files/adapter_config.json")
            assert adapter.status_code == 200 and adapter.json()["r"] == 4  # plain files still are
    finally:
        for planted in (checkpoints / "0000" / "notes.txt", checkpoints / "0000" / "hard.txt", checkpoints / "0042"):
            planted.unlink()


# --- delete_checkpoints by a metric that does not exist, and a damaged history ------------------


async def three_checkpoints(server: Served, name: str, model_path: Path) -> art.TrainableModel:
    """Steps 0, 1, 2 on the server, with val/reward 0.9, 0.1, 0.2 logged for them (step 0 is the best)."""
    model = tiny_trainable(name, model_path)
    await model.register(RemoteBackend(server.url))
    for step, reward in enumerate((0.9, 0.1, 0.2)):
        if step:
            await model.train(await gather_groups(model, groups=1, size=2, seed=step),
                              config=art.TrainConfig(learning_rate=1e-3))
        await model.log([], split="val", metrics={"reward": reward}, step=step)
    assert await model.backend.list_checkpoints(model) == [0, 1, 2]
    return model


async def test_a_typo_in_best_metric_is_refused_naming_the_metrics_and_deletes_nothing(
        served, client_config, tiny_model_dir):
    """It deleted steps 0-2 and kept 3, with nothing in any log."""
    server, _, _ = served
    model = await three_checkpoints(server, "typo", tiny_model_dir)
    with pytest.raises(UnknownMetricError, match=r"'val/rewrad': no logged step has a value of it \(did you mean "
                                                 r"'val/reward'\?\).*nothing was deleted. Metrics in the history: "):
        await model.delete_checkpoints("val/rewrad")
    assert await model.backend.list_checkpoints(model) == [0, 1, 2]
    assert await model.delete_checkpoints("val/reward") == [1]  # the best (0) and the served step (2) stay


async def test_a_history_line_that_is_not_utf8_is_skipped_with_a_warning_not_a_500(
        served, client_config, tiny_model_dir):
    server, path, _ = served
    model = await three_checkpoints(server, "damaged", tiny_model_dir)
    history = path / "faults" / "models" / "damaged" / "history.jsonl"
    with open(history, "ab") as handle:  # one latin-1 byte: the whole history was unreadable
        handle.write('{"step": 1, "val/reward": 5.0, "note": "caf\u00e9"}\n'.encode("latin-1"))
    lines = len(history.read_bytes().splitlines())
    assert await model.delete_checkpoints("val/reward") == [1]  # the damaged line's 5.0 is not read
    assert await model.backend.list_checkpoints(model) == [0, 2]
    assert any(f"history.jsonl line {lines} is skipped" in line and "UnicodeDecodeError" in line
               for line in server.output)
