"""Does the 2048 notebook's GPU configuration fit a 15 GB GPU (a Colab T4)? Measured on a bigger GPU, capped.

The configuration (art_nb/notebook/hardware.py, task "2048" on a GPU): 8 groups x 8 rollouts per step,
max_seq_len 4096, LoRA rank 16 (alpha 32), here with the issue's Qwen2.5-3B-shaped model (RANDOM
WEIGHTS, SmolLM2 tokenizer: no hub on the GPU machine) and the trainer in 4-bit (Unsloth, NF4); vLLM
serves the same NF4 weights where it has bitsandbytes (`ModelConfig.vllm_4bit`, `--vllm-4bit off` for
bf16 weights), started as the notebook starts it (`--startup`, art_nb's default "fast": CUDA graphs for
decode, which cost memory), and sleeps during the step when training would not fit beside it.

The cap, in this one process: `torch.cuda.set_per_process_memory_fraction` to the cap less the CUDA
context (a real 15 GiB GPU has that much less free too) before any allocation (bounds PyTorch's
allocator: the trainer, vLLM's weights, KV cache and activations); art_nb's memory plan
reads the fraction back and plans vLLM's share within the cap (`local/engines/vllm/args._plannable_memory`), as a
user's capped process gets it. What is reported: device-wide used memory (total - free, what
nvidia-smi shows), polled every 50 ms through registration, rollouts and one full train step (sleep,
train, save, wake, LoRA load), and `torch.cuda.max_memory_reserved`; the headroom under the cap after
register. It fits when the polled peak stays under the cap; the goal is a peak under 12 GiB.

Rollouts are synthetic 2048 games through the OpenAI endpoint: the notebook's prompts and boards,
turns of fixed length (`ignore_eos`), continued until the conversation nears max_seq_len, so the
step trains on full-length sequences (the worst case for memory). On a real T4 (sm75) art_nb serves
with the transformers engine, not vLLM (no vLLM attention backend for Turing after 0.11.2), and the
notebook picks a 0.5B model there; this measures the vLLM + Unsloth path at 3B under a T4's cap.

On the GPU machine, from the repository root, after `source .gpu/bin/env.sh`:

    python bench/gpu_memory_fit.py --out $OUT/bench            # ~6 min on an H200
    .venv-vllm/bin/python bench/gpu_memory_fit.py --quick --out /tmp/fit   # CPU dry run (no cap there)
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
    GiB,
    GpuUsedPeak,
    Results,
    cap_like_a_gpu,
    default_out_dir,
    gpu_memory,
    model_section,
    startup_env,
    startup_fields,
    weights_note,
)

LORA_RANK, LORA_ALPHA = 16, 32.0
PEAK_GOAL_GIB = 12.0  # the goal: room to spare on a T4's 15 GiB


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from art_nb.local.plan.hardware import Hardware
    from art_nb.notebook.hardware import pick_defaults

    # The notebook's own GPU shapes (an sm80+ GPU with 80 GiB).
    defaults = pick_defaults(Hardware(gpu_name="GPU", gpu_capability=(9, 0), gpu_memory_gib=80.0), task="2048")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for gpu_memory_fit.json (default $OUT)")
    parser.add_argument("--quick", action="store_true", help="CPU dry run: toy model, peft, no cap")
    parser.add_argument("--model", type=Path, default=None, help="a transformers folder instead of the random 3B")
    parser.add_argument("--cap-gib", type=float, default=15.0, help="the memory cap (a T4: 15 GiB usable)")
    parser.add_argument("--max-seq-len", type=int, default=defaults.max_seq_len)
    parser.add_argument("--groups", type=int, default=defaults.groups_per_step)
    parser.add_argument("--group-size", type=int, default=defaults.rollouts_per_group)
    parser.add_argument("--turn-tokens", type=int, default=64, help="tokens per model turn (fixed)")
    parser.add_argument("--startup", choices=STARTUP_MODES, default="fast",
                        help="how vLLM starts (art_nb's default 'fast' captures CUDA graphs: more memory)")
    parser.add_argument("--vllm-4bit", choices=("auto", "on", "off"), default="auto",
                        help="ModelConfig.vllm_4bit: auto (art_nb's default: NF4 like the 4-bit trainer when vLLM "
                             "has bitsandbytes), on, off (vLLM serves bf16 weights)")
    args = parser.parse_args(argv)
    args.out = args.out or default_out_dir()
    args.notebook_defaults = {"max_seq_len": defaults.max_seq_len, "groups_per_step": defaults.groups_per_step,
                              "rollouts_per_group": defaults.rollouts_per_group, "lora_rank": defaults.lora_rank}
    if args.quick:
        args.max_seq_len, args.groups, args.group_size, args.turn_tokens = 384, 2, 2, 16
    return args


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


async def rollout_2048(model: Any, seed: int, max_seq_len: int, turn_tokens: int) -> Any:
    """A 2048 conversation of fixed-length turns that stops when the next turn would not fit."""
    import art_nb as art
    from art_nb.envs import game_2048 as g

    rng = random.Random(seed)
    client = model.openai_client()
    items: list[Any] = [{"role": "system", "content": g.SYSTEM_PROMPT}, *g.EXAMPLE_TURN]
    used = 0
    while True:
        items.append({"role": "user", "content": g.user_message(g.new_board(rng))})
        messages = art.Trajectory(messages_and_choices=items).messages()
        completion = await client.chat.completions.create(
            model=model.name, messages=messages, max_tokens=turn_tokens, temperature=1.0, logprobs=True,
            extra_body={"ignore_eos": True})
        items.append(completion.choices[0])
        used = len(completion.model_extra["prompt_token_ids"]) + turn_tokens
        if used + 2 * turn_tokens + 120 > max_seq_len:  # room for one more board (~110 tokens) and reply
            break
    return art.Trajectory(messages_and_choices=items, reward=rng.random(), metrics={"tokens": used})


async def run(args: argparse.Namespace, results: Results, model_dir: Path) -> None:
    import art_nb as art

    os.environ.update(startup_env(args.startup))
    on_gpu = cuda()
    if on_gpu:
        with results.section("cap") as entry:
            entry.update(cap_like_a_gpu(args.cap_gib))
            entry["summary"] = f"torch capped at {args.cap_gib} GiB; art_nb plans vLLM's share within the cap"
    config = art.ModelConfig(engine="vllm", trainer="unsloth" if on_gpu else "peft", load_in_4bit=on_gpu,
                             max_seq_len=args.max_seq_len, lora=art.LoraConfig(rank=LORA_RANK, alpha=LORA_ALPHA),
                             vllm_4bit={"auto": None, "on": True, "off": False}[args.vllm_4bit],
                             **startup_fields(args.startup))
    model = art.TrainableModel(name="fit", project="bench", base_model=str(model_dir), config=config)
    backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="art_nb_bench_"))
    phases: dict[str, GpuUsedPeak] = {}

    def watch(name: str) -> Any:
        phases[name] = GpuUsedPeak() if on_gpu else None
        return phases[name] or _Nothing()

    with results.section("register") as entry:
        started = time.perf_counter()
        with watch("register"):
            await model.register(backend)
        entry.update(seconds=round(time.perf_counter() - started, 1), choices=backend.choices(model),
                     engine_reasons=getattr(backend._state(model).engine, "reasons", []))
        memory = _memory(phases["register"])
        entry.update(memory)
        if "peak_used_gib" in memory:
            entry["headroom_gib"] = round(args.cap_gib - memory["peak_used_gib"], 2)
        entry["summary"] = f"registered in {entry['seconds']} s; peak used {memory.get('peak_used_gib')} GiB"
    groups: list[Any] = []
    with results.section("rollouts") as entry:
        started = time.perf_counter()
        with watch("rollouts"):
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout_2048(model, g * 100 + i, args.max_seq_len, args.turn_tokens)
                                     for i in range(args.group_size)) for g in range(args.groups)),
                pbar_desc=None)
        lengths = [t.metrics["tokens"] for group in groups for t in group.trajectories]
        memory = _memory(phases["rollouts"])
        entry.update(seconds=round(time.perf_counter() - started, 1), trajectories=len(lengths),
                     tokens_per_trajectory={"min": min(lengths), "max": max(lengths),
                                            "mean": round(sum(lengths) / len(lengths), 1)}, **memory)
        entry["summary"] = f"{len(lengths)} rollouts of {min(lengths)}-{max(lengths)} tokens in {entry['seconds']} s; " \
                           f"peak used {memory.get('peak_used_gib')} GiB"
    with results.section("train_step") as entry:
        started = time.perf_counter()
        with watch("train"):
            trained = await model.train(groups, config=art.TrainConfig(learning_rate=1e-5))
        memory = _memory(phases["train"])
        entry.update(seconds=round(time.perf_counter() - started, 1), step=trained.step,
                     metrics={k: v for k, v in trained.metrics.items() if isinstance(v, (int, float))}, **memory)
        entry["summary"] = f"step {trained.step} in {entry['seconds']} s; peak used {memory.get('peak_used_gib')} GiB"
    with results.section("verdict") as entry:
        peaks = [results.data["sections"][s].get("peak_used_gib") for s in ("register", "rollouts", "train_step")]
        peaks = [p for p in peaks if p is not None]
        if peaks:
            import torch

            peak = max(peaks)
            entry.update(peak_used_gib=peak, cap_gib=args.cap_gib, fits=peak <= args.cap_gib,
                         goal_gib=PEAK_GOAL_GIB, goal_met=peak < PEAK_GOAL_GIB,
                         torch_max_reserved_gib=round(torch.cuda.max_memory_reserved() / GiB, 2))
            entry["summary"] = f"peak device use {peak} GiB vs cap {args.cap_gib} GiB: " + \
                               ("fits" if peak <= args.cap_gib else "DOES NOT FIT") + \
                               f"; goal < {PEAK_GOAL_GIB} GiB " + ("met" if peak < PEAK_GOAL_GIB else "MISSED")
        else:
            entry["summary"] = "no GPU: the dry run exercised the code path only"
    await backend.close()


def _memory(peak: GpuUsedPeak | None) -> dict[str, Any]:
    if peak is None:
        return {}
    return {"peak_used_gib": peak.peak_gib, "after": gpu_memory()}


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    name = "gpu_memory_fit" + ("" if args.vllm_4bit == "auto" else f"_vllm_4bit_{args.vllm_4bit}")
    results = Results(args.out / f"{name}.json", benchmark="gpu_memory_fit",
                      weights=weights_note(args.model, args.quick),
                      settings={"cap_gib": args.cap_gib, "max_seq_len": args.max_seq_len, "groups": args.groups,
                                "group_size": args.group_size, "turn_tokens": args.turn_tokens,
                                "lora_rank": LORA_RANK, "trainer": "unsloth, 4-bit (NF4)", "quick": args.quick,
                                "notebook_defaults_2048_gpu": args.notebook_defaults,
                                "vllm_startup": args.startup, "vllm_4bit": args.vllm_4bit})
    model_dir = model_section(results, args.model, args.quick)
    if model_dir is not None:
        asyncio.run(run(args, results, model_dir))


if __name__ == "__main__":  # vLLM may spawn processes: keep the entry point guarded
    main()
