"""SFT warm start then GRPO, against GRPO alone, on the custom notebook's addition task (CPU, SmolLM2-135M).

Both arms start from the same base, run the same GRPO steps on the same scenarios with the same seeds,
and are scored greedily on the same held-out sums before and after. The SFT arm first calls
`model.train_sft` once on a few correct demonstrations (the notebook's prompt, answer in tags).
Writes bench/results/sft_warm_start_cpu.json. Usage: .venv/bin/python bench/sft_warm_start_cpu.py
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import art_nb as art

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
SYSTEM = "Add the two numbers. Reply with the sum inside answer tags and nothing else, like <answer>7</answer>."
EXAMPLE = [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "<answer>7</answer>"}]
GRPO_STEPS, GROUPS, ROLLOUTS = 3, 2, 4
DEMOS, SFT = 8, art.TrainSFTConfig(learning_rate=3e-4, batch_size=4)
GRPO = art.TrainConfig(learning_rate=5e-5, loss="ppo")

pairs = [{"a": a, "b": b} for a in range(10) for b in range(10)]
random.Random(0).shuffle(pairs)
EVAL, TRAIN = pairs[:16], pairs[16:]


def prompt(s: dict) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": f"What is {s['a']} + {s['b']}?"}]


async def rollout(model: art.TrainableModel, s: dict, temperature: float = 1.0, name: str | None = None) -> art.Trajectory:
    completion = await model.openai_client().chat.completions.create(
        model=name or model.get_inference_name(), messages=prompt(s), max_completion_tokens=16,
        temperature=temperature, logprobs=True)
    choice = completion.choices[0]
    match = re.search(r"<answer>\s*(-?\d+)\s*</answer>", choice.message.content or "")
    correct = match is not None and int(match.group(1)) == s["a"] + s["b"]
    return art.Trajectory(messages_and_choices=[*prompt(s), choice], reward=1.0 if correct else 0.2 if match else 0.0,
                          metrics={"correct": float(correct), "formatted": float(match is not None)})


async def evaluate(model: art.TrainableModel) -> dict[str, float]:
    done = [await rollout(model, s, temperature=0.0) for s in EVAL]
    return {k: sum(t.metrics[k] for t in done) / len(done) for k in ("correct", "formatted")}


async def arm(warm_start: bool, root: Path) -> dict:
    backend = art.LocalBackend(path=root / ("sft" if warm_start else "grpo"))
    model = art.TrainableModel(name="add", project="bench", base_model=BASE,
                               config=art.ModelConfig(max_seq_len=512, lora=art.LoraConfig(rank=8, alpha=32)))
    await model.register(backend)
    out: dict = {"before": await evaluate(model)}
    started = time.perf_counter()
    if warm_start:
        demos = [art.Trajectory(messages_and_choices=[*prompt(s), {"role": "assistant", "content": f"<answer>{s['a'] + s['b']}</answer>"}])
                 for s in TRAIN[-DEMOS:]]
        result = await model.train_sft(demos, SFT)
        out["sft"] = {"seconds": round(time.perf_counter() - started, 1), "loss": result.metrics["loss"],
                      "tokens_trained": result.metrics["tokens_trained"]}
        out["after_sft"] = await evaluate(model)
    rewards = []
    for step in range(GRPO_STEPS):
        batch = TRAIN[step * GROUPS:(step + 1) * GROUPS]
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, s) for _ in range(ROLLOUTS)) for s in batch], pbar_desc=None)
        rewards.append(sum(t.reward for g in groups for t in g.trajectories) / (GROUPS * ROLLOUTS))
        await model.train(groups, config=GRPO)
    out.update(train_reward_per_step=[round(r, 3) for r in rewards], after=await evaluate(model),
               seconds=round(time.perf_counter() - started, 1), final_step=await model.get_step())
    await backend.close()
    return out


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = {"grpo_only": await arm(False, Path(tmp)), "sft_then_grpo": await arm(True, Path(tmp))}
    report = {"task": "custom notebook addition (answer tags), greedy eval on 16 held-out sums", "base_model": BASE,
              "grpo_steps": GRPO_STEPS, "groups_per_step": GROUPS, "rollouts_per_group": ROLLOUTS,
              "sft": {"demonstrations": DEMOS, **SFT.model_dump()}, "grpo_learning_rate": GRPO.learning_rate,
              "machine": "2-core CPU shared with other jobs", "python": sys.version.split()[0], **results}
    path = Path(__file__).parent / "results" / "sft_warm_start_cpu.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
