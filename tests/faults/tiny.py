"""A tiny randomly initialised Llama with a ChatML tokenizer, saved like a hub model.

The fault tests start, kill and restart real training processes dozens of times; with a
32-wide, 2-layer model each restart costs the imports, not the model. The directory holds
config.json + model.safetensors + tokenizer files, so `resolve_base_model` takes it as a local
model and the real LocalBackend, HFEngine and PeftTrainer run on it unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's tokenizer

from conftest import build_chatml_tokenizer  # noqa: E402

__all__ = ["build_tiny_model", "tiny_model_config"]


def build_tiny_model(directory: Path, seed: int = 0) -> Path:
    """Write the model to `directory` (created) and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_chatml_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_model_config(**overrides):
    """A ModelConfig sized for the tiny model: transformers engine + peft trainer, small LoRA."""
    import art_nb as art

    values = dict(engine="hf", trainer="peft", max_seq_len=256, max_batch_size=64,
                  lora=art.LoraConfig(rank=4, alpha=8, dropout=0.0))
    values.update(overrides)
    return art.ModelConfig(**values)
