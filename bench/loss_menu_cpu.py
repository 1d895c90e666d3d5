"""Does every loss of the menu train? A few GRPO steps per loss on a tiny task, on CPU.

The task is small enough to run on a loaded 2-core machine in minutes: a randomly initialised
Llama (vocabulary 100, 2 layers, hidden 64, every weight trained) samples completions of up to 8 tokens
after a 4-token prompt; ids 90-99 end a completion (and are trained on, like an eos), so lengths
vary (a uniform policy stops after about 10 tokens, often at the limit). The reward is the number of
completion tokens in a target set of 10 ids (0-9), over 8: a uniform policy scores about 0.08, the
ceiling is 1 (8 target tokens, no end id), so the task also rewards length. Each step samples 8 prompts x 8
completions (temperature 1, the sampler's logprobs kept as the engine's), computes group
advantages as `prepare_batch` does (zero-variance groups dropped, `scale_rewards` per loss) and
runs `art_nb.grpo.grpo_step` with AdamW, the default importance-sampling correction on.

Every loss starts from the same weights and the same seed; before/after is the mean reward of 512
fresh samples from a fixed seed. What this shows: each loss raises the reward through the real
step code (microbatching, aggregation, correction); not how they compare on a real model.

    .venv/bin/python bench/loss_menu_cpu.py [--steps 15] [--losses cispo,ppo,dapo,dr_grpo,gspo]
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from _common import ROOT, Results, loadavg

from art_nb.config import TrainConfig
from art_nb.grpo.advantages import PreparedBatch, group_advantages
from art_nb.grpo.step import grpo_step
from art_nb.grpo.tokens import TokenizedTrajectory

VOCAB, PROMPT, COMPLETION, TARGET, END = 100, 4, 8, 10, 90
GROUPS, PER_GROUP = 8, 8


def tiny_model(seed: int) -> Any:
    """All weights trained (no LoRA): a LoRA over random weights moves this task's reward too slowly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


@torch.no_grad()
def sample(model: Any, prompts: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Completions [N, COMPLETION] and the sampler's logprob of each sampled token (full forward per token)."""
    ids, logprobs = prompts, []
    for _ in range(COMPLETION):
        logits = model(input_ids=ids).logits[:, -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        token = torch.multinomial(logp.exp(), 1, generator=generator)
        logprobs.append(logp.gather(-1, token))
        ids = torch.cat([ids, token], dim=1)
    return ids[:, PROMPT:], torch.cat(logprobs, dim=1)


def lengths(completions: torch.Tensor) -> torch.Tensor:
    """Tokens up to and including the first end id (ids >= END), or all of them."""
    ended = completions >= END
    first = torch.where(ended.any(-1), ended.float().argmax(-1), torch.full_like(ended[:, 0], COMPLETION - 1,
                                                                                  dtype=torch.long))
    return first + 1


def reward(completions: torch.Tensor) -> torch.Tensor:
    kept = torch.arange(COMPLETION).unsqueeze(0) < lengths(completions).unsqueeze(1)
    return ((completions < TARGET) & kept).float().sum(-1) / COMPLETION


def evaluate(model: Any, seed: int = 1234, n: int = 512) -> float:
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(TARGET, VOCAB, (n, PROMPT), generator=generator)
    completions, _ = sample(model, prompts, generator)
    return float(reward(completions).mean())


def batch_for(model: Any, config: TrainConfig, generator: torch.Generator) -> tuple[PreparedBatch, float]:
    prompts = torch.randint(TARGET, VOCAB, (GROUPS, PROMPT), generator=generator).repeat_interleave(PER_GROUP, 0)
    completions, logprobs = sample(model, prompts, generator)
    rewards, n = reward(completions), lengths(completions).tolist()
    batch = PreparedBatch(max_seq_len=PROMPT + COMPLETION)
    for g in range(GROUPS):
        rows = slice(g * PER_GROUP, (g + 1) * PER_GROUP)
        if len(set(rewards[rows].tolist())) == 1:
            batch.zero_variance_groups += 1
            continue
        advantages = group_advantages(rewards[rows].double(), scale=config.scale_rewards)
        for row, advantage in zip(range(rows.start, rows.stop), advantages.tolist()):
            ids = prompts[row].tolist() + completions[row, : n[row]].tolist()
            batch.items.append(TokenizedTrajectory(
                input_ids=ids, assistant_mask=[False] * PROMPT + [True] * n[row],
                engine_logprobs=[math.nan] * PROMPT + logprobs[row, : n[row]].tolist(), advantage=advantage,
                group_index=g))
        batch.groups += 1
    return batch, float(rewards.mean())


def run_loss(loss: str, steps: int, learning_rate: float, start: Any) -> dict[str, Any]:
    model = copy.deepcopy(start)
    config = TrainConfig(loss=loss, learning_rate=learning_rate, microbatch_tokens=256)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=learning_rate)
    before = evaluate(model)
    generator = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    history, started = [], time.perf_counter()
    for _ in range(steps):
        batch, train_reward = batch_for(model, config, generator)
        metrics = grpo_step(model, optimizer, batch, config) if batch.items else {}
        history.append({"train_reward": round(train_reward, 4),
                        "mean_length": round(sum(len(i.input_ids) - PROMPT for i in batch.items) / max(len(batch.items), 1), 2),
                        **{k: round(float(metrics[k]), 6) for k in (
            "loss", "grad_norm", "clip_fraction", "mismatch_logprob_abs", "is_weight_mean") if k in metrics}})
    after = evaluate(model)
    return {"before": round(before, 4), "after": round(after, 4), "rose": after > before,
            "mean_length_last_step": history[-1].get("mean_length"),
            "train_seconds": round(time.perf_counter() - started, 1), "load_1min_after": loadavg(),
            "config": {k: v for k, v in config.model_dump().items() if k in (
                "loss", "epsilon", "epsilon_high", "importance_sampling_level", "scale_rewards",
                "importance_sampling_mode", "importance_sampling_cap")},
            "history": history}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--losses", default="cispo,ppo,dapo,dr_grpo,gspo")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "loss_menu_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = Results(args.out, task=f"tiny Llama (vocab {VOCAB}), completions up to {COMPLETION} tokens ending at an "
                      f"id >= {END}, reward = tokens in ids 0-{TARGET - 1} / {COMPLETION}; {GROUPS} groups x "
                      f"{PER_GROUP} per step", steps=args.steps,
                      learning_rate=args.learning_rate, threads=args.threads)
    start = tiny_model(seed=0)
    for loss in args.losses.split(","):
        with results.section(loss) as entry:
            entry.update(run_loss(loss, args.steps, args.learning_rate, start))
            entry["summary"] = f"eval reward {entry['before']} -> {entry['after']} in {entry['train_seconds']} s"


if __name__ == "__main__":
    main()
