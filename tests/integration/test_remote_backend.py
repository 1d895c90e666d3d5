"""The real `art-nb serve` process on loopback with the tiny model on CPU, driven by `RemoteBackend`:
two training steps, progress streamed back from the real trainer, auth, the version handshake, a
crash + restart that resumes at the last step, and bad input answered with 400s."""

from __future__ import annotations

import hashlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import art_nb as art
from art_nb import events
from art_nb.remote import client as remote_module
from art_nb.remote.client import RemoteBackend, RemoteBackendError

pytestmark = pytest.mark.slow

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOKEN = "integration-token-1d7e0b"
PROMPT = [{"role": "user", "content": "Say a colour."}]


class ServeProcess:
    """`python -m art_nb.cli serve ...` in a subprocess; its output is drained so it never blocks."""

    def __init__(self, path: Path, port: int = 0, token_args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        # The token from the environment unless the caller says otherwise (never on the command line,
        # where every local user can read it: the CLI refuses --token).
        args = [sys.executable, "-m", "art_nb.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--path", str(path), *(token_args or [])]
        token_env = {} if token_args else {"ART_NB_SERVE_TOKEN": TOKEN}
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **token_env, **(env or {})})
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.url = self._wait_for_url()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def _wait_for_url(self, timeout: float = 120.0) -> str:
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                self.kill()
                raise RuntimeError("art-nb serve did not start:\n" + "".join(self.output)) from None
            match = re.search(r"listening on (http://[\d.]+:\d+)", line)
            if match:
                return match.group(1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def make_model() -> art.TrainableModel:
    return art.TrainableModel(name="m1", project="it", base_model=TINY,
                              config=art.ModelConfig(max_seq_len=512, lora=art.LoraConfig(rank=8, alpha=32)))


async def rollout(model: art.TrainableModel, seed: int) -> art.Trajectory:
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=PROMPT, max_tokens=8, temperature=1.0, logprobs=True, seed=seed)
    choice = completion.choices[0]
    text = choice.message.content or ""
    return art.Trajectory(messages_and_choices=[*PROMPT, choice], reward=float("e" in text.lower()) - 0.05 * len(text))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("served")
    token_file = tmp_path_factory.mktemp("secret") / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    process = ServeProcess(path, token_args=["--token-file", str(token_file)])
    yield process, path
    process.stop()
    assert TOKEN not in "".join(process.output)  # read from the file, never printed


async def test_a_client_trains_two_steps_through_the_server(server, tmp_path):
    process, path = server
    backend = RemoteBackend(process.url, api_key=TOKEN, path=tmp_path)
    model = make_model()
    await model.register(backend)
    assert "engine" in backend.choices(model)
    assert await model.get_step() == 0
    seen: list[dict] = []
    unsubscribe = events.subscribe(seen.append)
    try:
        for expected in (1, 2):
            groups = await art.gather_trajectory_groups(
                [art.TrajectoryGroup(rollout(model, 10 * g + i) for i in range(3)) for g in range(2)], pbar_desc=None)
            result = await model.train(groups, config=art.TrainConfig(learning_rate=5e-3))
            assert result.step == expected and result.metrics["tokens_trained"] > 0
    finally:
        unsubscribe()
    streamed = [(e["type"], e.get("step")) for e in seen if e.get("remote") == process.url]
    assert ("train_started", 0) in streamed and ("train_finished", 2) in streamed
    assert await model.get_step() == 2
    assert await backend.list_checkpoints(model) == [0, 1, 2]
    served = path / "it/models/m1"
    assert (served / "trajectories/train/0001.jsonl").exists()

    local = await backend.download_checkpoint(model)
    adapter = "adapter_model.safetensors"
    assert hashlib.sha256((local / adapter).read_bytes()).digest() == \
        hashlib.sha256((served / "checkpoints/0002" / adapter).read_bytes()).digest()
    assert await model.log([groups[0]], split="val") and (served / "trajectories/val/0002.jsonl").exists()


async def test_the_real_trainers_progress_reaches_the_client(server, tmp_path):
    """`LocalBackend.train` passes `on_progress` to the trainer, `art-nb serve` streams it as NDJSON
    `progress` lines, and the client hands each to its own `on_progress` (a fake backend proved
    only the last two links)."""
    process, _ = server
    backend = RemoteBackend(process.url, api_key=TOKEN, path=tmp_path)
    model = make_model()
    await model.register(backend)
    step = await model.get_step()
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(model, 100 + i) for i in range(3)) for _ in range(2)], pbar_desc=None)
    progress: list[dict] = []
    result = await model.train(groups, config=art.TrainConfig(learning_rate=5e-3), on_progress=progress.append)
    assert result.step == step + 1
    assert progress, "no progress line reached the client"
    assert all(p["phase"] == "train" and 1 <= p["done"] <= p["total"] for p in progress)
    assert await backend.wait_for_checkpoint(model) == step + 1
    assert step + 1 in await backend.list_checkpoints(model)


async def test_a_missing_or_wrong_token_is_rejected(server):
    process, _ = server
    for key in (None, "not-the-token"):
        with pytest.raises(RemoteBackendError, match="rejected the token \\(HTTP 401\\)"):
            await make_model().register(RemoteBackend(process.url, api_key=key))
    import openai

    stranger = openai.AsyncOpenAI(base_url=f"{process.url}/v1", api_key="not-the-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await stranger.chat.completions.create(model="m1", messages=PROMPT, max_tokens=2)


async def test_a_client_of_another_version_fails_clearly(server, monkeypatch):
    process, _ = server
    monkeypatch.setattr(remote_module, "_client_version", lambda: "7.3.0")
    with pytest.raises(RemoteBackendError, match="version mismatch: this client is 7.3.0.*art-nb=="):
        await make_model().register(RemoteBackend(process.url, api_key=TOKEN))


async def test_bad_input_is_a_400_without_server_paths_on_the_real_server(server, tmp_path):
    """Probes against the real `art-nb serve` and LocalBackend: each of these was a 500
    naming absolute paths (or, for step=-5, wrote trajectories/val/-005.jsonl)."""
    import httpx

    process, path = server
    model = make_model()
    await model.register(RemoteBackend(process.url, api_key=TOKEN))
    headers = {"Authorization": f"Bearer {TOKEN}", "X-Art-Nb-Version": art.__version__}
    async with httpx.AsyncClient(base_url=process.url, headers=headers, timeout=60) as raw:
        for body in ({"items": [], "split": "../../escape"}, {"items": [], "step": -5},
                     {"items": [], "metrics": {"reward": "high"}}):
            response = await raw.post("/api/models/m1/log", json=body)
            assert response.status_code == 400 and str(path) not in response.text, response.text
        assert not list(path.glob("**/-*.jsonl")) and not (path.parent / "escape").exists()
        deleted = await raw.post("/api/models/m1/checkpoints/delete", json={"keep_last": 0})
        assert deleted.status_code == 400 and "keep_last" in deleted.text
        answers = []
        for base_model in ("/etc", "/no/such/directory"):
            response = await raw.post("/api/models", json={"name": "probe", "project": "it", "base_model": base_model})
            assert response.status_code == 400 and base_model not in response.text
            answers.append(response.json())
        assert answers[0] == answers[1]  # no filesystem oracle
        for name in ("m1@\u00b2", "m1@-5"):
            response = await raw.post("/v1/chat/completions", json={"model": name, "messages": PROMPT, "max_tokens": 2})
            assert response.status_code == 400 and response.json()["error"]["param"] == "model"
        rebound = await raw.get("/api/health", headers={"Host": "evil.example"})
        assert rebound.status_code == 403


async def test_after_a_crash_and_restart_the_client_resumes_at_the_latest_step(server):
    process, path = server
    backend, model = RemoteBackend(process.url, api_key=TOKEN), make_model()
    await model.register(backend)
    step = await model.get_step()
    process.kill()  # no shutdown: the process is simply gone
    with pytest.raises(RemoteBackendError, match="cannot reach the art-nb server.*re-run `await model.register"):
        await model.get_step()
    port = int(process.url.rsplit(":", 1)[1])
    restarted = ServeProcess(path, port=port)  # the token from ART_NB_SERVE_TOKEN this time
    try:
        with pytest.raises(RemoteBackendError, match="not registered on this server"):
            await model.get_step()
        await model.register(backend)  # what the error told us to do
        assert await model.get_step() == step
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, i) for i in range(2))], pbar_desc=None)
        assert (await model.train(groups)).step == step + 1
    finally:
        assert restarted.stop() == 0

