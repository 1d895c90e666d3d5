"""`RemoteBackend` against a server that lies, over loopback: what it downloads never replaces this
machine's checkpoints or ignores their writer lock, a file stops at the size the listing gave, and a
train stream's line stops at `MAX_STREAM_LINE`.

Each test failed before its fix: a download silently replaced this machine's checkpoint 0003, wrote
0004 into a model directory another process was writing, read on and on for a file listed as 16
bytes, and an endless train-stream line was buffered whole (+423 MB).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import make_choice
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import art_nb as art
from art_nb.local.server import start_server
from art_nb.remote.client import MAX_STREAM_LINE, RemoteBackend, RemoteBackendError
from art_nb.store import ModelStore, StoreLockedError
from art_nb.wire import LineTooLongError, bounded_lines

MB = 1 << 20
FILES = {"adapter_model.safetensors": b"server weights 0", "adapter_config.json": b'{"r": 8, "pad": 1}'}
PROMPT = [{"role": "user", "content": "Say a colour."}]


class Liar:
    """An `art-nb serve` look-alike. `endless` files are listed at their size and then never end; its
    train stream is one line that never ends. Counts what it sent."""

    def __init__(self) -> None:
        self.endless: set[str] = set()
        self.sent = 0

    def app(self) -> Starlette:
        async def health(request: Request) -> Response:
            return JSONResponse({"server": "art-nb", "version": art.__version__, "models": []})

        async def register(request: Request) -> Response:
            return JSONResponse({"step": 4, "choices": {}})

        async def step(request: Request) -> Response:
            return JSONResponse({"step": 4})

        async def files(request: Request) -> Response:
            return JSONResponse({"files": [{"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                                           for name, data in FILES.items()]})

        async def file(request: Request) -> Response:
            name = request.path_params["file"]
            return StreamingResponse(self._endless() if name in self.endless else iter([FILES[name]]))

        async def train(request: Request) -> Response:
            return StreamingResponse(self._endless(), media_type="application/x-ndjson")

        return Starlette(routes=[
            Route("/api/health", health), Route("/api/models", register, methods=["POST"]),
            Route("/api/models/m/step", step), Route("/api/models/m/checkpoints/{step:int}/files", files),
            Route("/api/models/m/checkpoints/{step:int}/files/{file}", file),
            Route("/api/models/m/train", train, methods=["POST"])])

    async def _endless(self) -> AsyncIterator[bytes]:
        chunk = b"x" * MB
        while True:  # stops when the client hangs up
            self.sent += len(chunk)
            yield chunk
            await asyncio.sleep(0)


@pytest.fixture
async def liar(tmp_path):
    server = Liar()
    running = await start_server(server.app(), host="127.0.0.1", port=0)
    client = RemoteBackend(running.base_url, api_key="a-token-for-the-liar", path=tmp_path / "client")
    model = art.TrainableModel(name="m", project="p", base_model="tiny")
    await model.register(client)
    yield server, client, model
    await running.stop()


def local_checkpoint(client: RemoteBackend, step: int) -> Path:
    store = ModelStore(client.path, "p", "m")
    return store.write_checkpoint(step, lambda d: (d / "adapter_model.safetensors").write_bytes(b"this machine's"))


async def test_a_download_never_replaces_this_machines_checkpoint(liar):
    _, client, model = liar
    mine = local_checkpoint(client, 3)
    with pytest.raises(FileExistsError, match="checkpoint 0003 of 'm' is already on this machine.*never replaces one: "
                                              "pass dest="):
        await client.download_checkpoint(model, 3)
    assert (mine / "adapter_model.safetensors").read_bytes() == b"this machine's"
    beside = await client.download_checkpoint(model, 3, client.path / "from-server")  # where it says to
    assert (beside / "adapter_model.safetensors").read_bytes() == b"server weights 0"
    landed = await client.download_checkpoint(model, 4)  # a step this machine lacks lands in the store
    assert (landed / "adapter_model.safetensors").read_bytes() == b"server weights 0"
    assert not list(client.path.glob(".download-*"))


async def test_a_download_respects_the_writer_lock_of_another_process(liar):
    _, client, model = liar
    code = ("import sys, time; from art_nb.store import ModelStore; s = ModelStore(sys.argv[1], 'p', 'm'); "
            "s.acquire_writer(); print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(client.path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StoreLockedError, match=f"another process \\(pid {holder.pid}\\)"):
            await client.download_checkpoint(model, 4)
    finally:
        holder.kill()  # our own child, by its id
        holder.wait()
    assert not (client.model_dir(model) / "checkpoints" / "0004").exists()
    await client.download_checkpoint(model, 4)  # once the writer is gone


async def test_a_file_stops_at_the_size_the_listing_gave(liar):
    server, client, model = liar
    server.endless.add("adapter_model.safetensors")
    with pytest.raises(RemoteBackendError, match="sent more than the 16 bytes its listing gave; stopped reading"):
        await asyncio.wait_for(client.download_checkpoint(model, 4), 60)
    assert server.sent < 64 * MB  # what TCP had in flight, not an endless read
    assert not (client.model_dir(model) / "checkpoints" / "0004").exists()
    assert not list(client.path.glob(".download-*"))


async def test_an_endless_train_stream_line_stops_at_the_limit(liar, chatml_tokenizer):
    server, _, model = liar
    group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[*PROMPT, make_choice(chatml_tokenizer, "blue")],
                                                reward=1.0)])
    with pytest.raises(RemoteBackendError, match=f"sent a line of over {MAX_STREAM_LINE:,} bytes without ending it; "
                                                 "stopped reading.*get_step"):
        await asyncio.wait_for(model.train([group]), 60)
    assert server.sent < MAX_STREAM_LINE + 64 * MB


async def test_bounded_lines_splits_any_chunking_and_stops_at_the_limit():
    rng = random.Random(0)
    text = b"".join(json.dumps({"n": i, "pad": "y" * rng.randrange(50)}).encode() + b"\n" * rng.randrange(1, 3)
                    for i in range(200))

    async def chunked(data: bytes) -> AsyncIterator[bytes]:
        i = 0
        while i < len(data):
            size = rng.randrange(1, 90)
            yield data[i:i + size]
            i += size

    for _ in range(20):
        lines = [line async for line in bounded_lines(chunked(text), 100)]
        assert lines == [piece for piece in text.split(b"\n") if piece]
    assert [line async for line in bounded_lines(chunked(b"a\nb"), 100)] == [b"a", b"b"]  # no final newline
    with pytest.raises(LineTooLongError):
        [line async for line in bounded_lines(chunked(b"ok\n" + b"z" * 101 + b"\n"), 100)]
    with pytest.raises(LineTooLongError):
        [line async for line in bounded_lines(chunked(b"z" * 500), 100)]  # never ends
