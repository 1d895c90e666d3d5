"""SIGKILL a real training run at named points and at random moments; every restart must resume.

Each chain starts a fresh run directory and kills the worker (tests/faults/worker.py: the real
LocalBackend, HFEngine, PeftTrainer and checkpoint store on a tiny random Llama) once per kill
point, restarting it each time, then lets a last run finish. After every kill:

- every checkpoint directory on disk is complete and loads (safetensors parse, torch.load with
  weights_only, meta.json names its step); temporaries are gone after the next start;
- every log line on disk before the kill is still there, byte for byte (files only grow);
- the restart resumes at the newest complete checkpoint, with its optimizer state.

At the end of a chain, the adapter is bit-identical to that of a run that was never killed: the
optimizer state, the RNG state (LoRA dropout draws from it) and the dataset position all came back
exactly. And each step trained on the same scenarios as the uninterrupted run.

Bit-identical, not close, because both runs hand the same kernels the same inputs: every step on the
plan's thread count whichever worker thread runs it (a sum split over 2 threads rounds differently
from 1), and the served adapter in the same memory layout whether it was read from the checkpoint
(the resumed run) or handed over (the uninterrupted one). On a CPU where MKL's kernels depend on
either (AMD EPYC; Intel with MKL_ENABLE_INSTRUCTIONS=SSE4_2) a lapse showed as a 1e-5 difference.
"""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from faults.conftest import Zygote, read_events, wait_for_event
from faults.worker import GROUP_SIZE, GROUPS_PER_STEP, MODEL_NAME, STEPS

pytestmark = pytest.mark.slow

# Named kill points (worker.py says where each is). Within a chain, each run is killed at the next
# point; the count after ':' is which occurrence in that run. Together: 22 distinct points, plus
# random moments.
CHAINS: dict[str, list[str]] = {
    # logging the rollouts: around and inside the appends that happen before any weight changes
    "logging": ["resumed", "request:3", "rollout:2", "trajectories_torn", "trajectories_written",
                "history_torn", "history_written:2"],
    # the update and the checkpoint files being written
    "training": ["gathered", "backward", "before_optimizer_step", "optimizer_stepped", "trainer_state",
                 "trainer_state_torn", "adapter_torn"],
    # committing the checkpoint (in a fresh run the first one is step 0's), then serving it
    "commit": ["fsync:1", "fsync:3", "meta", "rename", "renamed", "checkpointed", "adapter_loaded:2", "trained"],
}
RANDOM_KILLS = 5
REQUIRED = {"adapter_model.safetensors", "adapter_config.json", "trainer_state.pt", "meta.json"}


def model_dir(run_dir: Path) -> Path:
    return run_dir / "art" / "faults" / "models" / MODEL_NAME


def complete_steps(run_dir: Path) -> list[int]:
    checkpoints = model_dir(run_dir) / "checkpoints"
    if not checkpoints.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())


def assert_checkpoints_load(run_dir: Path) -> None:
    """Every step directory is whole: each file parses, nothing in it is non-finite."""
    for step in complete_steps(run_dir):
        directory = model_dir(run_dir) / "checkpoints" / f"{step:04d}"
        missing = REQUIRED - {p.name for p in directory.iterdir()}
        assert not missing, f"checkpoint {step} is missing {missing}"
        tensors = load_file(str(directory / "adapter_model.safetensors"))
        assert tensors and all(torch.isfinite(t).all() for t in tensors.values()), f"checkpoint {step}: bad weights"
        json.loads((directory / "adapter_config.json").read_text())
        assert json.loads((directory / "meta.json").read_text())["step"] == step
        state = torch.load(directory / "trainer_state.pt", weights_only=True)
        assert state["torch_rng"] is not None
        if step > 0:
            assert state["optimizer"]["state"], f"checkpoint {step} has no optimizer moments"


def log_files(run_dir: Path) -> dict[Path, bytes]:
    root = model_dir(run_dir)
    files = [root / "history.jsonl", *sorted((root / "trajectories").rglob("*.jsonl"))]
    return {path: path.read_bytes() for path in files if path.exists()}


def trained_scenarios(run_dir: Path) -> dict[int, list[str]]:
    """Per step, the scenarios of the last attempt logged for it (a killed attempt logs them too)."""
    per_step = GROUPS_PER_STEP * GROUP_SIZE
    scenarios = {}
    for path in sorted((model_dir(run_dir) / "trajectories" / "train").glob("*.jsonl")):
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # the torn fragment a crash left
                continue
        scenarios[int(path.stem)] = sorted(r["metadata"]["scenario"] for r in records[-per_step:])
    return scenarios


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir(run_dir) / "checkpoints" / f"{STEPS:04d}" / "adapter_model.safetensors"))


class Chain:
    """One run directory, killed again and again; checks the disk after every kill."""

    def __init__(self, zygote: Zygote, run_dir: Path, model: Path, scenario: str = "train") -> None:
        self.zygote, self.run_dir, self.model, self.scenario = zygote, run_dir, model, scenario
        self.kills: list[str] = []

    def _before(self) -> tuple[int, dict[Path, bytes], int]:
        steps = complete_steps(self.run_dir)
        return (steps[-1] if steps else 0), log_files(self.run_dir), len(read_events(self.run_dir))

    def _after(self, resume_at: int, logs: dict[Path, bytes], seen: int, what: str) -> None:
        events = read_events(self.run_dir)[seen:]
        resumed = [e for e in events if e["event"] == "resumed"]
        if resumed:
            assert resumed[0]["step"] == resume_at, f"{what}: resumed at {resumed[0]['step']}, newest checkpoint {resume_at}"
            if resume_at > 0:
                assert resumed[0]["optimizer_tensors"] > 0, f"{what}: resumed without optimizer state"
        assert_checkpoints_load(self.run_dir)
        now = log_files(self.run_dir)
        for path, before in logs.items():
            assert now.get(path, b"").startswith(before), f"{what}: {path.name} lost lines written before the kill"

    def kill_at(self, point: str) -> None:
        resume_at, logs, seen = self._before()
        code = self.zygote.run(scenario=self.scenario, run_dir=self.run_dir, model_dir=self.model, kill=point)
        # The kill may come from the thread finishing a checkpoint in the background while the
        # main thread logs one more event: the last "kill" event, not the last event, names it.
        last = next(e for e in reversed(read_events(self.run_dir)[seen:]) if e["event"] in ("kill", "finished"))
        assert code == -signal.SIGKILL, f"kill point {point} was not reached (exit {code}):\n{self.zygote.log()}"
        name, _, n = point.partition(":")
        assert last["event"] == "kill" and last["point"] == name and last["n"] == int(n or 1), last
        self._after(resume_at, logs, seen, f"kill at {point}")
        self.kills.append(point)

    def kill_after(self, seconds: float) -> None:
        """SIGKILL `seconds` after the run has resumed (the restart itself takes a varying time)."""
        resume_at, logs, seen = self._before()
        pid = self.zygote.start(scenario=self.scenario, run_dir=self.run_dir, model_dir=self.model)
        wait_for_event(self.run_dir, "resumed", pid=pid)
        code = self.zygote.signal_after(pid, seconds)
        if code is None:
            code = self.zygote.wait(pid)
            assert code == -signal.SIGKILL, f"exit {code}:\n{self.zygote.log()}"
            self.kills.append(f"after {seconds:.2f} s")
        self._after(resume_at, logs, seen, f"kill after {seconds:.2f} s")

    def finish(self) -> None:
        resume_at, logs, seen = self._before()
        code = self.zygote.run(scenario=self.scenario, run_dir=self.run_dir, model_dir=self.model)
        assert code == 0, self.zygote.log()
        self._after(resume_at, logs, seen, "final run")
        assert complete_steps(self.run_dir)[-1] == STEPS
        leftovers = [p.name for p in (model_dir(self.run_dir) / "checkpoints").iterdir() if p.name.startswith(".tmp")]
        assert not leftovers, f"temporaries left behind: {leftovers}"


@pytest.fixture(scope="module")
def reference(zygote: Zygote, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run that is never killed."""
    run_dir = tmp_path_factory.mktemp("reference")
    assert zygote.run(scenario="train", run_dir=run_dir, model_dir=tiny_model_dir) == 0, zygote.log()
    assert complete_steps(run_dir) == list(range(STEPS + 1))
    return run_dir


def assert_same_as_reference(run_dir: Path, reference: Path) -> None:
    assert trained_scenarios(run_dir) == trained_scenarios(reference), "a step trained on other scenarios"
    ours, theirs = adapter(run_dir), adapter(reference)
    assert ours.keys() == theirs.keys()
    diff = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
    assert diff == 0.0, f"the killed run's final adapter differs from the uninterrupted one's by {diff}"


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_killed_at_named_points_resumes_exactly(chain: str, zygote: Zygote, tiny_model_dir: Path, reference: Path,
                                                tmp_path: Path) -> None:
    run = Chain(zygote, tmp_path / chain, tiny_model_dir)
    for point in CHAINS[chain]:
        run.kill_at(point)
    run.finish()
    assert_same_as_reference(run.run_dir, reference)


def test_killed_at_random_moments_resumes_exactly(zygote: Zygote, tiny_model_dir: Path, reference: Path,
                                                  tmp_path: Path) -> None:
    # Kill somewhere inside the first step after each restart: gathering, training or saving.
    times = [e["time"] for e in read_events(reference) if e["event"] in ("resumed", "trained")]
    step_time = sorted(b - a for a, b in zip(times, times[1:]))[len(times) // 2 - 1]
    rng = random.Random(20240601)
    run = Chain(zygote, tmp_path / "random", tiny_model_dir)
    for _ in range(RANDOM_KILLS):
        run.kill_after(rng.uniform(0.0, 0.8 * step_time))
    # A faster machine than during the reference run may let one run finish before its kill.
    assert len(run.kills) >= RANDOM_KILLS - 1, f"runs ended before their kill: {run.kills}"
    run.finish()
    assert_same_as_reference(run.run_dir, reference)


def test_chains_cover_at_least_twenty_distinct_kill_points() -> None:
    points = {point for chain in CHAINS.values() for point in chain}
    assert len(points) + RANDOM_KILLS >= 20 and len(points) >= 20
