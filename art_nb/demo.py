"""The main job: a small model learns tic-tac-toe against a random opponent, on whatever is here.

Straight-line on purpose (it is the script a user reads first): evaluate the base model on fixed
games, train with GRPO for `steps` steps, evaluate the trained LoRA on the same games, print the
before/after table and save the reward curve. Re-running resumes from the last checkpoint.

The learning rate follows the base model's size (`art_nb.local.plan.rates`, the rule the notebooks
use too; the demo's 8 steps of 24 games are its short run) unless `learning_rate` is set. The
automatic choices (base model, device, dtype, engine, trainer, threads) are printed once, from
`backend.choices(model)`: while registering, the backend logs them and the base-model resolution,
engine and trainer each log their own part as well, which in a script reads as every choice twice.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import art_nb as art
from art_nb.backend import Backend
from art_nb.envs import tic_tac_toe as ttt
from art_nb.local.plan.base_models import TINY_MODEL
from art_nb.local.plan.rates import learning_rate_for
from art_nb.store import HISTORY_FILE, read_jsonl

__all__ = ["DemoConfig", "format_table", "register_and_show_choices", "run_demo"]

_PIPELINE: dict[str, bool | str] = {"auto": "auto", "on": True, "off": False}


@dataclass
class DemoConfig:
    base_model: str = TINY_MODEL
    name: str = "tic-tac-toe-demo"
    project: str = "demo"
    path: str = ".art"
    steps: int = 8
    groups_per_step: int = 4
    rollouts_per_group: int = 6
    learning_rate: float | None = None  # None: by the base model's size (learning_rate_for)
    eval_games: int = 32
    eval_seed: int = 10_000
    seed: int = 0
    lora_rank: int = 16
    out: str = "out/demo"
    pipeline: str = "auto"  # "on": art.pipeline plays step N+1's games while step N trains; "auto": the plan's choice

    def rate(self) -> tuple[float, str]:
        """(learning rate, why): the one set, else the rule's for the base model's size in this short run."""
        if self.learning_rate is not None:
            return self.learning_rate, f"{self.learning_rate:g}: set in DemoConfig.learning_rate"
        return learning_rate_for(self.base_model, short_run=True)


def format_table(before: dict[str, float], after: dict[str, float], labels: tuple[str, str]) -> str:
    rows = [("valid-move rate", "valid_move_rate"), ("win rate", "win"), ("draw rate", "draw"),
            ("loss rate", "loss"), ("invalid-game rate", "invalid"), ("mean reward", "reward")]
    width = max(len(label) for label in labels) + 2
    lines = [f"{'':20}{labels[0]:>{width}}{labels[1]:>{width}}"]
    for title, key in rows:
        lines.append(f"{title:20}{before[key]:>{width}.3f}{after[key]:>{width}.3f}")
    return "\n".join(lines)


async def register_and_show_choices(model: art.TrainableModel, backend: Backend) -> dict[str, str]:
    """Register `model` with `backend` and print each automatic choice once; returns the choices.

    The `art_nb` logger is held at WARNING while registering (warnings still show), so the INFO
    lines that restate the same choices stay out of the script's output.
    """
    log = logging.getLogger("art_nb")
    level = log.level
    log.setLevel(max(level, logging.WARNING))
    try:
        await model.register(backend)
    finally:
        log.setLevel(level)
    choices = backend.choices(model)
    print("Automatic choices:" if choices else "Nothing chosen automatically.")
    for key, why in choices.items():
        print(f"  {key}: {why}")
    return choices


async def run_demo(config: DemoConfig) -> dict[str, Any]:
    log = logging.getLogger("art_nb")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("  %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    if config.pipeline not in _PIPELINE:
        raise ValueError(f"DemoConfig.pipeline={config.pipeline!r}: use 'auto' (the plan's choice), 'on' or 'off'")
    rate, why = config.rate()
    config = replace(config, learning_rate=rate)  # the summary records the rate that trained
    print(f"learning rate: {why}")
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    model = art.TrainableModel(
        name=config.name,
        project=config.project,
        base_model=config.base_model,
        config=art.ModelConfig(max_seq_len=1024, lora=art.LoraConfig(rank=config.lora_rank, alpha=2 * config.lora_rank),
                               seed=config.seed),
    )
    backend = art.LocalBackend(path=config.path)
    print(f"Loading {config.base_model} (the first run downloads it)...")
    await register_and_show_choices(model, backend)

    print(f"\nEvaluating the base model on {config.eval_games} fixed games (seed {config.eval_seed}, greedy)...")
    before = await ttt.evaluate(model, config.eval_games, config.eval_seed, inference_name=model.get_inference_name(0),
                                concurrency=32)

    # What the demo was tuned with (PPO, learning_rate): art_nb follows ART's defaults (CISPO, 5e-6) otherwise.
    train_config = art.TrainConfig(learning_rate=config.learning_rate, loss="ppo")
    step_seconds: list[float] = []
    start = await model.get_step()
    if start >= config.steps:
        print(f"Already trained {start} steps (>= {config.steps}); evaluating only.")

    async def gather(step: int) -> list[art.TrajectoryGroup]:
        seeds = [config.seed * 1_000_000 + step * 1000 + g for g in range(config.groups_per_step)]
        return await art.gather_trajectory_groups(
            (art.TrajectoryGroup(ttt.rollout(model, ttt.TicTacToeScenario(seed=s)) for _ in range(config.rollouts_per_group))
             for s in seeds),
            pbar_desc=f"step {step + 1}/{config.steps} rollouts",
            max_exceptions=0.1,
        )

    steps = art.pipeline(model, gather, config.steps, enabled=_PIPELINE[config.pipeline])
    started = time.perf_counter()
    async for groups in steps:  # pipelined: step N+1's games are played while step N trains
        if not step_seconds:
            print(f"pipeline {steps.reason}")
        result = await model.train(groups, config=train_config)
        step_seconds.append(time.perf_counter() - started)
        started = time.perf_counter()
        m = result.metrics
        print(f"step {result.step}: reward {m.get('reward_mean', float('nan')):.3f}  loss {m.get('loss', float('nan')):+.4f}"
              f"  groups trained {int(m.get('groups', 0))}/{len(groups)} (others: equal rewards)"
              f"  step {step_seconds[-1]:.1f}s (train {m.get('time/train', 0):.1f}s)"
              f"{'  games of the step before' if m.get('pipeline/lag_steps') else ''}")

    trained_step = await model.get_step()
    print(f"\nEvaluating step {trained_step} on the same {config.eval_games} games...")
    after = await ttt.evaluate(model, config.eval_games, config.eval_seed, concurrency=32)
    await model.log([art.TrajectoryGroup([])], split="val", metrics={f"eval_{k}": v for k, v in after.items()})

    labels = ("base", f"step {trained_step}")
    table = format_table(before, after, labels)
    print(f"\n{table}\n")

    from art_nb.notebook.plots import plot_reward_curve

    history = read_jsonl(backend.model_dir(model) / HISTORY_FILE)
    png = out / "reward_curve.png"
    plot_reward_curve(history, png, title=f"{config.name}: tic-tac-toe reward per step")
    summary = {
        "config": asdict(config),
        "base": before,
        "trained": after,
        "trained_step": trained_step,
        "seconds_per_step": step_seconds,
        "pipeline": steps.reason,
        "checkpoint": str(backend.checkpoint_dir(model)),
        "reward_curve": str(png),
        "choices": backend.choices(model),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "table.txt").write_text(table + "\n")
    print(f"reward curve: {png}\nsummary: {out / 'summary.json'}\ncheckpoint: {summary['checkpoint']}")
    return summary
