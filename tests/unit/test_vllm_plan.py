"""`engine_args`: what vLLM is built with, and whether training fits beside it awake. Pure: no vLLM, no GPU."""

from __future__ import annotations

import ast
import json
import struct
from pathlib import Path

import pytest

from art_nb.config import LoraConfig, ModelConfig
from art_nb.local.engines.base import EngineError
from art_nb.local.engines.vllm.args import VLLMSetup, engine_args
from art_nb.local.plan.memory import GiB

SMOL_PARAMS = 134_515_008
H200 = (140 * GiB, 141 * GiB)  # (free, total)


def fake_model_dir(path: Path, params: int = SMOL_PARAMS, positions: int = 8192) -> Path:
    """config.json of SmolLM2's shape and a safetensors header holding `params` parameters (no data needed)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
        "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
        "max_position_embeddings": positions,
    }))
    header = {"w": {"dtype": "BF16", "shape": [params], "data_offsets": [0, 2 * params]}}
    blob = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
    return path


@pytest.mark.parametrize("setting", [None, True, False])
def test_on_a_gpu_the_memory_plan_chooses_sleep_and_step_size(tmp_path, setting):
    config = ModelConfig(dtype="bfloat16", max_seq_len=2048, sleep_during_training=setting)
    setup = engine_args(fake_model_dir(tmp_path / "m"), config, True, True, H200, dtype="bfloat16")
    assert isinstance(setup, VLLMSetup)
    assert setup.kwargs["enable_sleep_mode"] and setup.kwargs["max_num_batched_tokens"] == 8192
    assert 0 < setup.kwargs["gpu_memory_utilization"] < 0.1
    assert setup.train_awake is (True if setting is None else not setting)  # 135M on an H200: awake unless told
    told = [r for r in setup.reasons if "ModelConfig.sleep_during_training" in r]
    assert len(told) == (0 if setting is None else 1)


def test_a_model_that_does_not_fit_is_refused_with_the_reason(tmp_path):
    config = ModelConfig(dtype="bfloat16", max_seq_len=2048)
    with pytest.raises(EngineError, match="does not fit next to the trainer"):
        engine_args(fake_model_dir(tmp_path / "m", params=8_000_000_000), config, True, True, (4 * GiB, 16 * GiB),
                    dtype="bfloat16")


def test_the_dtype_is_the_plans_and_the_context_the_models_limit(tmp_path):
    config = ModelConfig(max_seq_len=4096, lora=LoraConfig(rank=12, alpha=24))
    setup = engine_args(fake_model_dir(tmp_path / "m", positions=1024), config, False, True, dtype="float16")
    assert setup.kwargs["dtype"] == "float16" and any(r.startswith("dtype float16: the plan's") for r in setup.reasons)
    assert setup.kwargs["max_model_len"] == 1024
    assert any("positions limit (max_seq_len=4096 asked)" in r for r in setup.reasons)
    assert setup.kwargs["max_lora_rank"] == 16  # the next rank vLLM accepts
    assert setup.kwargs["logprobs_mode"] == "raw_logprobs"  # what the trainer recomputes
    assert setup.kwargs["structured_outputs_config"] == {"backend": "guidance"}  # llguidance, as the HF engine


def test_on_cpu_the_kv_cache_is_sized_in_bytes_and_nothing_sleeps(tmp_path):
    config = ModelConfig(max_seq_len=512, max_batch_size=8)
    setup = engine_args(fake_model_dir(tmp_path / "m"), config, False, True)
    per_token = 2 * 30 * 3 * 64 * 4  # K and V, layers, kv heads, head dim, float32
    assert setup.kwargs["kv_cache_memory_bytes"] == per_token * 8 * 512
    assert "enable_sleep_mode" not in setup.kwargs and not setup.train_awake
    assert setup.kwargs["dtype"] == "float32"  # the plan's rule for a CPU when no dtype is given


def test_no_engine_module_imports_the_trainers():
    """The engine serves in the plan's dtype; it asks no trainer (the vLLM engine once borrowed pick_dtype)."""
    engines = Path(__file__).parents[2] / "art_nb" / "engines"
    for file in sorted(engines.glob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "trainers" not in (node.module or ""), f"{file.name} imports {node.module}"
            elif isinstance(node, ast.Import):
                assert not any("trainers" in alias.name for alias in node.names), file.name


@pytest.mark.parametrize("has_bnb", [True, False])
def test_a_4bit_trainer_gets_a_4bit_sampler_where_vllm_can_quantise(tmp_path, monkeypatch, has_bnb):
    from art_nb.local.engines.vllm import args as vllm_plan

    monkeypatch.setattr(vllm_plan, "bitsandbytes_missing", lambda: None if has_bnb else "bitsandbytes is not installed")
    model = fake_model_dir(tmp_path / "m")
    four_bit = engine_args(model, ModelConfig(load_in_4bit=True), True, True, H200, dtype="bfloat16")
    plain = engine_args(model, ModelConfig(), True, True, H200, dtype="bfloat16")
    assert ("quantization" in four_bit.kwargs) is has_bnb and "quantization" not in plain.kwargs
    if has_bnb:
        assert four_bit.kwargs["quantization"] == "bitsandbytes"
        assert any("4-bit NF4" in r and "the weights the trainer trains" in r for r in four_bit.reasons)
        # and the plan counts the NF4 weights: the same KV needs a smaller share
        assert four_bit.kwargs["gpu_memory_utilization"] < plain.kwargs["gpu_memory_utilization"]
    else:
        assert any("weights unquantised (load_in_4bit asked for 4-bit serving" in r for r in four_bit.reasons)
        with pytest.raises(EngineError, match="vllm_4bit=True"):
            engine_args(model, ModelConfig(vllm_4bit=True), True, True, H200, dtype="bfloat16")
    # a user may keep bf16 serving beside a 4-bit trainer
    opted_out = engine_args(model, ModelConfig(load_in_4bit=True, vllm_4bit=False), True, True, H200, dtype="bfloat16")
    assert "quantization" not in opted_out.kwargs


def test_4bit_serving_is_refused_off_cuda_only_when_asked_for(tmp_path):
    model = fake_model_dir(tmp_path / "m")
    assert "quantization" not in engine_args(model, ModelConfig(load_in_4bit=True), False, True, dtype="float32").kwargs
    with pytest.raises(EngineError, match="needs a CUDA GPU"):
        engine_args(model, ModelConfig(vllm_4bit=True), False, True, dtype="float32")
