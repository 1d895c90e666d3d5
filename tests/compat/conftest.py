"""Running a copied ART example: its folder on sys.path (its files import each other by bare name,
`from rollout import rollout`), in a fresh working directory (examples write `./.art`), its modules
forgotten afterwards (two examples both have a `rollout.py`), and its backend closed (each example
loads the model once; closing frees the memory for the next)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

import art_nb as art
from art_nb.local.release import release_freed_memory

HERE = Path(__file__).parent


@pytest.fixture
async def example(tmp_path, monkeypatch) -> AsyncIterator[Callable[[str, str], ModuleType]]:
    """`example(folder, module)` imports tests/compat/{folder}/{module}.py as the example's script."""
    monkeypatch.chdir(tmp_path)
    loaded: list[str] = []

    def load(folder: str, module: str) -> ModuleType:
        directory = HERE / folder
        names = [p.stem for p in directory.glob("*.py")]
        for name in names:
            sys.modules.pop(name, None)
        monkeypatch.syspath_prepend(str(directory))
        loaded.extend(names)
        return importlib.import_module(module)

    yield load
    for name in loaded:
        sys.modules.pop(name, None)
    for path in {tmp_path / ".art", tmp_path}:
        await art.LocalBackend(path=path).close()
    release_freed_memory()  # what the example's own objects held is freed only now, after the close


@pytest.fixture
def s3_bucket(monkeypatch) -> Iterator[str]:
    """A local S3-compatible server (moto) that BACKUP_BUCKET and the AWS_* variables point at."""
    pytest.importorskip("s3fs", reason="the s3 extra (pip install art-nb[s3]) is not installed")
    moto_server = pytest.importorskip("moto.server", reason="moto[server] (in the dev extra) is not installed")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for name, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
                        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                        "BACKUP_BUCKET": "art-backups"}.items():
        monkeypatch.setenv(name, value)
    yield "art-backups"
    server.stop()
