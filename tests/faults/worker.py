"""The process the fault tests kill and interrupt: real training runs on the tiny model.

    python tests/faults/worker.py run SCENARIO RUN_DIR MODEL_DIR [KILL_POINT[:N]]   # one run
    python tests/faults/worker.py serve                                              # fork server

`serve` imports torch, transformers, peft and art_nb once, then forks one child per JSON command
read from stdin ({"scenario": "train", "run_dir": ..., "model_dir": ..., "kill": "rename:1"}),
answering {"pid": ...} when the child starts and {"pid": ..., "returncode": ...} when it ends. Each
child is a real process with its own pid, files and fate (SIGKILL ends it like any other); forking
only skips the seconds of imports per restart, which is what lets the tests kill and restart a
training run dozens of times in CI.

Kill points: `hit(name)` marks a place where something just happened (or is about to); the armed
point (`kill`, "name" or "name:N") SIGKILLs the process the N-th time it is reached. Points are put
in place by wrapping library and art_nb functions inside this process only: art_nb has no test
hooks. `hold` ("name:N:seconds") instead sleeps there, so a test can send a signal mid-step.

Everything the tests check is on disk: the run's files, and RUN_DIR/events.jsonl (fsynced).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for faults.tiny

SCENARIOS = [f"scenario-{i}" for i in range(8)]
GROUPS_PER_STEP = 2
GROUP_SIZE = 2
STEPS = len(SCENARIOS) // GROUPS_PER_STEP
LEARNING_RATE = 2e-2
MODEL_NAME = "killme"

_run_dir: Path | None = None
_kill: tuple[str, int] | None = None
_hold: tuple[str, int, float] | None = None
_counts: Counter[str] = Counter()


# ---- events and kill points -------------------------------------------------------------------


def event(name: str, **fields: Any) -> None:
    """Append one fsynced line to RUN_DIR/events.jsonl: it survives the SIGKILL that may follow."""
    assert _run_dir is not None
    with open(_run_dir / "events.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"event": name, "pid": os.getpid(), "time": time.time(), **fields}) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def armed(name: str) -> bool:
    """Whether the next `hit(name)` kills."""
    return _kill is not None and _kill == (name, _counts[name] + 1)


def hit(name: str) -> None:
    _counts[name] += 1
    if _kill is not None and _kill == (name, _counts[name]):
        event("kill", point=name, n=_counts[name])
        os.kill(os.getpid(), signal.SIGKILL)
    if _hold is not None and _hold[:2] == (name, _counts[name]):
        event("holding", point=name, n=_counts[name])
        time.sleep(_hold[2])


def install_kill_points() -> None:
    """Wrap the functions a training step goes through so each can be a kill point."""
    import pathlib

    import safetensors.torch
    import torch

    from art_nb.local.engines.hf.engine import HFEngine
    from art_nb.local.trainers.peft_trainer import PeftTrainer
    from art_nb.store import ModelStore

    def torn_append(path: Path, records: list[dict[str, Any]], name: str) -> None:
        """What a crash mid-append leaves (power loss, full disk): half the text, no newline."""
        text = "".join(json.dumps(r, default=str) + "\n" for r in records)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as handle:
            handle.write(text[: max(1, len(text) // 2)].encode())
            handle.flush()
            os.fsync(handle.fileno())
        hit(name)

    append_trajectories = ModelStore.append_trajectories

    def wrapped_append_trajectories(self: ModelStore, split: str, step: int, records: Any) -> Path:
        records = list(records)
        if armed("trajectories_torn"):
            torn_append(self.dir / "trajectories" / split / f"{step:04d}.jsonl", records, "trajectories_torn")
        path = append_trajectories(self, split, step, records)
        hit("trajectories_written")
        return path

    append_history = ModelStore.append_history

    def wrapped_append_history(self: ModelStore, record: dict[str, Any]) -> None:
        if armed("history_torn"):
            torn_append(self.dir / "history.jsonl", [record], "history_torn")
        append_history(self, record)
        hit("history_written")

    write_checkpoint = ModelStore.write_checkpoint
    in_checkpoint = [False]

    def wrapped_write_checkpoint(self: ModelStore, *args: Any, **kwargs: Any) -> Path:
        in_checkpoint[0] = True
        try:
            path = write_checkpoint(self, *args, **kwargs)
        finally:
            in_checkpoint[0] = False
        hit("checkpointed")
        return path

    fsync = os.fsync

    def wrapped_fsync(fd: int) -> None:
        fsync(fd)
        if in_checkpoint[0]:
            hit("fsync")

    rename = pathlib.Path.rename

    def wrapped_rename(self: Path, target: Any) -> Path:
        committing = self.name.startswith(".tmp-") and Path(target).name.isdigit()
        if committing:
            hit("rename")
        result = rename(self, target)
        if committing:
            hit("renamed")
        return result

    write_text = pathlib.Path.write_text

    def wrapped_write_text(self: Path, *args: Any, **kwargs: Any) -> int:
        if self.name == "meta.json":
            hit("meta")
        return write_text(self, *args, **kwargs)

    save_file = safetensors.torch.save_file  # the adapter's writer (store.write_adapter reads it at each call)

    def wrapped_save_file(tensors: dict[str, Any], filename: str, metadata: Any = None) -> None:
        hit("adapter")
        if armed("adapter_torn"):
            data = safetensors.torch.save(tensors, metadata=metadata)
            with open(filename, "wb") as handle:
                handle.write(data[: len(data) // 2])
                handle.flush()
                fsync(handle.fileno())
            hit("adapter_torn")
        save_file(tensors, filename, metadata=metadata)

    save = torch.save

    def wrapped_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        hit("trainer_state")
        if armed("trainer_state_torn"):
            buffer = io.BytesIO()
            save(obj, buffer, *args, **kwargs)
            with open(f, "wb") as handle:
                handle.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                handle.flush()
                fsync(handle.fileno())
            hit("trainer_state_torn")
        save(obj, f, *args, **kwargs)

    backward = torch.Tensor.backward

    def wrapped_backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        backward(self, *args, **kwargs)
        hit("backward")

    clip = torch.nn.utils.clip_grad_norm_

    def wrapped_clip(*args: Any, **kwargs: Any) -> torch.Tensor:
        norm = clip(*args, **kwargs)
        hit("before_optimizer_step")
        return norm

    adamw_step = torch.optim.AdamW.step

    def wrapped_adamw_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = adamw_step(self, *args, **kwargs)
        hit("optimizer_stepped")
        return result

    adapter_weights = PeftTrainer.adapter_weights

    def wrapped_adapter_weights(self: PeftTrainer) -> Any:
        hit("handover")  # the step's CPU copy of the update, on its path (the files come later)
        return adapter_weights(self)

    load_adapter = HFEngine.load_adapter

    async def wrapped_load_adapter(self: HFEngine, name: str, path: Path, weights: Any = None) -> None:
        await load_adapter(self, name, path, weights)
        hit("adapter_loaded")

    PeftTrainer.adapter_weights = wrapped_adapter_weights  # type: ignore[method-assign]
    ModelStore.append_trajectories = wrapped_append_trajectories  # type: ignore[method-assign]
    ModelStore.append_history = wrapped_append_history  # type: ignore[method-assign]
    ModelStore.write_checkpoint = wrapped_write_checkpoint  # type: ignore[method-assign]
    os.fsync = wrapped_fsync
    pathlib.Path.rename = wrapped_rename  # type: ignore[method-assign]
    pathlib.Path.write_text = wrapped_write_text  # type: ignore[method-assign]
    safetensors.torch.save_file = wrapped_save_file
    torch.save = wrapped_save
    torch.Tensor.backward = wrapped_backward  # type: ignore[method-assign]
    torch.nn.utils.clip_grad_norm_ = wrapped_clip
    torch.optim.AdamW.step = wrapped_adamw_step  # type: ignore[method-assign]
    HFEngine.load_adapter = wrapped_load_adapter  # type: ignore[method-assign]


# ---- the training run -------------------------------------------------------------------------


def make_model(model_dir: Path) -> Any:
    import art_nb as art
    from faults.tiny import tiny_model_config

    # LoRA dropout draws from torch's RNG during training: a resumed run only matches an
    # uninterrupted one if the RNG state came back with the checkpoint.
    config = tiny_model_config(lora=art.LoraConfig(rank=4, alpha=8, dropout=0.1))
    return art.TrainableModel(name=MODEL_NAME, project="faults", base_model=str(model_dir), config=config)


def rollout_fn() -> Any:
    import art_nb as art
    from art_nb.trajectories import Choice, choice_to_message

    # One request at a time: a sampled token then never depends on its batch neighbours, so a
    # resumed run replays exactly what an uninterrupted one sampled.
    @art.limit_concurrency(1)
    async def rollout(model: Any, scenario: str, step: int, index: int, turns: int = 2, pause: float = 0.0,
                      max_tokens: int = 5) -> art.Trajectory:
        client = model.openai_client()
        items: list[Any] = [{"role": "user", "content": f"Play {scenario}."}]
        texts = []
        for turn in range(turns):
            messages = [choice_to_message(m) if isinstance(m, Choice) else m for m in items]
            completion = await client.chat.completions.create(
                model=model.get_inference_name(), messages=messages, max_tokens=max_tokens, temperature=1.0,
                logprobs=True, seed=step * 1000 + SCENARIOS.index(scenario) * 10 + index * 2 + turn,
            )
            choice = completion.choices[0]
            items.append(choice)
            texts.append(choice.message.content or "")
            hit("request")
            if turn + 1 < turns:
                items.append({"role": "user", "content": "Again."})
                if pause:
                    await asyncio.sleep(pause)
        hit("rollout")
        return art.Trajectory(messages_and_choices=items, reward=len(set("".join(texts))) / 10,
                              metadata={"scenario": scenario, "step": step})

    return rollout


def rng_digest() -> str:
    import random

    import torch

    return hashlib.sha256(torch.get_rng_state().numpy().tobytes() + repr(random.getstate()).encode()).hexdigest()[:16]


async def train_run(run_dir: Path, model_dir: Path) -> None:
    """Train from wherever the run stands to STEPS, resuming like a notebook re-run would."""
    import art_nb as art

    rollout = rollout_fn()
    backend = art.LocalBackend(path=run_dir / "art")
    model = make_model(model_dir)
    await model.register(backend)
    start = await model.get_step()
    pending = backend._state(model).trainer._pending_optimizer_state
    event("resumed", step=start, optimizer_tensors=0 if pending is None else len(pending["state"]))
    hit("resumed")
    batches = art.iterate_dataset(SCENARIOS, groups_per_step=GROUPS_PER_STEP, initial_step=start, seed=7,
                                  use_tqdm=False)
    for batch in batches:
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, s, batch.step, i) for i in range(GROUP_SIZE)) for s in batch.items],
            pbar_desc=None,
        )
        hit("gathered")
        result = await model.train(groups, config=art.TrainConfig(learning_rate=LEARNING_RATE))
        event("trained", step=result.step, scenarios=batch.items)
        hit("trained")
    event("finished", step=await model.get_step())


async def pipeline_run(run_dir: Path, model_dir: Path) -> None:
    """`train_run` pipelined (art.pipeline, forced on): each step's games are played while the step
    before trains, from the adapter before it; resumed, it carries on as the loop of a notebook would."""
    import art_nb as art

    rollout = rollout_fn()
    backend = art.LocalBackend(path=run_dir / "art")
    model = make_model(model_dir)
    await model.register(backend)
    start = await model.get_step()
    pending = backend._state(model).trainer._pending_optimizer_state
    event("resumed", step=start, optimizer_tensors=0 if pending is None else len(pending["state"]))
    hit("resumed")
    batches = iter(art.iterate_dataset(SCENARIOS, groups_per_step=GROUPS_PER_STEP, initial_step=start, seed=7,
                                       use_tqdm=False))

    async def gather(step: int) -> list[Any]:
        batch = next(batches)
        assert batch.step == step, (batch.step, step)
        event("gather_started", step=step)
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, s, step, i) for i in range(GROUP_SIZE)) for s in batch.items],
            pbar_desc=None,
        )
        event("gathered", step=step, scenarios=batch.items)
        hit("gathered")
        return groups

    async for groups in art.pipeline(model, gather, STEPS, enabled=True):
        result = await model.train(groups, config=art.TrainConfig(learning_rate=LEARNING_RATE))
        event("trained", step=result.step, lag=result.metrics.get("pipeline/lag_steps"),
              beside=result.metrics.get("pipeline/beside", 0.0))
        hit("trained")
    event("finished", step=await model.get_step())


# ---- disk full: a real write error from the kernel ----------------------------------------------


async def disk_full_run(run_dir: Path, model_dir: Path) -> None:
    """Step 2's checkpoint cannot be written: files may not grow past 2 KB while it is saved.

    RLIMIT_FSIZE makes the kernel refuse the write (EFBIG, with SIGXFSZ ignored), the same way a
    full disk refuses it (ENOSPC): a real failure inside safetensors' and torch's own writers.
    """
    import resource

    import art_nb as art
    from art_nb.store import CheckpointError, ModelStore

    rollout = rollout_fn()
    backend = art.LocalBackend(path=run_dir / "art")
    model = make_model(model_dir)
    await model.register(backend)

    async def gather(step: int) -> list[Any]:
        return await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, s, step, i) for i in range(GROUP_SIZE)) for s in SCENARIOS[:2]],
            pbar_desc=None)

    config = art.TrainConfig(learning_rate=LEARNING_RATE)
    await model.train(await gather(0), config=config)
    write = ModelStore.write_checkpoint
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    step_done = threading.Event()

    def full_disk_write(self: ModelStore, *args: Any, **kwargs: Any) -> Path:
        # The limit is the whole process's: set it only once the step has returned (its history line
        # written), while the background write is the only writer.
        assert step_done.wait(60), "the step never returned"
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, limits[1]))
        try:
            return write(self, *args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    ModelStore.write_checkpoint = full_disk_write  # type: ignore[method-assign]
    error = ""
    try:
        try:
            await model.train(await gather(1), config=config)
        finally:
            step_done.set()
        await backend.wait_for_checkpoint(model)
    except CheckpointError as exc:
        error = str(exc)
    ModelStore.write_checkpoint = write  # type: ignore[method-assign]
    state = backend._state(model)
    event("disk_full", error=error, step=await model.get_step(), trainer_matches_checkpoint=trainer_matches(state))
    result = await model.train(await gather(1), config=config)  # space is back: the next step works
    event("after_disk_full", step=result.step, tokens_trained=result.metrics.get("tokens_trained", 0.0))


def trainer_matches(state: Any, step: int | None = None) -> bool:
    """Whether the trainer's adapter weights in memory are exactly those of checkpoint `step` (default: served)."""
    import torch
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(state.store.checkpoint_dir(state.step if step is None else step) / "adapter_model.safetensors"))
    live = get_peft_model_state_dict(state.trainer.model)
    return saved.keys() == live.keys() and all(torch.equal(saved[k], live[k].cpu()) for k in saved)


# ---- Ctrl-C: real SIGINTs into asyncio.run, one "cell" after another ------------------------------


def sigint_run(run_dir: Path, model_dir: Path) -> None:
    """Cells run with asyncio.run, as a script or a notebook runs them; the test sends SIGINT mid-cell.

    The hold point (`hold`) pauses a chosen place long enough for the test's SIGINT to land there.
    """
    import art_nb as art

    # Ctrl-C live, as in a terminal or a kernel. A test run started in the background by a
    # non-interactive shell inherits SIGINT ignored (POSIX), and then asyncio.run installs no
    # handler and the SIGINTs below would be dropped: seen as "gather_interrupted finished".
    signal.signal(signal.SIGINT, signal.default_int_handler)

    rollout = rollout_fn()
    backend = art.LocalBackend(path=run_dir / "art")
    model = make_model(model_dir)
    asyncio.run(model.register(backend))
    state = backend._state(model)

    def cell(name: str, coro_fn: Any) -> None:
        """Run one cell; record how it ended and what the backend looks like afterwards."""
        outcome, detail = "finished", ""
        try:
            detail = repr(asyncio.run(coro_fn()))[:200]
        except KeyboardInterrupt:
            outcome = "KeyboardInterrupt"
        except BaseException as exc:  # noqa: BLE001 - recorded for the test to judge
            outcome, detail = type(exc).__name__, str(exc)[:500]
        backend.checkpoint_dir(model)  # waits for the checkpoint the backend finishes in the background
        event("cell", cell=name, outcome=outcome, detail=detail, step=state.step, steps_on_disk=state.store.steps(),
              trainer_matches_checkpoint=trainer_matches(state), gate_paused=backend._runtime.gate.paused)

    async def gather(step: int, **kwargs: Any) -> list[Any]:
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, s, step, i, **kwargs) for i in range(GROUP_SIZE)) for s in SCENARIOS[:2]],
            pbar_desc=None, max_exceptions=1000)  # a generous budget: an interrupt counted as a failure would be swallowed
        return [len(g.exceptions) for g in groups]

    async def train(step: int) -> int:
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, s, step, i) for i in range(GROUP_SIZE)) for s in SCENARIOS[:2]],
            pbar_desc=None)
        event("training", step=step)
        return (await model.train(groups, config=art.TrainConfig(learning_rate=LEARNING_RATE))).step

    async def slow_gather() -> list[int]:
        event("gathering")
        return await gather(0, turns=4, pause=0.5)

    cell("gather_interrupted", slow_gather)
    cell("gather_after", lambda: gather(0))
    global _hold
    _hold = ("backward", 1, 3.0)  # inside the step, before the optimizer: interrupt abandons it
    _counts.clear()
    cell("train_interrupted_before_optimizer", lambda: train(0))
    _hold = ("handover", 1, 3.0)  # handing the update over, after the optimizer stepped: the step completes
    _counts.clear()
    cell("train_interrupted_while_saving", lambda: train(0))
    _hold = None
    cell("train_after", lambda: train(1))
    cell("gather_after_train", lambda: gather(2))


# ---- process plumbing ---------------------------------------------------------------------------


def run(command: dict[str, Any]) -> None:
    global _run_dir, _kill, _hold
    _run_dir = Path(command["run_dir"])
    _run_dir.mkdir(parents=True, exist_ok=True)
    _counts.clear()
    if command.get("kill"):
        name, _, n = command["kill"].partition(":")
        _kill = (name, int(n or 1))
    if command.get("hold"):
        name, n, seconds = command["hold"].split(":")
        _hold = (name, int(n), float(seconds))
    install_kill_points()
    model_dir = Path(command["model_dir"])
    scenario = command.get("scenario", "train")
    event("started", scenario=scenario, kill=command.get("kill"))
    if scenario == "train":
        asyncio.run(train_run(_run_dir, model_dir))
    elif scenario == "pipeline":
        asyncio.run(pipeline_run(_run_dir, model_dir))
    elif scenario == "disk_full":
        asyncio.run(disk_full_run(_run_dir, model_dir))
    elif scenario == "sigint":
        sigint_run(_run_dir, model_dir)
    else:
        raise ValueError(f"unknown scenario {scenario!r}")


def preload() -> None:
    """Import everything a run needs, so forked children start warm. No torch op runs here: a
    process that has started torch's thread pools is not safe to fork."""
    import httpx  # noqa: F401
    import openai  # noqa: F401
    import peft  # noqa: F401
    import peft.tuners.lora  # noqa: F401
    import safetensors.torch  # noqa: F401
    import tqdm.auto  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import uvicorn  # noqa: F401

    import art_nb.grpo  # noqa: F401
    import art_nb.local  # noqa: F401
    import art_nb.local.engines.hf.engine  # noqa: F401
    import art_nb.local.server  # noqa: F401
    import art_nb.local.trainers.peft_trainer  # noqa: F401
    import faults.tiny  # noqa: F401


def child(command: dict[str, Any]) -> None:
    """In a fresh fork: run the command and exit without running the parent's cleanup."""
    os.dup2(2, 1)  # stdout is the parent's protocol channel
    code = 1
    try:
        run(command)
        code = 0
    except BaseException:  # noqa: BLE001 - reported through the exit code and stderr
        traceback.print_exc()
    finally:
        from art_nb.local.runtime import finish_checkpoints

        finish_checkpoints()  # what interpreter exit would run (os._exit skips it)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    preload()
    print(json.dumps({"ready": True}), flush=True)
    while line := sys.stdin.readline():
        command = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(command)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve()
    elif sys.argv[1:2] == ["run"] and len(sys.argv) >= 5:
        run({"scenario": sys.argv[2], "run_dir": sys.argv[3], "model_dir": sys.argv[4],
             "kill": sys.argv[5] if len(sys.argv) > 5 else None})
        from art_nb.local.runtime import finish_checkpoints

        finish_checkpoints()  # what interpreter exit would run
        os._exit(0)  # the backend's threads are daemons; do not wait for them
    else:
        sys.exit(__doc__)
