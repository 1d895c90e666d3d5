"""A train step's adapter reaches the engine in memory: `PeftTrainer.adapter_weights` is what peft's
`save_pretrained` writes, and `HFEngine.load_adapter(weights=...)` serves exactly what loading those
files serves, without reading the directory. On the real tiny model (SmolLM2-135M-Instruct, CPU), r16.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from art_nb.config import LoraConfig, ModelConfig
from art_nb.local.engines.base import GenerationRequest, SamplingParams
from art_nb.local.engines.hf import model as hf_model
from art_nb.local.engines.hf.engine import HFEngine
from art_nb.local.plan.base_models import TINY_MODEL, resolve_base_model
from art_nb.local.trainers.peft_trainer import PeftTrainer
from art_nb.store import ADAPTER_FILES, write_adapter

pytestmark = pytest.mark.slow

CONFIG = ModelConfig(max_seq_len=256, lora=LoraConfig(rank=16, alpha=32, dropout=0.0))


@pytest.fixture(scope="module")
def trainer() -> PeftTrainer:
    """A trainer whose LoRA B is random and large, so the adapter surely changes greedy output."""
    trainer = PeftTrainer(resolve_base_model(TINY_MODEL).path, CONFIG)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return trainer


def saved_by_peft(trainer: PeftTrainer, directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
    trainer.model.save_pretrained(directory, safe_serialization=True)
    return load_file(str(directory / ADAPTER_FILES[0])), json.loads((directory / ADAPTER_FILES[1]).read_text())


def test_adapter_weights_are_what_save_pretrained_writes_and_follow_each_update(trainer: PeftTrainer,
                                                                               tmp_path: Path) -> None:
    for round_ in range(2):  # the second after an in-place update, as an optimizer step makes
        tensors, config = saved_by_peft(trainer, tmp_path / f"peft{round_}")
        weights = trainer.adapter_weights()
        assert weights.tensors.keys() == tensors.keys()
        assert all(torch.equal(weights.tensors[key], tensors[key]) for key in tensors)
        assert all(t.device.type == "cpu" for t in weights.tensors.values())
        assert {**weights.config, "target_modules": None} == {**config, "target_modules": None}
        assert sorted(weights.config["target_modules"]) == sorted(config["target_modules"])
        ours = tmp_path / f"ours{round_}"
        ours.mkdir()
        write_adapter(ours, weights.tensors, weights.config)
        reread = load_file(str(ours / ADAPTER_FILES[0]))
        assert json.loads((ours / ADAPTER_FILES[1]).read_text()) == weights.config
        assert all(torch.equal(reread[key], tensors[key]) for key in tensors)
        with torch.no_grad():
            next(p for n, p in trainer.model.named_parameters() if "lora_A" in n).add_(1.0)


def test_adapter_weights_are_a_private_copy_and_refuse_nonfinite_values(trainer: PeftTrainer) -> None:
    weights = trainer.adapter_weights()
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if "lora_B" in n)
    before = param.detach().clone()
    try:
        with torch.no_grad():
            param.add_(1.0)
        assert torch.equal(weights.tensors[name.replace(".default", "")], before), "the copy followed the live weights"
        with torch.no_grad():
            param[0, 0] = float("nan")
        with pytest.raises(ValueError, match=r"refusing to save non-finite adapter weights \(.*lora_B"):
            trainer.adapter_weights()
    finally:
        with torch.no_grad():
            param.copy_(before)


def test_both_loads_leave_the_adapter_in_the_same_layout(trainer: PeftTrainer, tmp_path: Path) -> None:
    """Same dtype, shape, contiguity and 64-byte alignment, so the same kernels see the same memory.

    safetensors maps a file's tensors at offsets its header leaves (8-byte aligned, here 40 bytes
    past a 64-byte line); the handed-over tensors are views of one packed buffer. MKL's one-row
    sgemm sums in an order that depends on the weight's alignment on some CPUs (AMD EPYC; Intel with
    MKL_ENABLE_INSTRUCTIONS=SSE4_2), so there the two served logprobs that differed in the 6th digit
    until the engine gave misaligned weights their own memory.
    """
    saved_by_peft(trainer, tmp_path / "files")
    model, _ = hf_model.load(resolve_base_model(TINY_MODEL).path, torch.float32, torch.device("cpu"))
    model = hf_model.with_adapter(model, "files", tmp_path / "files", torch.device("cpu"))
    model = hf_model.with_adapter(model, "memory", trainer.adapter_weights(), torch.device("cpu"))
    params = dict(model.named_parameters())
    keys = [key for key in params if ".files." in key]
    assert len(keys) == len(trainer.adapter_weights().tensors)
    for key in keys:
        files, memory = params[key], params[key.replace(".files.", ".memory.")]
        assert (files.dtype, files.shape, files.stride()) == (memory.dtype, memory.shape, memory.stride()), key
        assert files.is_contiguous() and torch.equal(files, memory), key
        past_a_line = {name: t.data_ptr() % 64 for name, t in (("files", files), ("memory", memory))}
        assert past_a_line == {"files": 0, "memory": 0}, f"{key}: bytes past a 64-byte line {past_a_line}"


async def test_hf_engine_serves_handed_over_tensors_as_it_serves_the_files(trainer: PeftTrainer,
                                                                          tmp_path: Path) -> None:
    """Bit-identical logprobs, not close ones: both loads hand the same kernels the same numbers in the
    same layout (the test above), so any difference is a bug in one path, not rounding."""
    saved_by_peft(trainer, tmp_path / "files")
    weights = trainer.adapter_weights()
    engine = await HFEngine.create(resolve_base_model(TINY_MODEL).path, CONFIG)
    try:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Describe the sea."}],
                                                      add_generation_prompt=True, return_dict=True)["input_ids"]
        greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        rng = torch.get_rng_state()
        await engine.load_adapter("files", tmp_path / "files")
        await engine.load_adapter("memory", tmp_path / "never-written", weights=weights)  # path not read
        # The trainer's checkpoints keep this generator: loads that drew from it (peft's init of the
        # slot) made a resumed run, which loads from disk, differ from one served from memory.
        assert torch.equal(torch.get_rng_state(), rng), "an adapter load drew from torch's generator"
        [from_files], [from_memory], [base] = [
            await engine.generate(GenerationRequest(prompt, greedy, adapter=adapter))
            for adapter in ("files", "memory", None)]
        assert from_memory.token_ids == from_files.token_ids != base.token_ids
        assert from_memory.logprobs == from_files.logprobs
        await engine.load_adapter("memory", tmp_path / "never-written", weights=weights)  # replaces it in place
        [again] = await engine.generate(GenerationRequest(prompt, greedy, adapter="memory"))
        assert again.token_ids == from_files.token_ids
    finally:
        await engine.close()
