"""The peft trainer's 4-bit base is real: NF4 bitsandbytes layers, less memory, a finite GRPO step.

`ModelConfig(load_in_4bit=True)` with the peft trainer used to log "4-bit base" and load full
precision. Here one trainer is built each way on the real SmolLM2 (conftest.py's `model_dir`) and
compared; the 4-bit one then takes a GRPO step and its adapter loads into the full-precision
trainer, as an engine serving the full-precision base would load it. Measurements land in
$ART_NB_GPU_RESULTS/gpu_path.json with the other GPU tests'.
"""

from __future__ import annotations

import gc
import math
import time
from pathlib import Path

import pytest

from .conftest import record

pytestmark = pytest.mark.gpu

GiB = 1024**3


def build(model_dir: Path, four_bit: bool):
    """A peft trainer planned for this GPU, and the CUDA memory its load added (bytes)."""
    import torch

    import art_nb as art
    from art_nb.local.trainers.peft_trainer import PeftTrainer

    config = art.ModelConfig(engine="hf", trainer="peft", load_in_4bit=four_bit, max_seq_len=512,
                             lora=art.LoraConfig(rank=8, alpha=16))
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    started = time.perf_counter()
    trainer = PeftTrainer(model_dir, config)
    torch.cuda.synchronize()
    record(f"four_bit_{four_bit}_load_s", round(time.perf_counter() - started, 1))
    return trainer, torch.cuda.memory_allocated() - before


def base_layers(trainer) -> dict[str, object]:
    """The frozen layers the LoRA wraps (peft keeps each as `<name>.base_layer`)."""
    return {name: module for name, module in trainer.model.named_modules() if name.endswith(".base_layer")}


def lora_parameters(trainer) -> dict[str, object]:
    return {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}


def groups(tokenizer):
    from conftest import make_choice  # tests/conftest.py

    import art_nb as art

    answers = ["Red, green, blue.", "Red, blue and yellow", "Colours: cyan, magenta, black.", "Green"]
    prompt = {"role": "user", "content": "Name three colours, separated by commas."}
    return [art.TrajectoryGroup([
        art.Trajectory(messages_and_choices=[prompt, make_choice(tokenizer, a)], reward=float(i % 2))
        for i, a in enumerate(answers)
    ])]


@pytest.fixture(scope="module")
def trainers(model_dir):
    pytest.importorskip("bitsandbytes", reason="the peft trainer's 4-bit base needs bitsandbytes")
    full, full_bytes = build(model_dir, four_bit=False)
    quantized, quantized_bytes = build(model_dir, four_bit=True)
    record("four_bit_memory_after_load_gib", {"full": round(full_bytes / GiB, 3),
                                              "nf4": round(quantized_bytes / GiB, 3)})
    return full, full_bytes, quantized, quantized_bytes


def test_the_four_bit_base_is_nf4_and_takes_less_memory(trainers):
    import bitsandbytes as bnb
    import torch

    full, full_bytes, quantized, quantized_bytes = trainers
    assert quantized.plan.load_in_4bit and not full.plan.load_in_4bit
    layers = base_layers(quantized)
    assert layers and all(isinstance(m, bnb.nn.Linear4bit) for m in layers.values()), \
        {n: type(m).__name__ for n, m in layers.items() if not isinstance(m, bnb.nn.Linear4bit)}
    assert {m.weight.quant_state.quant_type for m in layers.values()} == {"nf4"}
    assert {m.compute_dtype for m in layers.values()} == {quantized.plan.torch_dtype()}
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in base_layers(full).values())
    assert {type(m) for m in base_layers(full).values()} == {torch.nn.Linear}
    # LoRA weights train in float32 (peft upcasts adapters of a half-precision base) or the plan's dtype.
    allowed = {torch.float32, quantized.plan.torch_dtype()}
    assert lora_parameters(quantized) and {p.dtype for p in lora_parameters(quantized).values()} <= allowed
    # What stays unquantised (embeddings, norms, lm head) stays in the plan's dtype: a float32 residual
    # stream (peft's prepare_model_for_kbit_training) cost more activation memory than NF4 saved.
    frozen = {p.dtype for p in quantized.model.parameters() if not p.requires_grad and p.dtype.is_floating_point}
    assert frozen == {quantized.plan.torch_dtype()}, frozen
    assert quantized_bytes < full_bytes, (quantized_bytes, full_bytes)


def test_one_step_on_the_four_bit_base_is_finite_and_its_adapter_loads_over_full_precision(trainers, tmp_path):
    import torch
    from safetensors.torch import load_file

    import art_nb as art

    full, _, quantized, _ = trainers
    before = {n: p.detach().clone() for n, p in lora_parameters(quantized).items()}
    events: list[dict] = []
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    metrics = quantized.train_step(groups(quantized.tokenizer), art.TrainConfig(learning_rate=1e-3),
                                   on_progress=events.append)
    record("four_bit_step", {"seconds": round(time.perf_counter() - started, 2), "loss": metrics["loss"],
                             "grad_norm": metrics["grad_norm"],
                             "peak_gib": round(torch.cuda.max_memory_allocated() / GiB, 3)})
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    assert metrics["skipped_nonfinite"] == 0 and metrics["tokens_trained"] > 0
    assert events and events[-1]["done"] == events[-1]["total"]
    after = lora_parameters(quantized)
    assert any(not torch.equal(before[n], after[n]) for n in before)

    quantized.save_adapter(tmp_path)
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert saved and all("lora_" in key for key in saved), [k for k in saved if "lora_" not in k][:3]
    full.load(tmp_path)  # raises on unexpected keys: the engines load the same files the same way
    loaded = {n: p.detach().float().cpu() for n, p in lora_parameters(full).items()}
    trained = {n: p.detach().float().cpu() for n, p in after.items()}
    assert loaded.keys() == trained.keys()
    for name in trained:
        torch.testing.assert_close(loaded[name], trained[name])
