"""What the transformers engine's prefix cache saves on multi-turn rollouts: the same games with it off and on.

A rollout's every turn sends the whole conversation again; without the cache the engine prefills it
from the start each time, so a long game costs quadratic prefill. Two workloads shaped like the
notebooks' games, through the path a rollout takes (`model.openai_client()` -> art_nb's endpoint ->
`HFEngine`, in `LocalBackend`):

- tic-tac-toe: 2 groups of 2 games, 9 turns each, replies of up to 16 tokens, the env's messages;
- 2048-like: 1 group of 2 games, 40 turns each, replies of up to 8 tokens. Each turn's user message
  is the board alone (~28 tokens; the env's full message, ~60 tokens with the valid moves and the
  format reminder, with `--full-messages`), so the quadratic baseline fits the default run: with the
  full messages the 2 games alone took 640 s with the cache off (9.0x slower than on);
- the CPU demo's evaluation (`art_nb.demo`): 32 real tic-tac-toe games, greedy, 8 at a time, the
  model's replies deciding the game (`envs.tic_tac_toe.rollout`); the base model's invalid moves end
  most games early, so this shows the cache where conversations are short.

Each game starts from its group's board (the games of a group share their first prompt, as GRPO
groups do) and the board then moves on by a per-game seeded script, not by the model's reply: an
untrained model mostly answers off-format, and a scripted game keeps the work identical in both
modes. Real prompts: the envs' system prompt, worked example and user message. Greedy decoding, so
both modes must produce the very same replies (checked, token ids and text).

The modes alternate (off, on, then on, off, ...) on one engine, its cache cleared before each run
(`engine.prefix_cache.resize`/`clear`). Each run records wall and CPU seconds, the 1-minute load
average, and the engine's counters (prompt tokens prefilled and reused, hits, decode steps). The
ratio is off time / on time. Default run: ~10 minutes on a 2-core machine.

    .venv/bin/python bench/hf_prefix_cache.py [--repeats 1] [--groups G --games N] [--full-messages] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, Results, loadavg, peak_rss_mib, stats


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    turns: int
    max_tokens: int
    groups: int
    games: int  # per group
    full_messages: bool = True  # the env's user message; else the board alone


WORKLOADS = {"tic_tac_toe": Workload("tic_tac_toe", 9, 16, groups=2, games=2),
             "game_2048": Workload("game_2048", 40, 8, groups=1, games=2, full_messages=False),
             "demo_eval": Workload("demo_eval", 9, 16, groups=1, games=32)}
DEMO_EVAL_SEED, DEMO_EVAL_CONCURRENCY = 10_000, 8  # art_nb.demo's evaluation: DemoConfig.eval_seed, evaluate()'s default


def scripted_game(workload: Workload, group: int, game: int) -> tuple[list[dict[str, str]], list[str]]:
    """The opening messages (system prompt, worked example) and the user message of every turn.

    The first board is the group's; from the second turn on, each game's own seeded moves change it.
    """
    if workload.name == "tic_tac_toe":
        from art_nb.envs import tic_tac_toe as env

        rng = random.Random(group)
        board = env.empty_board()
        for mark in "OX"[: rng.randint(0, 2)]:
            board = env.place(board, rng.choice(env.legal_moves(board)), mark)
        rng = random.Random(f"{group}/{game}")
        boards = [board]
        for turn in range(1, workload.turns):
            if not env.legal_moves(board) or env.winner(board):
                board = env.empty_board()  # a finished board starts over: the conversation goes on
            board = env.place(board, rng.choice(env.legal_moves(board)), "XO"[turn % 2])
            boards.append(board)
        return [{"role": "system", "content": env.SYSTEM_PROMPT}, *env.EXAMPLE_TURN], [env.user_message(b) for b in boards]

    from art_nb.envs import game_2048 as env

    board = env.new_board(random.Random(group))
    rng = random.Random(f"{group}/{game}")
    boards = [board]
    for _ in range(1, workload.turns):
        moves = env.valid_moves(board)
        board = env.spawn_tile(env.slide(board, rng.choice(moves)), rng) if moves else env.new_board(rng)
        boards.append(board)
    message = env.user_message if workload.full_messages else env.render
    return [{"role": "system", "content": env.SYSTEM_PROMPT}, *env.EXAMPLE_TURN], [message(b) for b in boards]


async def play(model: Any, workload: Workload, group: int, game: int) -> dict[str, Any]:
    """One scripted game through the endpoint; its replies (text and token ids) and final prompt length."""
    client = model.openai_client()
    messages, users = scripted_game(workload, group, game)
    replies: list[list[int]] = []
    prompt_tokens = 0
    for text in users:
        messages.append({"role": "user", "content": text})
        response = await client.chat.completions.create(
            model=model.name, messages=messages, max_completion_tokens=workload.max_tokens, temperature=0.0)
        choice = response.choices[0]
        replies.append(choice.model_extra["token_ids"])
        prompt_tokens = response.usage.prompt_tokens
        messages.append({"role": "assistant", "content": choice.message.content or ""})
    return {"replies": replies, "text": [m["content"] for m in messages if m["role"] == "assistant"],
            "last_prompt_tokens": prompt_tokens}


async def play_demo_game(model: Any, seed: int, slots: asyncio.Semaphore) -> dict[str, Any]:
    """One game of the CPU demo's evaluation: the env's own rollout, greedy."""
    from art_nb.envs import tic_tac_toe as env

    async with slots:
        trajectory = await env.rollout(model, env.TicTacToeScenario(seed=seed), temperature=0.0)
    return {"replies": [c.model_extra["token_ids"] for c in trajectory.choices()],
            "text": [m["content"] for m in trajectory.messages() if m["role"] == "assistant"][1:],  # [0]: the example
            "reward": trajectory.reward, "last_prompt_tokens": None}


def games(model: Any, workload: Workload) -> list[Any]:
    if workload.name == "demo_eval":
        slots = asyncio.Semaphore(DEMO_EVAL_CONCURRENCY)
        return [play_demo_game(model, DEMO_EVAL_SEED + i, slots) for i in range(workload.games)]
    return [play(model, workload, g, i) for g in range(workload.groups) for i in range(workload.games)]


async def run_once(model: Any, engine: Any, workload: Workload, cached: bool, budget: int) -> dict[str, Any]:
    """Every game of every group at once (as `gather_trajectory_groups` runs them), the cache on or off."""
    engine.prefix_cache.resize(budget if cached else 0)
    engine.prefix_cache.clear()
    before = dataclasses.asdict(engine.stats)
    load = loadavg()
    started, cpu = time.perf_counter(), time.process_time()
    played = await asyncio.gather(*games(model, workload))
    seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    after = dataclasses.asdict(engine.stats)
    counters = {k: after[k] - before[k] for k in after if k != "max_batch_size"}
    return {"cached": cached, "seconds": round(seconds, 3), "cpu_s": round(cpu_s, 3), "loadavg_before": load,
            "loadavg_after": loadavg(), "engine": counters, "cache_entries_after": len(engine.prefix_cache),
            "cache_mib_after": round(engine.prefix_cache.nbytes / 2**20, 1), "games": played}


async def run(args: argparse.Namespace, results: Results) -> None:
    import art_nb as art
    from art_nb.local.plan.base_models import TINY_MODEL

    model = art.TrainableModel(name="bench-prefix", project="bench", base_model=args.model or TINY_MODEL,
                               config=art.ModelConfig(engine="hf", max_seq_len=args.max_seq_len))
    backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="art_nb_bench_"))
    await model.register(backend)
    results.data["choices"] = backend.choices(model)
    engine = backend._state(model).engine  # the engine LocalBackend built, to switch its cache and read its counters
    budget = engine.prefix_cache.budget  # the default: a share of the machine's memory
    results.data["prefix_cache_budget_mib"] = round(budget / 2**20)
    await model.openai_client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4)  # warm-up

    for name in args.workloads:
        workload = dataclasses.replace(WORKLOADS[name], groups=args.groups or WORKLOADS[name].groups,
                                       games=args.games or WORKLOADS[name].games,
                                       full_messages=args.full_messages or WORKLOADS[name].full_messages)
        with results.section(name) as entry:
            runs: list[dict[str, Any]] = []
            for repeat in range(args.repeats):
                for cached in ((False, True) if repeat % 2 == 0 else (True, False)):
                    outcome = await run_once(model, engine, workload, cached, budget)
                    outcome["repeat"] = repeat
                    runs.append(outcome)
                    print(f"  {name} repeat {repeat} cache {'on ' if cached else 'off'}: {outcome['seconds']:.1f} s, "
                          f"prefilled {outcome['engine']['prefilled_tokens']}, reused {outcome['engine']['reused_tokens']}",
                          flush=True)
            off = [r for r in runs if not r["cached"]]
            on = [r for r in runs if r["cached"]]
            same = all(r["games"] == off[0]["games"] for r in runs)
            median = {"off": stats([r["seconds"] for r in off])["median"], "on": stats([r["seconds"] for r in on])["median"]}
            speedup = median["off"] / median["on"]
            per_repeat = [round(a["seconds"] / b["seconds"], 3) for a, b in zip(off, on, strict=True)]
            prefilled = {k: stats([r["engine"]["prefilled_tokens"] for r in v])["median"] for k, v in (("off", off), ("on", on))}
            longest = max(g["last_prompt_tokens"] or 0 for g in off[0]["games"]) or None
            requests = sum(len(g["replies"]) for g in off[0]["games"])
            for r in runs[1:]:
                r.pop("games")  # the first run's games are kept; the others were checked equal to them
            entry.update(
                workload=dataclasses.asdict(workload), requests=requests,
                longest_prompt_tokens=longest, runs=runs,
                seconds={"off": stats([r["seconds"] for r in off]), "on": stats([r["seconds"] for r in on])},
                cpu_seconds={"off": stats([r["cpu_s"] for r in off]), "on": stats([r["cpu_s"] for r in on])},
                speedup=round(speedup, 3), speedup_per_repeat=per_repeat, prefilled_tokens=prefilled,
                same_replies=same,
                summary=f"{name}: {workload.groups}x{workload.games} games, {requests} requests"
                        f"{f' (prompts up to {longest} tokens)' if longest else ''}: cache off {median['off']:.1f} s, on {median['on']:.1f} s -> "
                        f"{speedup:.2f}x (per repeat {per_repeat}); prompt tokens prefilled {prefilled['off']:.0f} -> "
                        f"{prefilled['on']:.0f}; same replies: {same}",
            )
    results.data["peak_rss_mib"] = peak_rss_mib()
    await backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--groups", type=int, default=None, help="groups per workload, each sharing a first board "
                        "(default: 2 for tic-tac-toe, 1 for 2048)")
    parser.add_argument("--games", type=int, default=None, help="games per group (default 2)")
    parser.add_argument("--full-messages", action="store_true", help="2048: the env's whole user message, not the board alone")
    parser.add_argument("--repeats", type=int, default=1, help="off/on pairs per workload, order alternating")
    parser.add_argument("--model", default=None, help="base model (default: SmolLM2-135M-Instruct, art_nb's copy)")
    parser.add_argument("--max-seq-len", type=int, default=4096, help="2048 games reach ~2,000 tokens, ~3,400 with --full-messages")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "hf_prefix_cache.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results = Results(args.out, benchmark="hf_prefix_cache",
                      model=args.model or "HuggingFaceTB/SmolLM2-135M-Instruct (art_nb's offline GGUF copy), HF engine",
                      sampling={"temperature": 0.0, "note": "greedy: both modes must give the same replies"})
    asyncio.run(run(args, results))
    results.save()


if __name__ == "__main__":
    main()
