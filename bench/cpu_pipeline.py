"""art.pipeline on a CPU: steps per hour pipelined vs the synchronous loop, same run, same model.

What the plan's "pipeline off: CPU" rests on. SmolLM2-135M-Instruct (art_nb's offline copy) plays
tic-tac-toe through `LocalBackend` on this machine's CPU (transformers engine, peft trainer, the
plan's threads), G openings x R games a step, and trains on them: the notebook's loop, once with
`art.pipeline(..., enabled=False)` (gather, then train) and once with `enabled=True` (the next
step's games are played while the step trains, from the adapter before it). Rollouts and training
then share the cores.

One process and one model; the two loops take turns (a warm-up turn each, then `--rounds` rounds in
rotating order, `--steps` steps a turn) so a slow spell of this shared machine falls on both alike.
A turn's seconds per step run from its first step's end to its last's; the comparison is the median
of each side's turns with the spread and the per-round ratios (`_common.head_to_head`). Each step
also records how off-policy its data was (`pipeline/lag_steps`) and the engine/trainer mismatch KL.

    .venv/bin/python bench/cpu_pipeline.py                      # ~20 min on a quiet 2-core box
    .venv/bin/python bench/cpu_pipeline.py --groups 2 --group-size 2 --steps 2 --rounds 1 --out /tmp/p.json  # a dry run
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (ROOT, Results, current_rss_mib, describe_ratio, head_to_head, interleaved, loadavg, peak_rss_mib,
                     wait_for_memory)

SIDES = ("synchronous", "pipelined")
LEARNING_RATE = 2e-4  # the CPU demo's rate for SmolLM2-135M in a short run (plan/rates.py)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2, help="openings per step")
    parser.add_argument("--group-size", type=int, default=4, help="games per opening")
    parser.add_argument("--steps", type=int, default=3, help="steps per turn")
    parser.add_argument("--rounds", type=int, default=3, help="turns per side, interleaved")
    parser.add_argument("--need-gib", type=float, default=4.0, help="free memory to wait for before each turn")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_pipeline.json")
    return parser.parse_args(argv)


async def run(args: argparse.Namespace, results: Results) -> None:
    import art_nb as art
    from art_nb.envs import tic_tac_toe as ttt
    from art_nb.local.plan.base_models import TINY_MODEL

    model = art.TrainableModel(name="cpu-pipeline", project="bench", base_model=TINY_MODEL,
                               config=art.ModelConfig(max_seq_len=1024, lora=art.LoraConfig(rank=16, alpha=32)))
    backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="art_nb_bench_"))
    mark = time.perf_counter()
    await model.register(backend)
    results.data["register_s"] = round(time.perf_counter() - mark, 1)
    results.data["choices"] = backend.choices(model)
    config = art.TrainConfig(learning_rate=LEARNING_RATE, loss="ppo")  # what the demo and notebooks train with
    sections = results.data["sections"]

    async def turn(side: str, steps: int) -> dict[str, Any]:
        timeline: list[list[Any]] = []
        origin = time.perf_counter()

        async def gather(step: int) -> list[art.TrajectoryGroup]:
            begun = time.perf_counter() - origin
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(ttt.rollout(model, ttt.TicTacToeScenario(seed=step * 1000 + g))
                                     for _ in range(args.group_size)) for g in range(args.groups)),
                pbar_desc=None, max_exceptions=0.1)
            timeline.append(["gather", step, round(begun, 3), round(time.perf_counter() - origin, 3)])
            return groups

        rows = []
        load = loadavg()
        first = await model.get_step()
        async for groups in art.pipeline(model, gather, first + steps, enabled=side == "pipelined"):
            begun = time.perf_counter() - origin
            result = await model.train(groups, config=config)
            end = time.perf_counter() - origin
            timeline.append(["train", result.step - 1, round(begun, 3), round(end, 3)])
            m = result.metrics
            rows.append({"step": result.step, "end_s": round(end, 3), "reward": m.get("reward_mean", m.get("reward")),
                         **{k: round(float(m[k]), 4) for k in ("time/train", "time/pause", "time/swap", "mismatch_kl",
                                                               "pipeline/lag_steps", "pipeline/beside") if k in m}})
        ends = [r["end_s"] for r in rows]
        beside = sum(max(0.0, min(g[3], t[3]) - max(g[2], t[2])) for g in timeline if g[0] == "gather"
                     for t in timeline if t[0] == "train")
        return {"side": side, "steps": rows, "timeline": timeline, "loadavg_before": load, "loadavg_after": loadavg(),
                "rss_mib_after": current_rss_mib(),
                "s_per_step": round((ends[-1] - ends[0]) / (len(ends) - 1), 3) if len(ends) > 1 else ends[-1],
                "rollouts_beside_training_s": round(beside, 3)}

    plan = [[(side, 1, True) for side in SIDES]] + [[(side, args.steps, False) for side in order]
                                                    for order in interleaved(list(SIDES), args.rounds)]
    for round_ in plan:
        for side, steps, warmup in round_:
            entry = sections.setdefault(side, {"turns": []})
            waited = await asyncio.to_thread(wait_for_memory, args.need_gib)
            done = await turn(side, steps)
            entry["turns"].append({**done, "warmup": warmup, "waited_for_memory_s": waited})
            timed = [t["s_per_step"] for t in entry["turns"] if not t["warmup"]]
            entry.update(status="ok", summary=f"{len(timed)} turns: {timed} s/step")
            results.data["peak_rss_mib"] = peak_rss_mib()
            results.save()
            print(f"[{side}] {'warm-up' if warmup else 'turn'}: {done['s_per_step']:.1f} s/step "
                  f"(load {done['loadavg_before']} -> {done['loadavg_after']}, RSS {done['rss_mib_after']:.0f} MiB)",
                  flush=True)
    await backend.close()


def compare(sections: dict[str, Any]) -> dict[str, Any]:
    per_turn = {side: [t["s_per_step"] for t in sections.get(side, {}).get("turns", []) if not t["warmup"]]
                for side in ("pipelined", "synchronous")}
    h2h = head_to_head({k: v for k, v in per_turn.items() if v}, unit="s per step")
    out: dict[str, Any] = {"head_to_head": h2h,
                           "steps_per_hour": {side: round(3600 / e["median"], 1) for side, e in h2h["sides"].items()}}
    pair = "synchronous/pipelined"
    if pair in h2h["ratios"]:
        ratio = h2h["ratios"][pair]
        out["pipelined_speedup"] = ratio["of_medians"]
        out["summary"] = (f"pipelined {out['steps_per_hour']['pipelined']:.0f} vs synchronous "
                          f"{out['steps_per_hour']['synchronous']:.0f} steps/hour: {describe_ratio(h2h, pair)} the "
                          "synchronous loop's rate")
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from art_nb.local.plan.threads import choose_cpu_threads

    threads, why = choose_cpu_threads()
    results = Results(args.out, benchmark="cpu_pipeline", threads=threads, threads_reason=why,
                      model="HuggingFaceTB/SmolLM2-135M-Instruct (art_nb's offline GGUF copy, float32)",
                      settings={"groups": args.groups, "group_size": args.group_size, "steps_per_turn": args.steps,
                                "rounds": args.rounds, "learning_rate": LEARNING_RATE, "loss": "ppo",
                                "task": "tic-tac-toe (art_nb.envs.tic_tac_toe), 16 completion tokens a move"},
                      method="one process and model; the synchronous loop and art.pipeline(enabled=True) take turns "
                             "(a 1-step warm-up turn each, then rounds in rotating order); seconds per step = from a "
                             "turn's first step end to its last, over the steps between")
    asyncio.run(run(args, results))
    with results.section("comparison") as entry:
        entry.update(compare(results.data["sections"]))


if __name__ == "__main__":
    main()
