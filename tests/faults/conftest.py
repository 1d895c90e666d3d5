"""Fixtures for the fault tests: the tiny model, and the fork server that runs killable workers."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from faults.tiny import build_tiny_model

WORKER = Path(__file__).with_name("worker.py")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


class Zygote:
    """Drives `worker.py serve`: one command at a time, each run in a freshly forked child."""

    def __init__(self) -> None:
        env = {**os.environ, "ART_NB_CPU_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=env, bufsize=0,
        )
        self._buffer = b""
        self.stderr: list[str] = []
        # A pipe, not a file, for stderr: the disk-full run limits how large files may grow.
        threading.Thread(target=self._drain, daemon=True).start()
        assert self._line(timeout=120).get("ready"), "worker did not start"

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in iter(self.proc.stderr.readline, b""):
            self.stderr.append(line.decode(errors="replace"))
            del self.stderr[:-400]

    def _line(self, timeout: float) -> dict[str, Any]:
        """The next protocol line, or {} if none arrives within `timeout`."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return {}
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError("worker exited:\n" + self.log())
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def log(self, lines: int = 60) -> str:
        return "".join(self.stderr[-lines:])

    def start(self, **command: Any) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in command.items()}) + "\n").encode())
        return int(self._line(timeout=60)["pid"])

    def wait(self, pid: int, timeout: float = 240.0) -> int:
        done = self._line(timeout)
        if not done:
            os.kill(pid, signal.SIGKILL)  # our own child, by its id
            done = self._line(30)
            raise AssertionError(f"worker {pid} did not finish within {timeout} s:\n{self.log()}")
        assert done["pid"] == pid
        return int(done["returncode"])

    def signal_after(self, pid: int, seconds: float, signum: int = signal.SIGKILL) -> int | None:
        """Send `signum` to the child after `seconds` unless it ended first; its return code if it ended."""
        done = self._line(seconds)
        if done:
            return int(done["returncode"])
        os.kill(pid, signum)
        return None

    def run(self, timeout: float = 240.0, **command: Any) -> int:
        return self.wait(self.start(**command), timeout)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def zygote() -> Iterator[Zygote]:
    server = Zygote()
    yield server
    server.close()


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for_event(run_dir: Path, name: str, timeout: float = 120.0, **match: Any) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for record in read_events(run_dir):
            if record["event"] == name and all(record.get(k) == v for k, v in match.items()):
                return record
        time.sleep(0.02)
    raise AssertionError(f"no {name!r} event within {timeout} s; events: {read_events(run_dir)[-5:]}")


# ---- in-process helpers: the real LocalBackend on the tiny model, in the test's event loop ----------

PROMPT = [{"role": "user", "content": "Say something."}]


def tiny_trainable(name: str, model_path: Path, **config: Any) -> Any:
    import art_nb as art
    from faults.tiny import tiny_model_config

    return art.TrainableModel(name=name, project="faults", base_model=str(model_path), config=tiny_model_config(**config))


async def rollout(model: Any, seed: int, max_tokens: int = 6, turns: int = 1) -> Any:
    """A short conversation with the served model; the reward varies with what it said."""
    import art_nb as art
    from art_nb.trajectories import Choice, choice_to_message

    client = model.openai_client()
    items: list[Any] = list(PROMPT)
    for turn in range(turns):
        messages = [choice_to_message(m) if isinstance(m, Choice) else m for m in items]
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=max_tokens, logprobs=True,
            seed=seed * 10 + turn)
        items.append(completion.choices[0])
        if turn + 1 < turns:
            items.append({"role": "user", "content": "Go on."})
    text = "".join(c.message.content or "" for c in items if isinstance(c, Choice))
    return art.Trajectory(messages_and_choices=items, reward=len(set(text)) / 10)


async def gather_groups(model: Any, groups: int = 2, size: int = 3, seed: int = 0, **kwargs: Any) -> list[Any]:
    import art_nb as art

    return await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(model, seed + 100 * g + i, **kwargs) for i in range(size)) for g in range(groups)],
        pbar_desc=None)


def wait_for_commit(state: Any, timeout: float = 60) -> None:
    """Block until the backend has finished the newest checkpoint it writes in the background."""
    deadline = time.monotonic() + timeout
    while state.commit is not None and not state.commit.done():
        assert time.monotonic() < deadline, "the checkpoint commit did not finish"
        time.sleep(0.02)


def adapter_equals_checkpoint(state: Any, step: int) -> bool:
    """Whether the trainer's LoRA weights in memory are exactly checkpoint `step`'s."""
    import torch
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    wait_for_commit(state)
    saved = load_file(str(state.store.checkpoint_dir(step) / "adapter_model.safetensors"))
    live = get_peft_model_state_dict(state.trainer.model)
    return saved.keys() == live.keys() and all(torch.equal(saved[k], live[k].cpu()) for k in saved)
