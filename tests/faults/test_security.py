"""Loopback by default, a key for anything else, keys never shown, and checkpoints that cannot run code."""

from __future__ import annotations

import logging
import pathlib
import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch

import art_nb as art
from art_nb.local.runtime import _RUNTIMES
from art_nb.store import CheckpointError
from faults.conftest import gather_groups, tiny_trainable

pytestmark = pytest.mark.slow


class Payload:
    """Unpickling this creates `path`: a stand-in for code an attacker would run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


async def _step0_checkpoint(tiny_model_dir: Path, root: Path) -> Path:
    backend = art.LocalBackend(path=root)
    try:
        model = tiny_trainable("secure", tiny_model_dir)
        await model.register(backend)
        return backend.checkpoint_dir(model, 0)
    finally:
        await backend.close()


@pytest.mark.parametrize("planted", ["trainer_state.pt", "adapter_model.bin"])
async def test_a_checkpoint_carrying_a_pickle_payload_is_refused(planted: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    step0 = await _step0_checkpoint(tiny_model_dir, tmp_path / "source")
    checkpoints = tmp_path / "run" / "faults" / "models" / "secure" / "checkpoints"
    shutil.copytree(step0, checkpoints / "0000")
    shutil.copytree(step0, checkpoints / "0001")
    marker = tmp_path / "payload-ran"
    if planted == "trainer_state.pt":
        torch.save({"optimizer": None, "torch_rng": torch.get_rng_state(), "python_rng": Payload(marker)},
                   checkpoints / "0001" / planted)
    else:  # weights only as a pickle: the adapter must come from safetensors or not at all
        (checkpoints / "0001" / "adapter_model.safetensors").unlink()
        torch.save({"weights": Payload(marker)}, checkpoints / "0001" / planted)
    torch.load(checkpoints / "0001" / planted, weights_only=False)  # the payload is live...
    assert marker.exists()
    marker.unlink()

    backend = art.LocalBackend(path=tmp_path / "run")
    try:
        with pytest.raises(CheckpointError, match=r"0001/(trainer_state\.pt|adapter_model\.safetensors)"):
            await tiny_trainable("secure", tiny_model_dir).register(backend)
    finally:
        await backend.close()
    assert not marker.exists(), "loading a checkpoint ran code"  # ...and never ran


def test_binding_beyond_loopback_needs_a_key(tmp_path: Path) -> None:
    for host in ("0.0.0.0", "::", "192.168.1.10"):
        with pytest.raises(ValueError, match="needs an api_key"):
            art.LocalBackend(path=tmp_path, host=host)
        assert (tmp_path.resolve(), host, 0) not in _RUNTIMES


async def test_the_endpoint_is_loopback_needs_its_key_and_the_key_never_shows(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    key = "sk-local-7f3e9b1c5d2a"
    backend = art.LocalBackend(path=tmp_path, api_key=key)
    model = tiny_trainable("keyed", tiny_model_dir)
    try:
        with caplog.at_level(logging.DEBUG):
            await model.register(backend)
            endpoint = backend.inference_endpoint(model)
            assert endpoint.base_url.startswith("http://127.0.0.1:")
            body = {"model": "keyed", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with httpx.AsyncClient() as client:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                    response = await client.post(f"{endpoint.base_url}/chat/completions", json=body, headers=headers)
                    assert response.status_code == 401 and key not in response.text
            await model.train(await gather_groups(model))
            await backend.wait_for_checkpoint(model)  # every file is on disk before the files are searched
            with pytest.raises(openai.NotFoundError) as caught:
                await model.openai_client().chat.completions.create(model="nope", messages=body["messages"], max_tokens=2)
        out = capfd.readouterr()
        shown = [repr(backend), repr(model), str(model), model.model_dump_json(), repr(endpoint),
                 str(backend.choices(model)), caplog.text, str(caught.value), out.out, out.err]
        assert not [text for text in shown if key in text]
        for path in tmp_path.rglob("*"):
            assert not path.is_file() or key.encode() not in path.read_bytes(), f"the key was written to {path}"
    finally:
        await backend.close()
