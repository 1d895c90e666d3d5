"""Capture on the real tiny model: rollouts written with a plain
`openai.AsyncOpenAI(base_url=...)` and with raw `httpx`, inside `art.trajectory(...)`, train through
LocalBackend with zero re-tokenised tokens, on the very ids the server sampled."""

from __future__ import annotations

import httpx
import openai
import pytest

import art_nb as art
from art_nb.grpo.tokens import tokenize_trajectory

pytestmark = pytest.mark.slow

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"


async def test_plain_openai_and_httpx_rollouts_train_on_the_servers_ids(tmp_path) -> None:
    backend = art.LocalBackend(path=tmp_path)
    model = art.TrainableModel(name="cap", project="it", base_model=TINY,
                               config=art.ModelConfig(max_seq_len=512, lora=art.LoraConfig(rank=8, alpha=32)))
    await model.register(backend)
    base_url, key, name = model.inference_base_url, model.inference_api_key, model.get_inference_name()

    async def with_openai(seed: int) -> None:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key)
        messages = [{"role": "user", "content": "Say a colour."}]
        first = await client.chat.completions.create(model=name, messages=messages, max_tokens=6, seed=seed)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Another one."}]
        second = await client.chat.completions.create(model=name, messages=messages, max_tokens=6, seed=seed)
        art.current_trajectory(required=True).reward = float("e" in (second.choices[0].message.content or ""))
        await client.close()

    async def with_httpx(seed: int) -> None:
        async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"}) as http:
            r = await http.post("/chat/completions", json={
                "model": name, "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 6,
                "seed": seed})
            art.current_trajectory(required=True).reward = -0.1 * len(r.json()["choices"][0]["message"]["content"])

    try:
        groups = [await art.trajectory_group([art.trajectory(with_openai(s)) for s in range(3)]),
                  await art.trajectory_group([art.trajectory(with_httpx(s)) for s in range(3)])]
        from transformers import AutoTokenizer

        from art_nb.local.plan.base_models import resolve_base_model

        tokenizer = AutoTokenizer.from_pretrained(resolve_base_model(TINY).path)  # the served model's own
        for group in groups:
            for t in group.trajectories:
                assert t.exchanges, "the scope recorded no call"
                seq = tokenize_trajectory(tokenizer, t, 512)
                sampled = [i for call in t.exchanges for i in call.choices[0].token_ids]
                assert seq.retokenized_choices == 0
                assert [i for i, m in zip(seq.input_ids, seq.assistant_mask) if m] == sampled
                assert all(lp == lp for lp, m in zip(seq.engine_logprobs, seq.assistant_mask) if m)  # server's
        assert [len(t.exchanges) for t in groups[0].trajectories] == [2, 2, 2]
        for group in groups:  # a group whose rewards tie trains nothing; make them differ
            for i, t in enumerate(group.trajectories):
                t.reward += 0.01 * i
        result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-4))
        assert result.step == 1
        assert result.metrics["retokenized_choices"] == 0
    finally:
        await backend.close()
