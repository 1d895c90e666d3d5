"""train_sft on the real tiny model on CPU: demonstrations raise the answer's logprob, the step advances,
the served model answers as demonstrated, and the records say the step was SFT."""

from __future__ import annotations

import json

import pytest
import torch

import art_nb as art

pytestmark = pytest.mark.slow

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPT = [{"role": "user", "content": "What is the secret word?"}]
ANSWER = "The secret word is pineapple."


def answer_logprob(state, prompt: list[dict], answer: str) -> float:
    """Sum of the answer's token logprobs given the prompt, by the trainer's weights (the ones served)."""
    tokenizer, model = state.trainer.tokenizer, state.trainer.model
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    prefix = tokenizer.encode(text, add_special_tokens=False)
    ids = prefix + tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits.float()[0, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    return float(logp[len(prefix) - 1 :].sum())


async def test_sft_warm_start_raises_the_answer_and_is_served(tmp_path):
    backend = art.LocalBackend(path=tmp_path)
    model = art.TrainableModel(name="sft", project="it", base_model=TINY,
                               config=art.ModelConfig(max_seq_len=256, lora=art.LoraConfig(rank=8, alpha=32)))
    await model.register(backend)
    try:
        state = backend._state(model)
        before = answer_logprob(state, PROMPT, ANSWER)
        demos = [art.Trajectory(messages_and_choices=[*PROMPT, {"role": "assistant", "content": ANSWER}])] * 4
        events = []
        result = await model.train_sft(demos, art.TrainSFTConfig(learning_rate=3e-3, batch_size=2),
                                       on_progress=events.append)
        after = answer_logprob(state, PROMPT, ANSWER)
        assert result.step == 1 and await model.get_step() == 1
        assert after > before + 5.0, (before, after)  # sum over the answer tokens, in nats
        assert result.metrics["sft_batches"] == 2 and result.metrics["tokens_trained"] > 0
        assert [e["done"] for e in events] == [1, 2] and all(e["phase"] == "sft" for e in events)

        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=PROMPT, max_tokens=16, temperature=0)
        assert "pineapple" in (completion.choices[0].message.content or "").lower()

        assert await backend.wait_for_checkpoint(model) == 1
        assert (backend.checkpoint_dir(model, 1) / "adapter_model.safetensors").exists()
        history = [json.loads(line) for line in (backend.model_dir(model) / "history.jsonl").read_text().splitlines()]
        assert any(line["split"] == "sft" and "sft/loss" in line for line in history)

        # the next GRPO step continues from the SFT weights
        choice = completion.choices[0]
        group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[*PROMPT, choice], reward=r) for r in (0, 1)])
        assert (await model.train([group], config=art.TrainConfig(learning_rate=1e-5))).step == 2
    finally:
        await backend.close()
