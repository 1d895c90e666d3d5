"""Tic-tac-toe on the real SmolLM2-135M-Instruct with vLLM + Unsloth on one GPU, through LocalBackend.

What it measures: the base model and the trained LoRA on the same fixed evaluation games (greedy),
the reward per step, and where each step's time goes (rollouts, pause/sleep, train, save, swap),
as `TrainResult.metrics` reports it. The first step includes Unsloth's Triton compilation.

Run on the GPU machine from the repository root, after `source .gpu/bin/env.sh`:

    python bench/gpu_tictactoe.py $OUT/bench --steps 16 --budget-s 240
    python bench/gpu_tictactoe.py $OUT/bench --steps 10 --pipeline both   # with and without art.pipeline

`--pipeline both` trains two LoRAs from step 0 on the same games, one through `art.pipeline` (each
step's games played while the step before trains, one step off-policy) and one without, on one
vLLM engine; per step: reward, lag, mismatch KL and time, and each trained LoRA's evaluation.

Writes OUT/tictactoe.json and OUT/reward_curve.png, with both curves also reward_curve_pipeline.png
(when matplotlib is there; else redraw them anywhere with `python bench/gpu_tictactoe.py OUT --plot-from
OUT/tictactoe.json`). Weights: --model DIR,
else $ART_NB_GPU_MODEL, else the staged GGUF converted once (tests/gpu/conftest.py: real_model_dir).
vLLM runs eager unless --cuda-graphs (starts ~1 min sooner; decodes slower).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the GPU machine runs the working tree, not an installed art_nb

import art_nb as art  # noqa: E402
from art_nb.envs import tic_tac_toe as ttt  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for tictactoe.json and reward_curve.png")
    parser.add_argument("--model", type=Path, default=None, help="a transformers folder with SmolLM2 weights")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--groups", type=int, default=8, help="scenarios per step")
    parser.add_argument("--group-size", type=int, default=8, help="games per scenario")
    parser.add_argument("--eval-games", type=int, default=64)
    parser.add_argument("--eval-seed", type=int, default=10_000)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="stop training after this many seconds (shared out between the curves)")
    parser.add_argument("--pipeline", choices=("off", "on", "both"), default="off",
                        help="train with art.pipeline off, on, or both (two curves from step 0 on the same games)")
    parser.add_argument("--cuda-graphs", action="store_true", help="let vLLM compile and capture CUDA graphs")
    parser.add_argument("--plot-from", type=Path, default=None,
                        help="only redraw OUT/reward_curve.png from a results JSON")
    return parser.parse_args(argv)


def model_folder(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return args.model
    folder = _gpu_helpers().real_model_dir()
    if folder is None:
        raise SystemExit("no SmolLM2 weights: pass --model, set ART_NB_GPU_MODEL, or stage the GGUF (shared/gpu)")
    return folder


def on_gpu() -> bool:
    """False in a CPU dry run (vLLM's CPU build, the peft trainer): the code path, not the numbers."""
    import torch

    return torch.cuda.is_available()


def gpu_memory() -> dict[str, float]:
    import torch

    if not on_gpu():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"used_gib": round((total - free) / 2**30, 2), "total_gib": round(total / 2**30, 1)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if not args.cuda_graphs:
        os.environ["ART_NB_VLLM_ENFORCE_EAGER"] = "1"
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    started = time.perf_counter()
    folder = model_folder(args)
    modes = ["sync", "pipelined"] if args.pipeline == "both" else ["pipelined" if args.pipeline == "on" else "sync"]
    # One model per loop, the same base and the same games: the second shares the first one's vLLM engine.
    models = {mode: art.TrainableModel(
        name="ttt" if mode == "sync" else "ttt-pipelined", project="bench", base_model=str(folder),
        config=art.ModelConfig(engine="vllm", trainer="unsloth" if on_gpu() else "peft", max_seq_len=1024,
                               lora=art.LoraConfig(rank=args.lora_rank, alpha=2 * args.lora_rank)))
        for mode in modes}
    backend = art.LocalBackend(path=args.out / "art")
    first = models[modes[0]]
    await first.register(backend)
    results["register_s"] = round(time.perf_counter() - started, 1)
    results["choices"] = backend.choices(first)
    results["engine_reasons"] = getattr(backend._state(first).engine, "reasons", [])
    results["memory_after_register"] = gpu_memory()

    mark = time.perf_counter()
    results["base"] = await ttt.evaluate(first, args.eval_games, args.eval_seed,
                                         inference_name=first.get_inference_name(0), concurrency=64)
    results["base_eval_s"] = round(time.perf_counter() - mark, 1)
    results["curves"] = {}
    budget = args.budget_s / len(modes)
    for mode in modes:
        model = models[mode]
        if model is not first:
            mark = time.perf_counter()
            await model.register(backend)
            results[f"register_{mode}_s"] = round(time.perf_counter() - mark, 1)
        results["curves"][mode] = await curve(args, model, backend, mode == "pipelined", budget)
        (args.out / "tictactoe.json").write_text(json.dumps(results, indent=1, default=str))
    only = results["curves"].get("sync") or results["curves"][modes[0]]
    results.update({k: only[k] for k in ("steps", "training_s", "trained_step", "trained", "trained_eval_s",
                                         "time_split_mean_s", "history")})  # the fields of earlier runs
    results["memory_after_training"] = gpu_memory()
    results["environment"] = environment()
    results["total_s"] = round(time.perf_counter() - started, 1)
    results["reward_curve"] = draw(results, args.out)
    (args.out / "tictactoe.json").write_text(json.dumps(results, indent=1, default=str))
    await backend.close()
    return results


async def curve(args: argparse.Namespace, model: Any, backend: Any, pipelined: bool, budget_s: float) -> dict[str, Any]:
    """Train `model` from step 0 on the same games as every other curve, with art.pipeline on or off:
    the reward, lag and mismatch per step, the time split, and the trained model's evaluation."""
    config = art.TrainConfig(learning_rate=args.learning_rate, loss="ppo")  # as measured before CISPO became the default
    out: dict[str, Any] = {"pipelined": pipelined}
    steps: list[dict[str, float]] = []
    gathered: dict[int, float] = {}
    started = time.perf_counter()

    async def gather(step: int) -> list[art.TrajectoryGroup]:
        mark = time.perf_counter()
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(ttt.rollout(model, ttt.TicTacToeScenario(seed=step * 1000 + g))
                                 for _ in range(args.group_size)) for g in range(args.groups)),
            pbar_desc=None, max_exceptions=0.1,
        )
        gathered[step] = time.perf_counter() - mark
        return groups

    previous = time.perf_counter()
    async for groups in art.pipeline(model, gather, args.steps, enabled=pipelined):
        result = await model.train(groups, config=config)
        m = result.metrics
        now = time.perf_counter()
        row = {"step": result.step, "wall_s": round(now - previous, 2), "rollout_s": round(gathered[result.step - 1], 2),
               **{k: round(float(v), 4) for k, v in m.items() if k.startswith(("time/", "pipeline/"))},
               **{k: round(float(m[k]), 4) for k in ("reward_mean", "loss", "tokens_trained", "mismatch_kl",
                                                     "zero_variance_groups", "skipped_nonfinite") if k in m}}
        previous = now
        steps.append(row)
        print(json.dumps({"pipelined": pipelined, **row}), flush=True)
        if now - started > budget_s:
            out["stopped_early"] = f"time budget {budget_s:.0f} s reached after {len(steps)} steps"
            break
    out["steps"] = steps
    out["training_s"] = round(time.perf_counter() - started, 1)
    # Rates from step 2 on: the first curve's step 1 carries Unsloth's compile, which the second curve skips;
    # the median step too, since one step that meets a new shape recompiles (seen: 11 s among 1.5 s steps)
    timed = [row["wall_s"] for row in steps[1:]] or [row["wall_s"] for row in steps]
    out["steps_per_hour"] = round(3600 * len(timed) / sum(timed), 1) if timed else None
    out["median_step_s"] = round(statistics.median(timed), 3) if timed else None
    mark = time.perf_counter()
    out["trained_step"] = await model.get_step()
    out["trained"] = await ttt.evaluate(model, args.eval_games, args.eval_seed, concurrency=64)
    out["trained_eval_s"] = round(time.perf_counter() - mark, 1)
    out["time_split_mean_s"] = mean_split(steps[1:] or steps)  # step 1 carries the compile
    out["history"] = backend._state(model).store.read_history()
    return out


def draw(results: dict[str, Any], out: Path) -> str:
    """reward_curve.png from the run's history; matplotlib is not on every GPU image, so
    `--plot-from tictactoe.json` redraws it later on any machine that has it."""
    try:
        from art_nb.notebook.plots import plot_reward_curve

        gpu = results.get("environment", {}).get("gpu") or "GPU"
        plot_reward_curve(results["history"], out / "reward_curve.png",
                          title=f"SmolLM2-135M tic-tac-toe, vLLM + Unsloth ({gpu})")
        curves = results.get("curves", {})
        if len(curves) > 1:
            import matplotlib.pyplot as plt

            fig, (reward, kl) = plt.subplots(1, 2, figsize=(10, 3.6))
            for mode, done in curves.items():
                steps = [row["step"] for row in done["steps"]]
                label = f"{mode} ({done['steps_per_hour']:.0f} steps/hour from step 2)"
                reward.plot(steps, [row.get("reward_mean") for row in done["steps"]], marker="o", label=label)
                kl.plot(steps, [row.get("mismatch_kl") for row in done["steps"]], marker="o", label=mode)
            reward.set(xlabel="step", ylabel="mean reward of the step's games", title="tic-tac-toe, SmolLM2-135M")
            kl.set(xlabel="step", ylabel="mismatch KL (engine -> trainer)", title="how off-policy the data was")
            reward.legend(fontsize=8)
            kl.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(out / "reward_curve_pipeline.png", dpi=120)
            return "reward_curve.png, reward_curve_pipeline.png"
        return "reward_curve.png"
    except ImportError as exc:
        return f"not drawn here ({exc}); redraw with --plot-from"


def mean_split(steps: list[dict[str, float]]) -> dict[str, float]:
    keys = ("wall_s", "rollout_s", "time/pause", "time/train", "time/save", "time/swap", "time/step_total")
    return {k: round(sum(s.get(k, 0.0) for s in steps) / max(len(steps), 1), 3) for k in keys}


def environment() -> dict[str, Any]:
    return _gpu_helpers().environment()


def _gpu_helpers() -> Any:
    """tests/gpu/conftest.py, loaded by path (a `tests` package elsewhere on sys.path could shadow ours)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("art_nb_gpu_helpers", ROOT / "tests" / "gpu" / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    if args.plot_from is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        print(draw(json.loads(args.plot_from.read_text()), args.out))
        return
    results = asyncio.run(run(args))
    keys = ("valid_move_rate", "win", "invalid", "reward")
    print("base   :", {k: round(results["base"][k], 3) for k in keys})
    for mode, done in results["curves"].items():
        print(f"{mode:9}:", {k: round(done["trained"][k], 3) for k in keys}, f"(step {done['trained_step']}, "
              f"{done['steps_per_hour']} steps/hour)")
        print("  mean step time split (s):", done["time_split_mean_s"])


if __name__ == "__main__":
    main()
