"""The remote protocol without a model: wire format, versions, retries, and `art-nb serve`'s app driven
by the real `RemoteBackend` over loopback HTTP, with a backend that trains instantly."""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from pathlib import Path

import httpx
import pytest
from conftest import make_choice
from openai.types.chat.chat_completion import Choice

import art_nb as art
from art_nb import cli, events, web
from art_nb.backend import Backend, TrainResult
from art_nb.local import LocalBackend
from art_nb.local.server import InferenceGate, create_app, start_server
from art_nb.remote import client as remote_module
from art_nb.remote import serve as serve_module
from art_nb.remote.client import RemoteBackend, RemoteBackendError, RemoteTrainingError
from art_nb.remote.serve import _resolve_token, create_serve_app, is_loopback
from art_nb.remote.tokens import loopback_token, save_token, token_path
from art_nb.secrets import Secret
from art_nb.wire import (
    RetryPolicy,
    group_from_wire,
    group_to_wire,
    parse_retry_after,
    request_with_retries,
    trajectory_from_wire,
    trajectory_to_wire,
    version_mismatch,
)

TOKEN = "serve-token-5be0c1d94f"
PROMPT = [{"role": "user", "content": "Say a colour."}]


@pytest.fixture(autouse=True)
def private_config(tmp_path_factory, monkeypatch):
    """Token files go to a folder of the test's own, never the user's ~/.config (and none is found there)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))
    monkeypatch.delenv("ART_NB_SERVE_TOKEN", raising=False)
    monkeypatch.delenv("ART_NB_API_KEY", raising=False)


# --- wire format, versions, retries -------------------------------------------------------------


def test_choices_round_trip_with_token_ids_and_logprobs(chatml_tokenizer):
    call = {"id": "c1", "type": "function", "function": {"name": "move", "arguments": '{"cell": 4}'}}
    choice = make_choice(chatml_tokenizer, "", tool_calls=[call])
    trajectory = art.Trajectory(
        messages_and_choices=[*PROMPT, make_choice(chatml_tokenizer, "blue"), {"role": "user", "content": "again"},
                              choice, {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
        reward=0.5, metrics={"moves": 3}, metadata={"seed": 7}, logs=["note"])
    group = art.TrajectoryGroup([trajectory], exceptions=["ValueError: bad move"], metadata={"scenario": 2})
    back = group_from_wire(json.loads(json.dumps(group_to_wire(group))))
    restored = back.trajectories[0]
    assert restored == trajectory
    assert back.exceptions == group.exceptions and back.metadata == group.metadata
    for before, after in zip(trajectory.choices(), restored.choices(), strict=True):
        assert isinstance(after, type(before))
        assert after.model_extra["token_ids"] == before.model_extra["token_ids"]
        assert [e.logprob for e in after.logprobs.content] == [e.logprob for e in before.logprobs.content]
    assert restored.messages_and_choices[3].message.tool_calls[0].function.arguments == '{"cell": 4}'
    with pytest.raises(ValueError, match="not tagged"):
        trajectory_from_wire({**trajectory_to_wire(trajectory), "messages_and_choices": [{"role": "user"}]})


def test_additional_histories_keep_their_choices_over_the_wire(chatml_tokenizer):
    """A sub-agent's conversation (ART's additional_histories) is trained on too: its Choices must arrive as
    Choices, token ids included, not as plain dicts (they did: only the main conversation was tagged)."""
    sub = art.trajectories.History(messages_and_choices=[*PROMPT, make_choice(chatml_tokenizer, "green")])
    trajectory = art.Trajectory(messages_and_choices=[*PROMPT, make_choice(chatml_tokenizer, "blue")], reward=1.0,
                                additional_histories=[sub])
    restored = trajectory_from_wire(json.loads(json.dumps(trajectory_to_wire(trajectory))))
    choice = restored.additional_histories[0].messages_and_choices[1]
    assert isinstance(choice, Choice)
    assert choice.model_extra["token_ids"] == make_choice(chatml_tokenizer, "green").model_extra["token_ids"]


def test_versions_must_agree_on_major_minor():
    assert version_mismatch("0.1.0", "0.1.9") is None
    assert version_mismatch("1.2.0rc1", "1.2.3") is None
    message = version_mismatch("0.2.0", "0.1.4")
    assert message and "0.2.0" in message and "0.1.4" in message and "art-nb==0.1.*" in message


def test_retry_after_and_backoff_bounds():
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 28 <= parse_retry_after(later) <= 31
    policy, rng = RetryPolicy(base_delay=1.0, max_delay=8.0, max_retry_after=60.0), random.Random(0)
    for attempt in range(8):
        ceiling = min(8.0, 2.0**attempt)
        assert ceiling / 2 <= policy.delay(attempt, None, rng) <= ceiling
    assert policy.delay(0, 12.0) == 12.0 and policy.delay(0, 999.0) == 60.0


async def test_what_is_retried_and_what_is_not():
    seen: list[tuple[str, str | None]] = []
    plan: list[int | Exception] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.headers.get("idempotency-key")))
        outcome = plan.pop(0) if plan else 200
        if isinstance(outcome, Exception):
            raise outcome
        return httpx.Response(outcome, headers={"Retry-After": "0"} if outcome == 429 else {})

    async def no_sleep(_: float) -> None:
        pass

    policy = RetryPolicy(attempts=3)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x") as client:
        async def send(method: str, **kwargs) -> int:
            seen.clear()
            response = await request_with_retries(client, method, "/r", policy=policy, sleep=no_sleep, **kwargs)
            return response.status_code

        plan[:] = [500]
        assert await send("POST") == 500 and len(seen) == 1  # may have run: not repeated without a key
        plan[:] = [500, 502]
        assert await send("POST", idempotency_key="k1") == 200
        assert seen == [("POST", "k1")] * 3
        plan[:] = [429]
        assert await send("POST") == 200 and len(seen) == 2  # refused: safe to send again
        plan[:] = [httpx.ConnectError("refused"), 503]
        assert await send("GET") == 200 and len(seen) == 3
        plan[:] = [503, 503, 503]
        assert await send("GET") == 503 and len(seen) == 3  # bounded
        plan[:] = [httpx.ReadTimeout("slow")]
        with pytest.raises(httpx.ReadTimeout):
            await send("POST")


def test_a_token_is_generated_unless_no_token_is_asked_for_on_loopback(monkeypatch):
    """Any account of the machine can reach a loopback port: a token by default there too (none was
    generated on loopback, and a second user downloaded the adapter, deleted a checkpoint, trained)."""
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert is_loopback("127.0.0.2") and is_loopback("[::1]")  # all of 127.0.0.0/8 is this machine
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("gpu-box")
    shown: list[str] = []
    for host in ("0.0.0.0", "127.0.0.1"):
        secret = _resolve_token(host, None, shown.append)
        assert secret.source == "generated" and len(secret.reveal()) >= 40
    assert not shown  # `serve` prints it once bound, with where it is saved
    assert _resolve_token("127.0.0.1", None, shown.append, no_token=True) is None
    with pytest.raises(ValueError, match="--no-token is for loopback only: bound to 0.0.0.0"):
        _resolve_token("0.0.0.0", None, shown.append, no_token=True)
    monkeypatch.setenv("ART_NB_SERVE_TOKEN", TOKEN)
    with pytest.raises(ValueError, match="--no-token contradicts the token from environment variable ART_NB_SERVE"):
        _resolve_token("127.0.0.1", None, shown.append, no_token=True)
    given = "given-token-0123456789"  # 16 characters at least, off loopback
    assert _resolve_token("0.0.0.0", given, shown.append).reveal() == given and not shown


def test_a_saved_token_is_private_reused_on_its_port_and_found_by_a_loopback_client_only():
    path = save_token(Secret("saved-token-0123456789abcdef"), 8123)
    assert path == token_path(8123) and path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert _resolve_token("127.0.0.1", None, print, port=8123).source == f"token file {path}"  # a restart
    assert _resolve_token("127.0.0.1", None, print, port=8124).source == "generated"
    for url in ("http://127.0.0.1:8123", "http://localhost:8123/v1", "http://[::1]:8123"):
        assert loopback_token(url).reveal() == "saved-token-0123456789abcdef", url
        assert RemoteBackend(url)._key.reveal() == "saved-token-0123456789abcdef"
    assert loopback_token("http://10.0.0.5:8123") is None  # this machine's token never goes elsewhere
    assert loopback_token("http://127.0.0.1:8124") is None
    assert RemoteBackend("http://127.0.0.1:8123", api_key="explicit-key")._key.reveal() == "explicit-key"
    path.chmod(0o644)  # readable by others: not trusted, and a restart makes a new one
    assert loopback_token("http://127.0.0.1:8123") is None
    assert _resolve_token("127.0.0.1", None, print, port=8123).source == "generated"


async def test_both_servers_share_one_auth_middleware_and_one_loopback_rule(tmp_path):
    """The in-kernel endpoint and `art-nb serve` check keys with one middleware, answer a missing key
    in one shape, and agree on which hosts need no key (127.0.0.2 once was loopback to only one)."""
    kernel = create_app(OneModel(), InferenceGate(), api_key=TOKEN)
    served = create_serve_app(InstantBackend(tmp_path / "served"), token=Secret(TOKEN))
    for app in (kernel, served):
        assert web.BearerAuth in [m.cls for m in app.user_middleware]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as raw:
            refused = await raw.get("/v1/models", headers={"Authorization": "Bearer wrong"})
            assert refused.status_code == 401 and TOKEN not in refused.text
            assert refused.json()["error"]["code"] == "invalid_api_key"
            assert refused.json()["error"]["type"] == "invalid_request_error"
            assert (await raw.get("/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})).status_code != 401
    assert serve_module.is_loopback is web.is_loopback
    assert _resolve_token("127.0.0.2", None, print, no_token=True) is None  # serve: --no-token allowed
    with pytest.raises(ValueError, match="loopback only"):
        _resolve_token("10.1.2.3", None, print, no_token=True)
    local = LocalBackend(tmp_path / "local", host="127.0.0.2")  # the in-kernel endpoint: no key needed either
    await local.close()
    with pytest.raises(ValueError, match="needs an api_key"):
        LocalBackend(tmp_path / "local", host="10.1.2.3")


# --- the serve app over loopback ----------------------------------------------------------------


class InstantBackend:
    """LocalBackend's methods over a directory; a 'step' copies the adapter file with a new suffix."""

    def __init__(self, root: Path) -> None:
        self.root, self.steps, self.received = root, {}, []
        self.hold: asyncio.Event | None = None
        self.fail_with: Exception | None = None

    def model_dir(self, model) -> Path:
        return self.root / model.project / "models" / model.name

    def checkpoint_dir(self, model, step=None) -> Path:
        step = self.steps[model.name] if step is None else step
        return self.model_dir(model) / "checkpoints" / f"{step:04d}"

    def _write(self, model, step: int) -> None:
        directory = self.checkpoint_dir(model, step)
        directory.mkdir(parents=True)
        (directory / "adapter_model.safetensors").write_bytes(f"weights {step}".encode() * 1000)
        (directory / "adapter_config.json").write_text('{"r": 8}')
        (directory / "trainer_state.pt").write_bytes(b"optimizer")
        (directory / "meta.json").write_text(json.dumps({"step": step, "base_model": model.base_model}))

    async def register(self, model) -> None:
        if model.name not in self.steps:
            self.steps[model.name] = 0
            self._write(model, 0)

    def choices(self, model) -> dict[str, str]:
        return {"engine": "instant: no model"}

    async def get_step(self, model) -> int:
        return self.steps[model.name]

    async def wait_for_checkpoint(self, model) -> int:
        return self.steps[model.name]  # written before train returns

    async def train(self, model, groups, config=None, *, on_progress=None) -> TrainResult:
        self.received.append(groups)
        events.emit("train_started", model=model.name, step=self.steps[model.name], groups=len(groups))
        await asyncio.to_thread(events.emit, "trainer_note", model=model.name)  # from another thread
        on_progress({"phase": "train", "done": 1, "total": 1})
        if self.hold is not None:
            await self.hold.wait()
        if self.fail_with is not None:
            raise self.fail_with
        step = self.steps[model.name] + 1
        self._write(model, step)
        self.steps[model.name] = step
        events.emit("train_finished", model=model.name, step=step, metrics={"loss": 0.25})
        return TrainResult(step=step, metrics={"loss": 0.25, "lr": config.learning_rate})

    async def train_sft(self, model, trajectories, config=None, _config=None, verbose=False, *, on_progress=None):
        raise NotImplementedError("no SFT in this fake")

    async def log(self, model, items, split="val", step=None, metrics=None) -> dict[str, float]:
        return {"trajectories": float(sum(len(i) if isinstance(i, art.TrajectoryGroup) else 1 for i in items))}

    async def delete_checkpoints(self, model, steps=None, keep_last=1, *, best_metric=None) -> list[int]:
        existing = sorted(s for s in range(self.steps[model.name] + 1) if self.checkpoint_dir(model, s).exists())
        targets = sorted(set(steps) if steps is not None else set(existing[:-keep_last]))
        if best_metric is not None:
            self.best_metric_asked = best_metric
            targets = existing[1:]  # pretend step 0 was best
        return [s for s in targets if s != self.steps[model.name]]

    def in_process_http_client(self, model: object) -> None:  # the protocol's: no in-process endpoint here
        return None

    def inference_endpoint(self, model):
        raise NotImplementedError("the serve app never asks")

    def inference_model_name(self, model, step=None) -> str:
        raise NotImplementedError("the serve app never asks")

    async def close(self) -> None:
        pass


class OneModel:
    def list_models(self) -> list[str]:
        return ["m"]

    def resolve(self, name):
        raise KeyError(name)


@pytest.fixture
async def served(tmp_path):
    backend = InstantBackend(tmp_path / "server")
    app = create_serve_app(backend, token=Secret(TOKEN), openai_app=create_app(OneModel(), InferenceGate()))
    server = await start_server(app, host="127.0.0.1", port=0)
    url = server.base_url.removesuffix("/v1")
    yield backend, url, server
    await server.stop()


def make_model(name: str = "m") -> art.TrainableModel:
    return art.TrainableModel(name=name, project="p", base_model="tiny")


async def test_two_steps_stream_progress_and_keep_token_ids(served, tmp_path, chatml_tokenizer):
    backend, url, _ = served
    client = RemoteBackend(url, api_key=TOKEN, path=tmp_path / "client")
    model = make_model()
    await model.register(client)
    assert client.choices(model) == {"engine": "instant: no model"}
    seen: list[dict] = []
    unsubscribe = events.subscribe(seen.append)
    progress: list[dict] = []
    try:
        for expected in (1, 2):
            group = art.TrajectoryGroup([art.Trajectory(
                messages_and_choices=[*PROMPT, make_choice(chatml_tokenizer, "blue")], reward=1.0)])
            result = await model.train([group], config=art.TrainConfig(learning_rate=0.01), on_progress=progress.append)
            assert result == TrainResult(step=expected, metrics={"loss": 0.25, "lr": 0.01})
    finally:
        unsubscribe()
    arrived = backend.received[0][0].trajectories[0].messages_and_choices[1]
    assert arrived.model_extra["token_ids"] == make_choice(chatml_tokenizer, "blue").model_extra["token_ids"]
    assert progress == [{"phase": "train", "done": 1, "total": 1}] * 2
    remote_events = [e["type"] for e in seen if e.get("remote") == url]
    assert remote_events.count("train_started") == 2 and remote_events.count("train_finished") == 2
    assert "trainer_note" in remote_events and "train_progress" in remote_events
    assert await model.get_step() == 2 and await client.list_checkpoints(model) == [0, 1, 2]
    assert await client.wait_for_checkpoint(model) == 2
    assert client.model_dir(model) == tmp_path / "client/p/models/m"
    assert str(model.openai_client().base_url) == f"{url}/v1/"
    assert await model.log([group], split="val") == {"trajectories": 1.0}
    assert await model.delete_checkpoints(keep_last=1) == [0, 1]


async def test_download_checks_hashes_and_lands_where_local_backend_resumes(served, tmp_path):
    _, url, _ = served
    client = RemoteBackend(url, api_key=TOKEN, path=tmp_path / "client")
    model = make_model()
    await model.register(client)
    landed = await client.download_checkpoint(model)
    assert landed == tmp_path / "client/p/models/m/checkpoints/0000"
    assert sorted(p.name for p in landed.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "meta.json"]
    assert (landed / "adapter_model.safetensors").read_bytes() == b"weights 0" * 1000
    assert json.loads((landed / "meta.json").read_text())["downloaded_from"] == url
    elsewhere = await client.download_checkpoint(model, 0, tmp_path / "export", include_optimizer=True)
    assert (elsewhere / "trainer_state.pt").read_bytes() == b"optimizer"
    with pytest.raises(FileExistsError):
        await client.download_checkpoint(model, 0, tmp_path / "export")
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}",
                                                         "X-Art-Nb-Version": art.__version__}) as raw:
        for name in ("..%2F..%2F..%2Fsecret", "%2Fetc%2Fpasswd", "missing.bin"):
            response = await raw.get(f"/api/models/m/checkpoints/0/files/{name}")
            assert response.status_code == 404
        assert (await raw.get("/api/models/m/checkpoints/7/files")).status_code == 404


async def test_every_route_needs_the_token(served, tmp_path):
    _, url, _ = served
    for key in (None, "wrong-token"):
        with pytest.raises(RemoteBackendError, match="rejected the token \\(HTTP 401\\).*ART_NB_API_KEY") as info:
            await make_model().register(RemoteBackend(url, api_key=key))
        assert TOKEN not in str(info.value)
    async with httpx.AsyncClient(base_url=url) as raw:
        assert (await raw.get("/v1/models")).status_code == 401
        assert (await raw.get("/v1/models", headers={"Authorization": "Bearer wrong"})).status_code == 401
        assert (await raw.get("/api/health", headers={"Authorization": TOKEN})).status_code == 401  # no "Bearer"
        listed = await raw.get("/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
        assert listed.status_code == 200 and listed.json()["data"][0]["id"] == "m"
        no_version = await raw.get("/api/health", headers={"Authorization": f"Bearer {TOKEN}"})
        assert no_version.status_code == 409 and "X-Art-Nb-Version" in no_version.json()["error"]["message"]


async def test_a_client_of_another_minor_version_is_refused_clearly(served, monkeypatch):
    _, url, _ = served
    monkeypatch.setattr(remote_module, "_client_version", lambda: "0.99.0")
    with pytest.raises(RemoteBackendError, match="version mismatch: this client is 0.99.0, the server is"):
        await make_model().register(RemoteBackend(url, api_key=TOKEN))


async def test_a_failed_step_and_an_unknown_model_say_what_happened(served):
    backend, url, _ = served
    client, model = RemoteBackend(url, api_key=TOKEN), make_model()
    with pytest.raises(RemoteBackendError, match="not registered on this server \\(it may have restarted\\).*register"):
        await client.get_step(model)
    await model.register(client)
    backend.fail_with = RuntimeError("3 consecutive updates were non-finite")
    with pytest.raises(RemoteTrainingError, match="non-finite") as info:
        await model.train([art.TrajectoryGroup([art.Trajectory(messages_and_choices=PROMPT, reward=0.0)])])
    assert info.value.error_type == "RuntimeError"


async def test_the_step_finishes_on_the_server_when_the_client_goes_away(served):
    backend, url, _ = served
    client, model = RemoteBackend(url, api_key=TOKEN), make_model()
    await model.register(client)
    backend.hold = asyncio.Event()
    task = asyncio.ensure_future(model.train([art.TrajectoryGroup([art.Trajectory(messages_and_choices=PROMPT)])]))
    while not backend.received:
        await asyncio.sleep(0.01)
    task.cancel()  # Ctrl-C in the notebook, or the laptop's connection drops
    with pytest.raises(asyncio.CancelledError):
        await task
    backend.hold.set()
    for _ in range(200):
        if await model.get_step() == 1:
            break
        await asyncio.sleep(0.01)
    assert await model.get_step() == 1  # the re-run resumes here


async def test_a_server_that_dies_mid_step_or_is_gone_gives_a_clear_error():
    async def dying_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        line = json.dumps({"type": "accepted", "step": 0}).encode() + b"\n"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
                     + f"{len(line):x}\r\n".encode() + line + b"\r\n")
        await writer.drain()
        writer.transport.abort()  # the process died mid-step: the stream stops without an end

    server = await asyncio.start_server(dying_server, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client, model = RemoteBackend(url, api_key=TOKEN, retry=RetryPolicy(attempts=2, base_delay=0.01)), make_model()
    group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=PROMPT)])
    with pytest.raises(RemoteBackendError, match=f"lost connection to {url} during train.*register.*get_step"):
        await asyncio.wait_for(client.train(model, [group]), 10)
    server.close()
    await server.wait_closed()
    with pytest.raises(RemoteBackendError, match=f"cannot reach the art-nb server at {url}.*art-nb serve"):
        await client.get_step(model)


def test_the_client_and_the_test_backend_implement_the_whole_protocol(tmp_path):
    assert isinstance(RemoteBackend("http://x"), Backend)
    assert isinstance(InstantBackend(tmp_path), Backend)


async def test_no_token_on_loopback_means_no_auth(tmp_path):
    backend = InstantBackend(tmp_path)
    server = await start_server(create_serve_app(backend, token=None), host="127.0.0.1", port=0)
    try:
        model = make_model()
        await model.register(RemoteBackend(server.base_url))  # ".../v1" is accepted too
        assert await model.get_step() == 0
        assert model.backend.inference_endpoint(model).api_key == "none"
    finally:
        await server.stop()


# --- tokens, secrets in errors, bad input -----------------------------------------------------------


def test_the_token_comes_from_a_file_or_the_environment_and_is_long_off_loopback(tmp_path, monkeypatch):
    monkeypatch.delenv("ART_NB_SERVE_TOKEN", raising=False)
    file = tmp_path / "token"
    file.write_text("file-token-0123456789abcdef\n")
    file.chmod(0o600)
    assert _resolve_token("0.0.0.0", None, print, token_file=file).reveal() == "file-token-0123456789abcdef"
    with pytest.raises(ValueError, match="token file .* is empty"):
        (tmp_path / "empty").write_text("\n")
        _resolve_token("0.0.0.0", None, print, token_file=tmp_path / "empty")
    with pytest.raises(ValueError, match="cannot read the token file"):
        _resolve_token("0.0.0.0", None, print, token_file=tmp_path / "missing")
    monkeypatch.setenv("ART_NB_SERVE_TOKEN", "env-token-0123456789abcdef")
    assert _resolve_token("0.0.0.0", None, print).source == "environment variable ART_NB_SERVE_TOKEN"
    for short in ("a", "fifteen-chars!!"):
        with pytest.raises(ValueError, match=r"at least 16 characters.*secrets\.token_urlsafe\(32\)") as info:
            _resolve_token("0.0.0.0", short, print)
        assert "fifteen-chars!!" not in str(info.value)
    assert _resolve_token("127.0.0.1", "a", print).reveal() == "a"  # loopback: no one else can connect


def test_the_cli_reads_the_token_from_a_file_and_refuses_one_on_the_command_line(tmp_path, monkeypatch, capsys):
    calls: list[dict] = []
    monkeypatch.setattr(serve_module, "serve", lambda *args, **kwargs: calls.append({"args": args, **kwargs}))
    for argv in (["serve", "--token", TOKEN], ["serve", f"--token={TOKEN}"], ["serve", "--token"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        refusal = capsys.readouterr().err
        assert info.value.code == 2 and not calls
        assert "--token is refused" in refusal and "/proc/<pid>/cmdline" in refusal
        assert "--token-file PATH" in refusal and "ART_NB_SERVE_TOKEN" in refusal and TOKEN not in refusal
    file = tmp_path / "token"
    file.write_text(TOKEN)
    assert cli.main(["serve", "--token-file", str(file), "--allowed-origin", "http://localhost:8888",
                     "--allow-local-models"]) == 0
    assert capsys.readouterr().err == ""
    assert calls[-1]["token_file"] == str(file) and calls[-1]["allowed_origins"] == ["http://localhost:8888"]
    assert calls[-1]["allow_local_models"] is True and calls[-1]["no_token"] is False
    assert cli.main(["serve", "--no-token"]) == 0 and calls[-1]["no_token"] is True


def test_the_cli_refuses_a_short_token_or_no_token_off_loopback(monkeypatch, capsys):
    monkeypatch.setenv("ART_NB_SERVE_TOKEN", "a")
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--host", "10.1.2.3"])
    assert info.value.code == 2
    assert "secrets.token_urlsafe(32)" in capsys.readouterr().err
    monkeypatch.delenv("ART_NB_SERVE_TOKEN")
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--host", "10.1.2.3", "--no-token"])
    assert info.value.code == 2 and "--no-token is for loopback only" in capsys.readouterr().err


def test_redact_masks_any_long_enough_piece_of_the_key():
    secret = Secret("0123456789abcdefghij")
    assert secret.redact("key=0123456789abcdefghij.") == "key=********."
    assert secret.redact("cut: 0123456789abc") == "cut: ********"  # the head, as a truncation leaves it
    assert secret.redact("tail 89abcdefghij end") == "tail ******** end"
    assert secret.redact("89abcdef") == "********"  # eight characters are enough
    assert secret.redact("89abcde and 0123") == "89abcde and 0123"  # shorter pieces are ordinary text
    assert secret.redact("x 0123456789abc", partial=False) == "x 0123456789abc"


async def test_a_key_the_server_echoes_is_masked_before_the_message_is_cut():
    """The probe: a server error echoing the key at character 470 of 1,000 was cut at 500 and then
    redacted, which found no whole key and showed 30 of its 40 characters."""
    key = "k3y-a1b2c3d4e5f6g7h8i9j0k1l2m3n4o5p6q7r8"
    bodies = [(b"text/plain", ("x" * 470 + key + "y" * 490).encode()),
              (b"application/json", json.dumps({"error": {"message": "z" * 980 + key + "w" * 900}}).encode())]

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        content_type, body = bodies.pop(0)
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: " + content_type
                     + f"\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = RemoteBackend(url, api_key=key, retry=RetryPolicy(attempts=1))
    try:
        for _ in range(2):
            with pytest.raises(RemoteBackendError) as info:
                await client.get_step(make_model())
            message = str(info.value)
            assert not [key[i:i + 8] for i in range(len(key) - 7) if key[i:i + 8] in message], message
            assert "********" in message and len(message) < 1500
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


@pytest.fixture
async def raw_served(served):
    _, url, _ = served
    await make_model().register(RemoteBackend(url, api_key=TOKEN))
    headers = {"Authorization": f"Bearer {TOKEN}", "X-Art-Nb-Version": art.__version__}
    async with httpx.AsyncClient(base_url=url, headers=headers) as raw:
        yield raw


@pytest.mark.parametrize(("route", "body", "word"), [
    ("log", {"items": [], "split": "../../etc"}, "split"),
    ("log", {"items": [], "split": 7}, "split"),
    ("log", {"items": [], "step": -5}, "step"),
    ("log", {"items": [], "step": "abc"}, "step"),
    ("log", {"items": [], "step": 1.5}, "step"),
    ("log", {"items": [], "step": True}, "step"),
    ("log", {"items": [], "metrics": {"a": "x"}}, "metrics"),
    ("log", {"items": [], "metrics": {"a": {"b": 1}}}, "metrics"),
    ("log", {"items": [], "metrics": [1]}, "metrics"),
    ("log", {"items": "x"}, "items"),
    ("log", {"items": [{"group": {"trajectories": 5}}]}, "items"),
    ("checkpoints/delete", {"keep_last": 0}, "keep_last"),
    ("checkpoints/delete", {"keep_last": "x"}, "keep_last"),
    ("checkpoints/delete", {"steps": [-1]}, "steps"),
    ("checkpoints/delete", {"steps": "all"}, "steps"),
    ("train", {"groups": "x"}, "groups"),
])
async def test_bad_input_on_serve_is_400_with_a_reason_and_no_server_path(raw_served, tmp_path, route, body, word):
    response = await raw_served.post(f"/api/models/m/{route}", json=body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert word in message and str(tmp_path) not in response.text and "internal error" not in message


async def test_a_non_finite_metric_is_400(raw_served):
    for value in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
        response = await raw_served.post("/api/models/m/log", content=b'{"items": [], "metrics": {"a": ' + value + b"}}",
                                         headers={"Content-Type": "application/json"})
        assert response.status_code == 400 and "finite" in response.json()["error"]["message"], value


@pytest.fixture
async def strict_served(tmp_path, monkeypatch):
    """A serve app that resolves base models like `art-nb serve` does, but against a fake hub that
    knows one id; run from a directory holding an `org/local` folder."""
    known = {"org/known"}

    def resolve(base_model: str) -> str:  # like models.resolve_base_model: a local folder, else the hub
        if base_model not in known and not Path(base_model).is_dir():
            raise RuntimeError(f"cannot resolve base model {base_model!r}: HF cache: not cached")
        return base_model

    (tmp_path / "org" / "local").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    apps = {}
    for allow in (False, True):
        app = create_serve_app(InstantBackend(tmp_path / f"server-{allow}"), token=None, resolve_model=resolve,
                               allow_local_models=allow)
        apps[allow] = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1",
                                        headers={"X-Art-Nb-Version": art.__version__})
    yield apps
    for client in apps.values():
        await client.aclose()


async def test_base_model_paths_are_refused_over_http_without_echo_or_oracle(strict_served, tmp_path):
    async def register(base_model: str, allow: bool = False) -> httpx.Response:
        return await strict_served[allow].post("/api/models", json={"name": "n", "project": "p", "base_model": base_model})

    for path in ("/etc/passwd", "/no/such/dir", "./m", "../m", "~/m", "a/b/c", "C:\\models\\m", str(tmp_path)):
        response = await register(path)
        assert response.status_code == 400, path
        assert path not in response.text and "--allow-local-models" in response.json()["error"]["message"]
    assert (await register("/etc")).json() == (await register("/no/such/dir")).json()  # no oracle
    # An id-shaped name that is a local folder answers exactly as an id nobody knows.
    local, unknown = await register("org/local"), await register("org/unknown")
    assert local.status_code == unknown.status_code == 400
    assert local.json()["error"]["message"].replace("org/local", "X") == unknown.json()["error"]["message"].replace("org/unknown", "X")
    assert str(tmp_path) not in local.text
    assert (await register("org/known")).status_code == 200
    assert (await register(str(tmp_path / "org" / "local"), allow=True)).status_code == 200


async def test_the_openai_app_answers_a_bad_step_suffix_with_400(served):
    _, url, _ = served
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as raw:
        for name in ("m@\u00b2", "m@3a", "m@", "m@-1", "m@ 3"):
            response = await raw.post("/v1/chat/completions", json={"model": name, "messages": PROMPT})
            assert response.status_code == 400, (name, response.text)
            assert response.json()["error"]["param"] == "model"


async def test_concurrent_trains_of_one_model_take_turns_and_accept_different_steps(served, raw_served,
                                                                                      chatml_tokenizer):
    """Two trains posted at once both answered "accepted": step 0 (found by probing); now the second
    waits for the first and starts from step 1."""
    backend, _, _ = served
    backend.hold = asyncio.Event()
    group = art.TrajectoryGroup([art.Trajectory(
        messages_and_choices=[*PROMPT, make_choice(chatml_tokenizer, "blue")], reward=1.0)])
    body = {"groups": [group_to_wire(group)], "config": {}}

    async def stream_lines() -> list[dict]:
        async with raw_served.stream("POST", "/api/models/m/train", json=body) as response:
            return [json.loads(line) async for line in response.aiter_lines() if line]

    first, second = asyncio.ensure_future(stream_lines()), asyncio.ensure_future(stream_lines())
    await asyncio.sleep(0.3)
    backend.hold.set()
    lines = await asyncio.gather(first, second)
    accepted = sorted(next(item["step"] for item in stream if item["type"] == "accepted") for stream in lines)
    results = sorted(next(item["step"] for item in stream if item["type"] == "result") for stream in lines)
    assert accepted == [0, 1] and results == [1, 2]


async def test_art_style_train_arguments_and_best_checkpoint_deletion_work_remotely(served, tmp_path,
                                                                                  chatml_tokenizer):
    """ART's `backend.train(model, groups, learning_rate=...)` and `delete_checkpoints(best_checkpoint_metric=)`
    reach the server through RemoteBackend as they do on LocalBackend."""
    backend, url, _ = served
    client = RemoteBackend(url, api_key=TOKEN, path=tmp_path / "client")
    model = make_model()
    await model.register(client)
    group = art.TrajectoryGroup([art.Trajectory(
        messages_and_choices=[*PROMPT, make_choice(chatml_tokenizer, "blue")], reward=1.0)])
    result = await client.train(model, [group], learning_rate=0.02, loss_fn="ppo")
    assert result.step == 1 and result.metrics["lr"] == 0.02
    with pytest.warns(UserWarning, match="no_such_knob"):
        await client.train(model, [group], learning_rate=0.03, no_such_knob=1)
    deleted = await client.delete_checkpoints(model, best_metric="val/reward")
    assert backend.best_metric_asked == "val/reward" and deleted == [1]
