"""Every notebook, executed top to bottom on a real kernel (nbclient), on CPU with the offline tiny model
and small parameters. Asserts on what each run produced: the checkpoint of the last step, an exported
adapter that peft loads (and that holds the trained weights), a summary with the reward of every step,
and the dashboard's static fallback (text + PNG) in the saved notebook.

The notebooks run side by side, one kernel process each (the CPU engine and trainer use one thread
per process on a 2-core machine, so two kernels keep both cores busy); ART_NB_NOTEBOOK_JOBS sets how
many at once. The executed notebooks are kept under the test's tmp directory (`*.executed.ipynb`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
from nbrun import find_cell, output_text, outputs

pytestmark = pytest.mark.slow

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"
STEPS = 2
# One group of four a step: what is asserted needs two steps, not more rollouts; four rollouts keep the
# group's rewards apart (tic-tac-toe and 2048 had no zero-variance group in these runs), so it trains.
SMALL = {"STEPS": STEPS, "GROUPS_PER_STEP": 1, "ROLLOUTS_PER_GROUP": 4, "MAX_SEQ_LEN": 768}
CASES = {
    # notebook: (model name in the notebook, extra parameters)
    # Forced pipelined (the CPU plan leaves it off): step 1's games are played while step 0 trains.
    "tic_tac_toe": ("tic-tac-toe", {"EVAL_GAMES": 2, "PIPELINE": True}),
    "2048": ("game-2048", {"EVAL_GAMES": 2, "MAX_TURNS": 3}),
    # The custom notebook runs its SFT warm start too: its checkpoint is step 1, GRPO then takes step 2.
    "custom_rollout": ("my-task", {"EVAL_SCENARIOS": 2, "SFT_WARM_START": True}),
    # A LangGraph agent over the orders database, captured; its prompt (tools, one worked question) is longer.
    # Its SFT warm start on one batch of scripted runs is step 1, as the custom notebook's.
    "tool_agent": ("tool-agent", {"EVAL_QUESTIONS": 2, "MAX_TURNS": 2, "MAX_SEQ_LEN": 1536, "SFT_WARM_START": True,
                                  "SFT_DEMONSTRATIONS": 4}),
}


NBRUN = Path(__file__).with_name("nbrun.py")


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Run every notebook (in parallel processes); name -> (workdir, returncode, log, seconds)."""
    jobs = int(os.environ.get("ART_NB_NOTEBOOK_JOBS", min(len(CASES), os.cpu_count() or 1)))
    # The kernels inherit this: the tiny model resolves from its offline copy, no hub round trip.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    # Made here, not in the threads: pytest creates its base directory on first use, and two threads
    # doing so at once race (FileExistsError with an explicit --basetemp).
    workdirs = {name: tmp_path_factory.mktemp(name) for name in CASES}

    def run(name: str) -> tuple[Path, int, str, float]:
        workdir = workdirs[name]
        parameters = {**SMALL, **CASES[name][1], "ART_PATH": str(workdir / ".art"), "OUTPUT_DIR": str(workdir / "out")}
        started = time.perf_counter()
        done = subprocess.run([sys.executable, str(NBRUN), name, json.dumps(parameters), str(workdir)],
                              capture_output=True, text=True, env=env, timeout=3000)
        return workdir, done.returncode, done.stdout + done.stderr, time.perf_counter() - started

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = dict(zip(CASES, pool.map(run, CASES)))
    print(f"\nnotebooks ({jobs} at a time): {time.perf_counter() - started:.0f}s wall; "
          + ", ".join(f"{name} {r[3]:.0f}s" for name, r in results.items()))
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_notebook_runs_top_to_bottom(name, executed):
    model_name, _ = CASES[name]
    workdir, returncode, log, _ = executed[name]
    assert returncode == 0, log[-4000:]
    notebook = nbformat.read(workdir / f"{name}.executed.ipynb", as_version=4)
    art_path, out = workdir / ".art", workdir / "out"
    errors = [o for o in outputs(notebook) if o.get("output_type") == "error"]
    assert not errors, errors

    # The checkpoint of the last step, complete.
    model_dir = art_path / "notebooks" / "models" / model_name
    last = model_dir / "checkpoints" / f"{STEPS:04d}"
    assert (last / "adapter_model.safetensors").is_file() and (last / "meta.json").is_file()
    assert (model_dir / "trajectories" / "train" / f"{STEPS - 1:04d}.jsonl").is_file()
    if CASES[name][1].get("PIPELINE"):  # the last step trained games sampled from the adapter before it
        lines = (model_dir / "trajectories" / "train" / f"{STEPS - 1:04d}.jsonl").read_text().splitlines()
        assert {json.loads(line)["initial_policy_version"] for line in lines} == {STEPS - 2}

    # A summary with the reward of every step, and the curve.
    summary = json.loads((out / "summary.json").read_text())
    sft = CASES[name][1].get("SFT_WARM_START", False)
    assert [s["step"] for s in summary["steps"]] == list(range(1 if sft else 0, STEPS))
    if sft:
        said = "".join(output_text(o) for o in outputs(notebook, find_cell(notebook, "model.train_sft(")))
        assert "SFT: now at step 1" in said, said
    assert all(math.isfinite(s["reward"]) and s["reward_min"] <= s["reward"] <= s["reward_max"] for s in summary["steps"])
    assert summary["served_step"] == STEPS and summary["checkpoint"] == str(last)
    assert str(STEPS) in summary["evals"]  # the trained model's evaluation was logged
    assert "0" in summary["evals"]  # and the base model's, as the reward plot's step 0 point
    assert (out / "reward_curve.png").read_bytes().startswith(b"\x89PNG")

    # The exported adapter: a zip and a PEFT directory that loads and holds the last step's weights.
    adapter = out / "export" / f"{model_name}-step{STEPS}-lora"
    with zipfile.ZipFile(adapter.with_suffix(".zip")) as archive:
        assert f"{adapter.name}/adapter_model.safetensors" in archive.namelist()
    assert_peft_loads(adapter, last)

    # The dashboard's static fallback, refreshed through its display id: text + PNG of the final state.
    training = outputs(notebook, find_cell(notebook, "model.train("))
    fallback = [o for o in training if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
                and "image/png" in o.get("data", {})]
    assert len(fallback) == 1
    assert f"{STEPS - sft} steps with rewards" in fallback[0]["data"]["text/plain"]  # the SFT step has none
    # "Talk to your model": the base model and the trained LoRA both answered the prompt.
    talk = "".join(output_text(o) for o in outputs(notebook, find_cell(notebook, "PROMPT = ")))
    assert f"base model ({model_name}@0):" in talk and f"trained LoRA ({model_name}@{STEPS}):" in talk
    summary_cell = outputs(notebook, find_cell(notebook, "dashboard.summary("))
    assert any("image/png" in o.get("data", {}) and "| 0 |" in output_text(o) for o in summary_cell)


def assert_peft_loads(adapter_dir, checkpoint_dir):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from art_nb.local.plan.base_models import resolve_base_model

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == TINY  # the hub id, not this machine's cache path
    base = AutoModelForCausalLM.from_pretrained(resolve_base_model(TINY).path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir)
    trained = load_file(checkpoint_dir / "adapter_model.safetensors")
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(trained) > 0
    some_key = next(k for k in trained if "lora_B" in k)
    match = next(v for k, v in loaded.items() if k.replace(".default", "").endswith(some_key.split("base_model.")[-1]))
    assert torch.equal(match, trained[some_key])
