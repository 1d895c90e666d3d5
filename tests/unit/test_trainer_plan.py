"""The peft trainer takes device, dtype and 4-bit from the plan, and reports its progress.

On a tiny random Llama saved like a hub model (tests/faults/tiny.py), so building a trainer costs
the imports, not the weights. The dtype rule is checked on a simulated T4: the plan, the notebook's
choices table (the plan's own row) and the trainer must all say float16 there, and none of them may
ask `torch.cuda.is_bf16_supported()` (True on a T4, through emulation).
"""

from __future__ import annotations

import logging
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from conftest import make_choice
from faults.tiny import build_tiny_model, tiny_model_config

from art_nb.config import TrainConfig
from art_nb.local.plan.choices import Plan, compute_dtype, plan_for
from art_nb.local.plan.hardware import Hardware
from art_nb.local.plan.versions import pins
from art_nb.local.trainers.peft_trainer import PeftTrainer
from art_nb.notebook.hardware import pick_defaults
from art_nb.store import TRAINER_STATE
from art_nb.trajectories import Trajectory, TrajectoryGroup

T4 = Hardware(cpu_count=2, gpu_name="Tesla T4", gpu_capability=(7, 5), gpu_memory_gib=15.0, packages=pins("turing"))


@pytest.fixture(autouse=True)
def _one_thread(one_thread):  # tests/conftest.py
    yield


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def cpu_plan(dtype: str = "float32") -> Plan:
    return Plan(device="cpu", dtype=dtype, engine="hf", trainer="peft", load_in_4bit=False, cpu_threads=1,
                reasons={"dtype": f"{dtype}: chosen by the test"})


def base_weight_dtypes(trainer: PeftTrainer) -> set[torch.dtype]:
    return {p.dtype for n, p in trainer.model.named_parameters() if "lora_" not in n}


def groups(tokenizer, n: int = 4) -> list[TrajectoryGroup]:
    """One group whose rewards differ, answers of different lengths (so microbatches differ too)."""
    answers = ["Four.", "It is four, I think.", "5", "Two plus two makes four, as everyone knows."][:n]
    return [TrajectoryGroup([
        Trajectory(messages_and_choices=[{"role": "user", "content": "Two plus two?"}, make_choice(tokenizer, a)],
                   reward=float(i % 2))
        for i, a in enumerate(answers)
    ])]


def test_a_simulated_t4_gets_float16_from_every_owner(monkeypatch, tiny_dir):
    def asked(*_args, **_kwargs):
        raise AssertionError("torch.cuda.is_bf16_supported() answers True on a T4 (emulated bf16): not to be asked")

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", asked)
    dtype, why = compute_dtype("auto", "cuda", (7, 5))
    assert dtype == "float16" and "sm75" in why

    plan = plan_for(tiny_model_config(engine="auto", trainer="auto"), T4)
    assert (plan.device, plan.dtype, plan.reasons["dtype"]) == ("cuda", "float16", why)

    defaults = pick_defaults(T4, "tic_tac_toe")
    assert defaults.model_config().dtype == "auto"  # the plan's to pick, and the choices table shows its pick
    assert ("dtype", "float16", why) in defaults.report().rows

    # The trainer loads in the plan's dtype (the plan's device is CPU here: this machine has no GPU).
    trainer = PeftTrainer(tiny_dir, tiny_model_config(), replace(plan, device="cpu"))
    assert base_weight_dtypes(trainer) == {torch.float16}
    assert trainer.plan.dtype == "float16"


def test_ampere_and_newer_get_bfloat16_in_the_notebook_too():
    dtype, why = compute_dtype("auto", "cuda", (8, 0))
    a100 = replace(T4, gpu_name="NVIDIA A100", gpu_capability=(8, 0), gpu_memory_gib=39.6)
    assert dtype == "bfloat16" and ("dtype", dtype, why) in pick_defaults(a100, "tic_tac_toe").report().rows


def test_without_a_plan_the_trainer_plans_for_this_machine_and_says_why(tiny_dir, caplog):
    config = tiny_model_config()
    expected = plan_for(config)
    with caplog.at_level(logging.DEBUG, logger="art_nb"):
        trainer = PeftTrainer(tiny_dir, config)
    assert trainer.plan == expected and trainer.device == expected.device
    assert base_weight_dtypes(trainer) == {expected.torch_dtype()}
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("trainer: peft"))
    assert expected.reasons["dtype"] in line and "4-bit" not in line


def test_the_trainer_takes_its_dtype_from_the_plan_not_the_config(tiny_dir, caplog):
    with caplog.at_level(logging.DEBUG, logger="art_nb"):
        trainer = PeftTrainer(tiny_dir, tiny_model_config(dtype="float32"), cpu_plan("bfloat16"))
    assert base_weight_dtypes(trainer) == {torch.bfloat16}
    assert any("bfloat16: chosen by the test" in r.getMessage() for r in caplog.records)


def test_four_bit_on_a_cpu_is_refused_before_anything_loads_or_claims_it(tiny_dir, caplog):
    with caplog.at_level(logging.DEBUG, logger="art_nb"), pytest.raises(ValueError, match="needs a CUDA GPU"):
        PeftTrainer(tiny_dir, tiny_model_config(load_in_4bit=True))
    assert not any("4-bit" in r.getMessage() for r in caplog.records)


def test_building_the_trainer_warns_nothing_about_transformers_internals(tiny_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # peft's is_gradient_checkpointing read, for one
        PeftTrainer(tiny_dir, tiny_model_config(), cpu_plan())


def test_train_step_reports_each_microbatch_in_order(tiny_dir):
    trainer = PeftTrainer(tiny_dir, tiny_model_config(), cpu_plan())
    events: list[dict] = []
    metrics = trainer.train_step(groups(trainer.tokenizer), TrainConfig(microbatch_tokens=64, learning_rate=1e-3),
                                 on_progress=events.append)
    assert metrics["trajectories"] == 4 and metrics["skipped_nonfinite"] == 0 and "stopped" not in metrics
    total = events[0]["total"]
    assert total > 1, "the batch should need several microbatches"
    assert [(e["phase"], e["done"], e["total"]) for e in events] == [("train", k, total) for k in range(1, total + 1)]
    assert events[-1]["tokens"] == metrics["tokens_trained"] > 0


def test_a_stopped_step_changes_nothing_and_says_so(tiny_dir):
    trainer = PeftTrainer(tiny_dir, tiny_model_config(), cpu_plan())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    metrics = trainer.train_step(groups(trainer.tokenizer), TrainConfig(learning_rate=1e-2), should_stop=lambda: True)
    assert metrics["stopped"] == 1 and metrics["tokens_trained"] == 0
    after = {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert trainer._optimizer is not None and not trainer._optimizer.state


def test_the_float16_plan_trains_with_a_loss_scaler_that_survives_a_checkpoint(tiny_dir, tmp_path):
    """A T4's float16 plan: the trainer keeps a GradScaler (float32 LoRA weights over the float16 base),
    every step reports its scale, and a checkpoint carries the scale so a resumed run does not start over
    from 65536 and skip steps to find it again."""
    trainer = PeftTrainer(tiny_dir, tiny_model_config(), cpu_plan("float16"))
    assert trainer._scaler is not None
    assert {p.dtype for p in trainer.model.parameters() if p.requires_grad} == {torch.float32}
    metrics = trainer.train_step(groups(trainer.tokenizer), TrainConfig(learning_rate=1e-3))
    assert metrics["grad_scale"] > 0 and metrics["trajectories"] == 4
    trainer._scaler.update(1024.0)  # as if overflows had lowered it
    trainer.save(tmp_path / "ckpt")

    resumed = PeftTrainer(tiny_dir, tiny_model_config(), cpu_plan("float16"))
    resumed.load(tmp_path / "ckpt")
    assert resumed._scaler.get_scale() == 1024.0
    assert PeftTrainer(tiny_dir, tiny_model_config(), cpu_plan("float32"))._scaler is None


def test_a_step_runs_on_the_plans_threads_in_a_worker_that_had_torchs_default(tiny_dir):
    """torch fixes a thread's count when it first runs a parallel op: a to_thread worker that built
    the trainer before the engine set the count kept another. Steps then ran on 1 or 2 threads by
    which worker took them, and a resumed run's adapter drifted from an uninterrupted one's."""
    trainer = PeftTrainer(tiny_dir, tiny_model_config(), cpu_plan())  # cpu_threads=1
    seen: list[int] = []

    def in_a_worker_that_ran_torch_on_two_threads() -> dict:
        torch.set_num_threads(2)
        torch.ones(4).sum()
        return trainer.train_step(groups(trainer.tokenizer), TrainConfig(learning_rate=1e-3),
                                  on_progress=lambda _: seen.append(torch.get_num_threads()))

    with ThreadPoolExecutor(1) as worker:
        metrics = worker.submit(in_a_worker_that_ran_torch_on_two_threads).result()
    assert metrics["trajectories"] == 4 and seen and set(seen) == {1}


def test_before_update_runs_once_the_gradient_is_ready_and_false_abandons_the_step(tiny_dir):
    trainer = PeftTrainer(tiny_dir, tiny_model_config(), cpu_plan())
    events: list[dict] = []
    seen: list[int] = []

    def refuse() -> bool:
        seen.append(len(events))  # how many microbatches had run their backward pass by then
        return False

    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    metrics = trainer.train_step(groups(trainer.tokenizer), TrainConfig(microbatch_tokens=64, learning_rate=1e-2),
                                 on_progress=events.append, before_update=refuse)
    assert seen == [events[0]["total"]] and metrics["stopped"] == 1
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert not trainer._optimizer.state and all(p.grad is None for p in trainer.model.parameters())
    metrics = trainer.train_step(groups(trainer.tokenizer), TrainConfig(learning_rate=1e-2), before_update=lambda: True)
    assert "stopped" not in metrics and trainer._optimizer.state


def test_the_checkpoint_holds_the_optimizer_state_of_when_it_is_written_and_refuses_nan(tiny_dir, tmp_path):
    """`snapshot_state` takes the optimizer's state dict at the step's end but copies its moments only
    when writing (in one transfer per dtype); a resumed trainer gets them back exactly."""
    trainer = PeftTrainer(tiny_dir, tiny_model_config(), cpu_plan())
    trainer.train_step(groups(trainer.tokenizer), TrainConfig(learning_rate=1e-3))
    write = trainer.snapshot_state()
    expected = {i: {k: v.clone() for k, v in m.items()} for i, m in trainer._optimizer.state_dict()["state"].items()}
    (tmp_path / "ckpt").mkdir()
    write(tmp_path / "ckpt")
    saved = torch.load(tmp_path / "ckpt" / TRAINER_STATE, weights_only=True)["optimizer"]
    assert saved["state"].keys() == expected.keys() and all(
        torch.equal(saved["state"][i][k], v) for i, m in expected.items() for k, v in m.items())
    assert saved["param_groups"][0]["lr"] == 1e-3
    trainer.save_adapter(tmp_path / "ckpt")
    resumed = PeftTrainer(tiny_dir, tiny_model_config(), cpu_plan())
    resumed.load(tmp_path / "ckpt")
    resumed.train_step(groups(resumed.tokenizer), TrainConfig(learning_rate=1e-3), should_stop=lambda: True)
    assert all(torch.equal(resumed._optimizer.state_dict()["state"][i][k], v)
               for i, m in expected.items() for k, v in m.items())
    next(iter(trainer._optimizer.state.values()))["exp_avg"][0] = float("nan")
    with pytest.raises(ValueError, match=r"refusing to save non-finite optimizer state \(0/exp_avg"):
        trainer.snapshot_state()(tmp_path / "ckpt")
