"""Qwen2.5 as users train it, rebuilt offline: Qwen's real tokenizer, its chat template, random weights.

The hub cannot be reached here or on the GPU machine, so the tokenizer is built from Qwen's own BPE
vocabulary as Alibaba ships it in its `dashscope` SDK (`dashscope/resources/qwen.tiktoken`, Apache 2.0:
the 151,643 byte-level ranks Qwen2 and Qwen2.5 share; the SDK is installed --no-deps and never
imported), with Qwen2's split pattern, its NFC normaliser and Qwen2.5's 22 added tokens at their ids
(151643-151664: `<|im_end|>` ends a turn, `<tool_call>` is one token). The template is Qwen2.5-Instruct's
(chat_templates.QWEN25_TEMPLATE) and the weights are random in a small Qwen2 shape: what this shows is
the rendering (Qwen's template lists the tools and re-serialises every call it shows), not skill.

`qwen25_tool_agent_trains_exactly` is the check run on CPU (tests/integration/test_qwen25_real.py, the
transformers engine) and on the H200 (tests/gpu/test_qwen25_gpu.py, vLLM and Unsloth): rollouts of two
turns, the first forced to call the tool (`tool_choice` naming it: random weights never call one
unforced), the call and the tool's result sent back, a free second turn; then one step, with every
trained id checked against what the engine sampled (agent_frameworks.train_exactly).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from agent_frameworks import Served, train_exactly
from chat_templates import QWEN25_TEMPLATE

import art_nb as art

SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
TEXT_TOKENS = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>")  # added, but decoded like text (not skipped as special)
FIRST_ADDED_ID = 151643
VOCAB_ROWS = 151936  # the embedding rows of Qwen2.5-0.5B to 7B
ROLLOUTS = 8
CITIES = ["Paris", "Lima"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                   "required": ["city"]}}}]
QWEN_TOOLS_PREAMBLE = "You are provided with function signatures within <tools></tools> XML tags"


def qwen_vocabulary() -> Path | None:
    """dashscope's qwen.tiktoken, found without importing the SDK; None when it is not installed."""
    spec = importlib.util.find_spec("dashscope")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "resources" / "qwen.tiktoken"
        if path.is_file():
            return path
    return None


def needs_qwen_vocabulary() -> Path:
    path = qwen_vocabulary()
    if path is None:
        pytest.skip("Qwen's vocabulary comes from `pip install --no-deps dashscope` (scripts/setup.sh installs it)")
    return path


def qwen25_tokenizer(vocabulary: Path) -> Any:
    """Qwen2.5-Instruct's tokenizer: eos `<|im_end|>`, pad `<|endoftext|>`, no BOS, its chat template."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(vocabulary), pattern=SPLIT_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=QWEN25_TEMPLATE,
                                        model_max_length=32768, clean_up_tokenization_spaces=False)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})  # in id order
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    ids = tokenizer.convert_tokens_to_ids([*SPECIAL_TOKENS, *TEXT_TOKENS])
    assert ids == list(range(FIRST_ADDED_ID, FIRST_ADDED_ID + len(ids))), ids
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    return tokenizer


def random_qwen25(folder: Path, vocabulary: Path) -> Path:
    """A transformers folder: a 2-layer Qwen2 (hidden 256) with random bf16 weights and the tokenizer above.
    Built once per folder (a few seconds)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB_ROWS, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643],
                                               pad_token_id=151643)
    staging = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(staging)
    qwen25_tokenizer(vocabulary).save_pretrained(staging)
    staging.rename(folder)
    return folder


async def tool_rollout(model: art.TrainableModel, seed: int) -> None:
    """Turn 1 must call get_weather; the call goes back as the client got it, then the tool's answer;
    turn 2 is free (tools still offered)."""
    client = model.openai_client()
    name = model.get_inference_name()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You answer with a tool call when a tool can help."},
                                      {"role": "user", "content": "Weather in Paris?"}]
    first = await client.chat.completions.create(
        model=name, messages=messages, tools=TOOLS, max_tokens=48, temperature=1.0, seed=seed,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    reply = first.choices[0].message
    assert reply.tool_calls, f"a forced call came back without tool_calls: {reply}"
    messages.append(reply.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": call.id, "content": "21 C"} for call in reply.tool_calls]
    await client.chat.completions.create(model=name, messages=messages, tools=TOOLS, max_tokens=16,
                                         temperature=1.0, seed=seed)


async def qwen25_tool_agent_trains_exactly(served: Served) -> dict[str, Any]:
    """The module docstring's check on a registered model (taps on); what it saw, for the record."""
    group = await art.trajectory_group([art.trajectory(tool_rollout(served.model, seed)) for seed in range(ROLLOUTS)])
    assert len(group.trajectories) == ROLLOUTS, [t.logs for t in group.trajectories]
    tokenizer = served.tokenizer
    first_prompts = [c for c in served.engine.calls if QWEN_TOOLS_PREAMBLE in tokenizer.decode(c.prompt_ids)]
    assert len(first_prompts) >= ROLLOUTS, "Qwen's own template did not list the tools"
    rerendered_differently = 0
    for t in group.trajectories:
        first, second = t.exchanges[0], t.exchanges[1]
        [call] = first.choices[0].message["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        sampled = list(first.prompt_token_ids) + list(first.choices[0].token_ids)
        got = list(second.prompt_token_ids)[: len(sampled)]
        at = next((i for i, (a, b) in enumerate(zip(got, sampled, strict=True)) if a != b), len(sampled))
        assert got == sampled, (f"turn 2's prompt parts from turn 1's prompt + sample at {at} of {len(sampled)}: "
                                f"{tokenizer.decode(got[at - 5:at + 5])!r} != {tokenizer.decode(sampled[at - 5:at + 5])!r}"
                                f" ({got[at - 5:at + 5]} != {sampled[at - 5:at + 5]})")  # token in, token out
        reply = {**first.choices[0].message, "tool_calls": [  # arguments as objects, as templates take them
            {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}]}
        rendered = tokenizer.apply_chat_template([*first.request["messages"], reply], tools=TOOLS, tokenize=True,
                                                 return_dict=False)
        rerendered_differently += list(rendered)[: len(sampled)] != sampled
    counts = await train_exactly(served, group, "Qwen2.5 template, real tokenizer, random weights")
    counts["replies the template re-renders to other ids"] = rerendered_differently
    return counts
