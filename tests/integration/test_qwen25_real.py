"""A tool-using agent on Qwen2.5's real tokenizer and template (random weights, tests/qwen25.py says how
they are built offline) trains on exactly what the transformers engine sampled: the calls Qwen's template
re-serialises go back to the engine as the ids it sampled. The same check runs on the H200 with vLLM and
Unsloth (tests/gpu/test_qwen25_gpu.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from agent_frameworks import Served
from qwen25 import (
    SPLIT_PATTERN,
    needs_qwen_vocabulary,
    qwen25_tokenizer,
    qwen25_tool_agent_trains_exactly,
    random_qwen25,
)

import art_nb as art

pytestmark = pytest.mark.slow


async def test_qwen25_tool_agent_trains_on_the_sampled_ids(tmp_path, monkeypatch) -> None:
    folder = random_qwen25(tmp_path / "qwen25-random", needs_qwen_vocabulary())
    backend = art.LocalBackend(path=tmp_path / "art")
    model = art.TrainableModel(name="qwen25", project="it", base_model=str(folder),
                               config=art.ModelConfig(max_seq_len=2048, lora=art.LoraConfig(rank=8, alpha=16)))
    try:
        await model.register(backend)
        assert "own rendering" in backend.choices(model)["tools"]  # Qwen's template shows tools itself
        counts = await qwen25_tool_agent_trains_exactly(Served(backend, model, monkeypatch))
        assert counts["called the tool"] == counts["rollouts"]
    finally:
        await backend.close()


def test_the_rebuilt_tokenizer_encodes_as_qwens_own_bpe() -> None:
    """The tokenizer tests/qwen25.py builds splits text as tiktoken does over the same ranks and pattern
    (Qwen's own tokenizer code is tiktoken over this file); its added tokens sit at Qwen2.5's ids."""
    import base64

    tiktoken = pytest.importorskip("tiktoken")
    vocabulary = needs_qwen_vocabulary()
    ranks = {base64.b64decode(token): int(rank) for token, rank in (
        line.split() for line in vocabulary.read_bytes().splitlines() if line)}
    reference = tiktoken.Encoding("qwen", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={})
    tokenizer = qwen25_tokenizer(vocabulary)
    for text in ["Weather in Paris? 21 C.", '{"city":"Lima"}\n\n    indented\tcode()  ', "日本語、中文。 Ünïcödé 🎉🎉",
                 Path(__file__).read_text().replace("<", "< ")]:  # code, without added-token text
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)
    assert tokenizer.encode("<|im_end|><tool_call>", add_special_tokens=False) == [151645, 151657]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer)) == (151645, 151643, 151665)
