"""Registering at once, twice, from two writers, and across projects: what the registry must hold.

Found by probing `art-nb serve`: four registers at once corrupted model loading for the
whole process ("Cannot copy out of meta tensor": shown on the real weights in
tests/integration/test_concurrent_register.py; the tiny model here loads too fast to race), a second writer on the same path trained from a
stale step and replaced checkpoints, and two projects' models of one name trained into one
directory. Real LocalBackend, real loads (the tiny Llama), real file locks.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

import art_nb as art
from art_nb.local import runtime as runtime_module
from art_nb.store import StoreLockedError
from faults.conftest import gather_groups, tiny_trainable

pytestmark = pytest.mark.slow


async def test_concurrent_registers_of_different_models_all_load(tiny_model_dir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads never overlap (they did, and corrupted each other), and every register succeeds."""
    inside, most = [0], [0]
    real_create = runtime_module._create_trainer

    def watched_create(*args, **kwargs):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        try:
            time.sleep(0.3)  # long enough for an unserialised second load to start meanwhile
            return real_create(*args, **kwargs)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(runtime_module, "_create_trainer", watched_create)
    backend = art.LocalBackend(path=tmp_path)
    models = [tiny_trainable(f"m{i}", tiny_model_dir) for i in range(4)]
    try:
        await asyncio.gather(*(m.register(backend) for m in models))
        assert most[0] == 1, f"{most[0]} model loads ran at once"
        for model in models:  # each serves, and a later register in this process still works
            reply = await model.openai_client().chat.completions.create(
                model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert reply.choices[0].message.content is not None
        late = tiny_trainable("late", tiny_model_dir)
        await late.register(backend)
        assert await late.get_step() == 0
    finally:
        await backend.close()


async def test_concurrent_registers_of_one_model_load_it_once(tiny_model_dir: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[str] = []
    real_load = runtime_module.Runtime._load

    async def counting_load(self, model, *args):
        loads.append(model.name)
        return await real_load(self, model, *args)

    monkeypatch.setattr(runtime_module.Runtime, "_load", counting_load)
    backend = art.LocalBackend(path=tmp_path)
    try:
        copies = [tiny_trainable("same", tiny_model_dir) for _ in range(4)]
        await asyncio.gather(*(m.register(backend) for m in copies))
        assert loads == ["same"]
        assert {backend._state(m).trainer for m in copies} == {backend._state(copies[0]).trainer}
    finally:
        await backend.close()


async def test_a_failed_load_does_not_poison_the_next(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = art.LocalBackend(path=tmp_path)
    try:
        broken = art.TrainableModel(name="broken", project="faults", base_model=str(tmp_path / "no-such-model"),
                                    config=tiny_trainable("x", tiny_model_dir).config)
        good = tiny_trainable("good", tiny_model_dir)
        outcomes = await asyncio.gather(broken.register(backend), good.register(backend), return_exceptions=True)
        assert isinstance(outcomes[0], Exception) and outcomes[1] is None
        again = tiny_trainable("broken", tiny_model_dir)  # the failed name is free again, and loads
        await again.register(backend)
        assert await again.get_step() == 0
    finally:
        await backend.close()


async def test_a_second_writer_on_the_same_path_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A second backend (as a second `art-nb serve` or notebook would) must not train from a stale step."""
    first = art.LocalBackend(path=tmp_path)
    second = art.LocalBackend(path=tmp_path, port=0, host="127.0.0.2")  # another runtime, same directory
    model = tiny_trainable("shared", tiny_model_dir)
    try:
        await model.register(first)
        await model.train(await gather_groups(model, seed=1))
        other = tiny_trainable("shared", tiny_model_dir)
        # two backends in one process: the message says it is this one, and what to close
        with pytest.raises(StoreLockedError, match=f"this process \\(pid {os.getpid()}: a backend here"):
            await other.register(second)
        await first.close()  # released: now the second may write, and resumes at the real latest step
        await other.register(second)
        assert await other.get_step() == 1
    finally:
        await first.close()
        await second.close()


async def test_projects_with_a_model_of_the_same_name_stay_apart(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = art.LocalBackend(path=tmp_path)
    alice = art.TrainableModel(name="agent", project="alice", base_model=str(tiny_model_dir),
                               config=tiny_trainable("x", tiny_model_dir).config)
    bob = art.TrainableModel(name="agent", project="bob", base_model=str(tiny_model_dir), config=alice.config)
    try:
        await alice.register(backend)
        await bob.register(backend)
        assert backend.model_dir(alice) != backend.model_dir(bob)
        assert alice.get_inference_name() == "agent@0" and bob.get_inference_name() == "bob/agent@0"
        await bob.train(await gather_groups(bob, seed=2))
        assert await bob.get_step() == 1 and await alice.get_step() == 0  # bob's step is not alice's
        await backend.wait_for_checkpoint(bob)
        assert (backend.model_dir(bob) / "checkpoints" / "0001").is_dir()
        assert not (backend.model_dir(alice) / "checkpoints" / "0001").exists()
        names = [m.id for m in (await bob.openai_client().models.list()).data]
        assert {"agent", "bob/agent", "bob/agent@1"} <= set(names)
        reply = await alice.openai_client().chat.completions.create(
            model="alice/agent", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.model in ("agent", "alice/agent", "agent@0")
    finally:
        await backend.close()
