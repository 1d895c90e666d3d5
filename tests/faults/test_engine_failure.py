"""An engine that dies or stops answering: requests fail fast with a 503 that says why; re-register recovers.

Faults injected into the real HFEngine behind the real endpoint: its scheduler crashes (dies), or a
forward pass never returns (a hung device, a deadlock: stops answering). The OpenAI client is the
user's, with its default 600 s timeout: the bound must come from the engine, not the client.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import openai
import pytest

import art_nb as art
from art_nb.local.engines.base import EngineDeadError
from faults.conftest import gather_groups, rollout, tiny_trainable

pytestmark = pytest.mark.slow


@pytest.fixture
async def served(tiny_model_dir: Path, tmp_path: Path):
    backend = art.LocalBackend(path=tmp_path)
    model = tiny_trainable("engine-faults", tiny_model_dir)
    await model.register(backend)
    await model.train(await gather_groups(model))  # step 1: the restarted engine must serve it
    yield backend, model, backend._state(model)
    await backend.close()


async def expect_503(model: art.TrainableModel, *needles: str, within: float) -> None:
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as caught:
        await rollout(model, 1)
    assert time.monotonic() - started < within
    assert caught.value.status_code == 503
    assert caught.value.response.headers.get("x-should-retry") == "false"  # the client does not retry a dead engine
    for needle in needles:
        assert needle in str(caught.value), str(caught.value)


async def test_a_dead_engine_fails_requests_at_once_and_reregistering_recovers(served) -> None:
    backend, model, state = served
    dead = state.engine

    def crash() -> list:
        raise RuntimeError("simulated device failure")

    dead._admissible = crash  # the scheduler dies on its next round
    await expect_503(model, "scheduler crashed", "simulated device failure", "re-register", within=10)
    await expect_503(model, "re-register", within=2)  # and keeps failing fast, never hanging
    assert dead.dead_reason is not None

    # The replacement plans from the memory snapshot its predecessor was planned from at register (a vLLM
    # engine's: read afterwards, the resident trainer would be counted twice). Here: the wiring, with a marker.
    from art_nb.local import runtime as runtime_module
    from art_nb.local.engines.vllm import args as vllm_plan

    key = next(k for k, e in backend._runtime.engines.items() if e is dead)
    marker = (1, 2, 3, "register-time snapshot")
    backend._runtime.snapshots[key] = marker
    seen = []
    create = runtime_module._create_engine

    async def recording(*args):
        seen.append(vllm_plan._SNAPSHOT.get())
        return await create(*args)

    runtime_module._create_engine = recording
    try:
        await model.register(backend)  # what a re-run of the register cell does
    finally:
        runtime_module._create_engine = create
    assert seen == [marker]
    assert state.engine is not dead and state.engine.dead_reason is None
    assert "engine_restart" in backend.choices(model)
    trajectory = await rollout(model, 2)
    assert trajectory.choices()[0].model_extra["token_ids"]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert completion.model == f"{model.name}@1"  # the trained adapter is served again
    assert (await model.train(await gather_groups(model, seed=5))).step == 2


async def test_a_hung_engine_fails_requests_within_the_stall_timeout(served) -> None:
    backend, model, state = served
    groups = await gather_groups(model, seed=7)  # gathered while the engine still answers
    hung = state.engine
    hung.stall_timeout = 1.5
    release = threading.Event()

    def never_returns(admit: list) -> list:
        release.wait(120)
        return []

    hung._advance = never_returns
    try:
        started = time.monotonic()
        results = await asyncio.gather(*(rollout(model, i) for i in range(4)), return_exceptions=True)
        elapsed = time.monotonic() - started
        assert elapsed < 15, f"requests to a hung engine took {elapsed:.1f} s to fail"
        for result in results:
            assert isinstance(result, openai.InternalServerError) and result.status_code == 503, result
            assert "stopped answering" in str(result) and "more than 1.5 s" in str(result)

        # Training while the engine is dead: the step is saved, then the swap reports the dead engine.
        with pytest.raises(EngineDeadError, match="stopped answering"):
            await model.train(groups)
        assert state.step == 2 and await backend.wait_for_checkpoint(model) == 2 and state.store.latest_step() == 2

        await model.register(backend)
        assert state.engine is not hung
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert completion.model == f"{model.name}@2"
    finally:
        release.set()  # let the stuck thread go



async def test_vllm_failing_on_a_t4_falls_back_to_the_transformers_engine_at_register(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """The T4 set brings vLLM 0.11.2, never run by art_nb on a Turing GPU: if it fails to start there, register
    goes on with the transformers engine and says why (here: a plan as on a T4, on this CPU; vLLM's start fails)."""
    from dataclasses import replace

    from art_nb.local import runtime as runtime_module
    from art_nb.local.plan import choices as plan_module

    plan_for = plan_module.plan_for
    monkeypatch.setattr(plan_module, "plan_for", lambda config: replace(
        plan_for(config), engine="vllm", capability=(7, 5), reasons={**plan_for(config).reasons, "engine": "vLLM 0.11.2"}))
    create, tried = runtime_module._create_engine, []

    async def vllm_fails(plan, path, config):
        tried.append(plan.engine)
        if plan.engine == "vllm":
            raise RuntimeError("simulated: no attention backend for sm75")
        return await create(plan, path, config)

    monkeypatch.setattr(runtime_module, "_create_engine", vllm_fails)
    monkeypatch.setattr("art_nb.local.engines.vllm.startup.import_vllm", lambda: None)  # not installed here: fail at the start
    backend = art.LocalBackend(path=tmp_path)
    model = tiny_trainable("t4-fallback", tiny_model_dir, engine="auto")
    try:
        await model.register(backend)
        assert tried == ["vllm", "hf"]
        why = backend.choices(model)["engine"]
        assert why.startswith("transformers: vLLM failed to start on this sm75 GPU") and "no attention backend" in why
        assert backend._state(model).plan.engine == "hf"
        assert (await model.train(await gather_groups(model))).step == 1  # serves and trains as the T4 configuration
        assert (await rollout(model, 3)).choices()[0].model_extra["token_ids"]
    finally:
        await backend.close()
