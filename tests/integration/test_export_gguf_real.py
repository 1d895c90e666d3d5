"""GGUF export for real: SmolLM2 + a LoRA -> merged 16-bit -> q8_0 GGUF by llama.cpp's own Python
converter -> loaded back by transformers (`gguf_file=`) and compared with the merged model.

About 4 minutes on 2 busy CPU cores (conversion ~35 s; transformers dequantises q8_0 in Python, ~60 s+), and
it needs the converter (LLAMA_CPP_DIR, the cache, or a 76 MB pip download), so it runs only when
ART_NB_TEST_GGUF=1: `ART_NB_TEST_GGUF=1 pytest tests/integration/test_export_gguf_real.py`.
"""

from __future__ import annotations

import json
import os

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("ART_NB_TEST_GGUF") != "1", reason="set ART_NB_TEST_GGUF=1 (~4 min)")]

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_q8_0_gguf_of_a_merged_lora_gives_the_merged_models_greedy_tokens(tmp_path):
    gguf = pytest.importorskip("gguf")
    import peft
    import torch
    import transformers

    from art_nb.local.export import export_adapter
    from art_nb.local.plan.base_models import resolve_base_model

    base_dir = resolve_base_model(TINY).path
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                task_type="CAUSAL_LM"))
    with torch.no_grad():  # a trained-looking adapter, small enough to keep the model fluent
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    ckpt = tmp_path / "checkpoints" / "0001"
    model.save_pretrained(ckpt)
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "base_model": TINY}))

    result = export_adapter(ckpt, tmp_path / "out", name="smol", gguf="q8_0", make_zip=False)
    assert result.gguf_path == tmp_path / "out" / "smol-step1-q8_0.gguf"
    reader = gguf.GGUFReader(result.gguf_path)
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "llama"
    q_proj = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    assert q_proj.tensor_type == gguf.GGMLQuantizationType.Q8_0

    merged = transformers.AutoModelForCausalLM.from_pretrained(result.merged_dir, dtype=torch.float32)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(result.gguf_path.parent, gguf_file=result.gguf_path.name,
                                                               dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(result.merged_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Say a colour."}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        want, got = merged(ids).logits, loaded(ids).logits
    # q8_0 rounds each block of 32 weights to 8 bits: logits move by ~1 on a scale of ~40, argmax rarely.
    assert (want - got).abs().max() < 3.0, (want - got).abs().max()
    assert (want.argmax(-1) == got.argmax(-1)).float().mean() > 0.9
    greedy = {"max_new_tokens": 10, "do_sample": False}
    assert loaded.generate(ids, **greedy)[0].tolist() == merged.generate(ids, **greedy)[0].tolist()
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():  # the LoRA is in the file: the GGUF is nearer the merged model than the base is
        assert (base(ids).logits - got).abs().mean() > (want - got).abs().mean()
