"""T4 head to head: Unsloth's own T4 GRPO recipe vs art_nb's T4 configuration, both under a 15 GiB cap.

Same GPU, same cap, same model, same work per step, in one run, each side in its own process:

- `unsloth`: Unsloth's Qwen2.5-3B GRPO notebook as it runs on a Colab T4 (settings as remembered from
  its "Qwen2.5_(3B)-GRPO" notebook; not checked against a stored copy here): `FastLanguageModel
  .from_pretrained(load_in_4bit=True, fast_inference=True, max_lora_rank=64, gpu_memory_utilization=0.5,
  max_seq_length=1024)`, `get_peft_model(r=64, lora_alpha=64, the 7 projections,
  use_gradient_checkpointing="unsloth")`, TRL's `GRPOTrainer` as Unsloth patches it, with the notebook's
  `GRPOConfig` (adamw_8bit, lr 5e-6 cosine, betas 0.9/0.99, weight decay 0.1, max_grad_norm 0.1, 1 prompt
  x num_generations=8 per step, max_completion_length 200; its warmup and max_prompt_length 256 left out:
  the first does not change a step's time, the second is not in TRL 1.15) and vLLM standby
  (UNSLOTH_VLLM_STANDBY=1: vLLM sleeps while the step trains).
- `art`: art_nb's T4 configuration (fp16, the Unsloth trainer, the 4-bit base) with Unsloth's rank
  (64, alpha 64): one group of 8 rollouts of 200 tokens per step through the OpenAI endpoint,
  `model.train`. Its engine (`--art-engine`): `vllm` (default) is what the notebooks pick on a T4 with
  the T4 set installed (vLLM 0.11.2, the release Unsloth's notebooks install on a T4); on the H200 it is
  the staged vLLM 0.25, as for Unsloth's side, serving NF4 weights beside the 4-bit trainer and planning
  its share within the cap. `hf` is the transformers engine (a T4 without vLLM).
- `art_settled`, `art_in_memory`, `art_compiled` (asked for by name with `--parts`): art_nb's
  side with one thing changed, to find where its gap to Unsloth comes from (`ART_VARIANTS`): the rollouts
  wait for the previous step's checkpoint instead of decoding while it is written; that checkpoint kept on
  /dev/shm; vLLM compiled with torch.compile (FULL_AND_PIECEWISE graphs, as
  Unsloth's engine), its size pass repaired on vLLM 0.19-0.31 (`vllm_size_pass.py`). Unsloth's side records
  the seconds in vLLM's `generate` per step, so both sides' steps split into decoding and the rest.

Equal work: the same prompt per step (tic-tac-toe first turns), 8 completions of exactly 200 tokens
(`ignore_eos` on both sides; the TRL log's completion lengths are kept to show it), random rewards
(time and memory do not depend on them), fp16 on both (a T4 has no bf16). The model is a
Qwen2.5-3B-shaped model with RANDOM WEIGHTS and the SmolLM2 tokenizer, saved to disk in bf16 and
quantised to NF4 at load by both (no hub on the GPU machine).

The cap, per process, before anything touches the GPU: `torch.cuda.set_per_process_memory_fraction`
to 15 GiB less the process's CUDA context (PyTorch's allocator; `_common.cap_like_a_gpu`: a real 15 GiB GPU
has the context in it too). vLLM's pool lives outside that allocator, so Unsloth is shown
a 15 GiB device (`unsloth_zoo.vllm_utils.get_mem_info` returns the cap: every memory choice Unsloth
makes is the one it makes on a T4) and the share it then hands vLLM is rescaled from the cap to the
device (`vllm.LLM` is wrapped for that one keyword). Peak memory: device-wide used memory (total - free
from `torch.cuda.mem_get_info`, what nvidia-smi shows) sampled every 50 ms from before the model loads
to the last step, plus `torch.cuda.max_memory_reserved`. An H200 under a cap is not a T4 (far more
bandwidth and compute, sm90 kernels): the ratio, not the seconds, is what carries over.

Seconds per step: the mean over steps 2..N (step 1 carries compilation). A side stops taking steps
when the next one would pass the run's deadline (`cut_short`).

On the GPU machine, from the repository root, after `source .gpu/bin/env.sh`:

    python bench/gpu_t4_vs_unsloth.py --out $OUT/bench        # ~7 min on an H200
    .venv-vllm/bin/python bench/gpu_t4_vs_unsloth.py --quick --out /tmp/t4   # CPU dry run: art side only
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    GiB,
    GpuUsedPeak,
    Results,
    cap_like_a_gpu,
    default_out_dir,
    gpu_memory,
    head_to_head,
    measure_part,
    model_section,
    rollout_prompts,
    run_part,
    startup_env,
    startup_fields,
    stats,
    weights_note,
)

# art_nb's side as it ships ("art"), and variants that each test one cause of a gap to Unsloth: the previous
# step's checkpoint written while the rollouts decode ("art_settled" waits for it before them); of that
# checkpoint, the disk ("art_in_memory" keeps the store on /dev/shm: the host copy and the serialising stay,
# the disk and its fsync go); and vLLM without torch.compile ("art_compiled" compiles, as Unsloth's engine
# does, vLLM's size pass repaired). The host copy was the gap: copied into pageable memory it slowed the
# rollouts beside it by ~1.2 s a step; art_nb now copies into page-locked memory (engines.base.packed_copies).
ART_VARIANTS: dict[str, dict[str, Any]] = {"art": {"startup": "fast", "settle": False},
                                           "art_settled": {"startup": "fast", "settle": True},
                                           "art_in_memory": {"startup": "fast", "settle": False, "store": "/dev/shm"},
                                           "art_compiled": {"startup": "compiled", "settle": False}}
PARTS = ("unsloth", *ART_VARIANTS)
# Unsloth's Qwen2.5-3B GRPO notebook.
RECIPE: dict[str, Any] = {
    "max_seq_length": 1024, "lora_rank": 64, "gpu_memory_utilization": 0.5, "num_generations": 8,
    "max_prompt_length": 256, "max_completion_length": 200, "learning_rate": 5e-6, "adam_beta1": 0.9,
    "adam_beta2": 0.99, "weight_decay": 0.1, "max_grad_norm": 0.1, "optim": "adamw_8bit",
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
PART_BUDGET_S = {"unsloth": 290, "art": 190, "art_settled": 190, "art_in_memory": 190, "art_compiled": 250}  # H200, 5 steps: start-up, compile, steps
GENERATE_S: list[float] = []  # seconds of each `vllm.LLM.generate` call on Unsloth's side


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for gpu_t4_vs_unsloth.json (default $OUT)")
    parser.add_argument("--quick", action="store_true", help="CPU dry run: toy model, art side with peft only")
    parser.add_argument("--model", type=Path, default=None, help="a transformers folder instead of the random 3B")
    parser.add_argument("--cap-gib", type=float, default=15.0, help="the memory cap (a T4: 15 GiB usable)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None, help="completion tokens (fixed; the recipe's 200)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=["unsloth", "art"],
                        help="sides to run, in this order (the art_* variants: ART_VARIANTS)")
    parser.add_argument("--art-engine", choices=("vllm", "hf"), default="vllm",
                        help="art_nb's engine: vLLM (a T4 with the T4 set) or transformers (a T4 without vLLM)")
    parser.add_argument("--deadline-s", type=float, default=420, help="end within this long (sides cut short)")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--stop-by", type=float, default=math.inf, help=argparse.SUPPRESS)  # a time.time()
    args = parser.parse_args(argv)
    args.out = args.out or default_out_dir()
    args.steps = args.steps or (2 if args.quick else 5)
    args.tokens = args.tokens or (8 if args.quick else RECIPE["max_completion_length"])
    args.generations = 2 if args.quick else RECIPE["num_generations"]
    args.rank = 8 if args.quick else RECIPE["lora_rank"]
    args.max_seq_len = 384 if args.quick else RECIPE["max_seq_length"]
    return args


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def reward(seed: int) -> float:
    return random.Random(seed).random()


def step_summary(walls: list[float]) -> dict[str, Any]:
    """Seconds per step: every step, and the stats of steps 2..N. Step 1 compiles (~10x a later step), so a
    side that took only step 1 has no seconds per step to compare (`step_s` empty)."""
    return {"every_step_s": [round(w, 3) for w in walls], "steps_used": list(range(2, len(walls) + 1)),
            "step_s": stats(walls[1:]) if len(walls) > 1 else {}}


def next_step_would_pass(walls: list[float], stop_by: float) -> bool:
    """Whether the next step would end after `stop_by` (a time.time()): judged by the slowest later step,
    or after step 1 alone by a quarter of it (step 1 compiles; judged by itself, a side stopped after it)."""
    expected = 1.5 * max(walls[1:]) if len(walls) > 1 else 0.25 * walls[0]
    return time.time() + expected > stop_by


# ---- Unsloth's recipe -------------------------------------------------------------------------------------


def finish_part(result: dict[str, Any], peak: Any, walls: list[float], steps: int) -> None:
    """A side's tail, whether it ended or failed: stop the memory sampler, record its peak and the steps taken."""
    if peak is not None:
        import torch

        peak.__exit__(None, None, None)
        result["peak_gpu_used_gib"] = peak.peak_gib
        result["torch_max_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GiB, 2)
    result["steps"] = step_summary(walls)
    result["cut_short"] = len(walls) < steps


def show_unsloth_a_capped_gpu(cap_gib: float) -> dict[str, Any]:
    """Make Unsloth plan vLLM for a `cap_gib` device and hand vLLM that share of the real one.

    Unsloth reads the device through `unsloth_zoo.vllm_utils.get_mem_info` for every memory choice
    (standby share, KV cache, batch sizes); vLLM's share is a fraction of the whole device, so the
    `gpu_memory_utilization` Unsloth passes is rescaled by cap / device. Returns a record of both.
    """
    import torch
    import vllm
    from unsloth_zoo import vllm_utils

    cap = int(cap_gib * GiB)
    total = torch.cuda.mem_get_info()[1]
    seen: dict[str, Any] = {"unsloth_sees_total_gib": cap_gib}

    def capped_mem_info() -> tuple[int, int]:
        free, real_total = torch.cuda.mem_get_info()
        return max(0, min(free, cap - (real_total - free))), cap

    vllm_utils.get_mem_info = capped_mem_info

    class CappedLLM(vllm.LLM):  # type: ignore[misc, name-defined]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            share = kwargs.get("gpu_memory_utilization")
            if share is not None:
                kwargs["gpu_memory_utilization"] = round(share * cap / total, 4)
                seen.update(unsloth_share_of_cap=share, vllm_share_of_device=kwargs["gpu_memory_utilization"])
            seen["vllm_kwargs"] = {k: v for k, v in kwargs.items() if isinstance(v, (int, float, str, bool, type(None)))}
            super().__init__(*args, **kwargs)

        def generate(self, *args: Any, **kwargs: Any) -> Any:  # timed: how a step splits into decoding and the rest
            mark = time.perf_counter()
            try:
                return super().generate(*args, **kwargs)
            finally:
                GENERATE_S.append(time.perf_counter() - mark)

    vllm.LLM = CappedLLM  # Unsloth imports it from the package when it builds the engine
    return seen


def unsloth_part(args: argparse.Namespace, write: Any) -> dict[str, Any]:
    result: dict[str, Any] = {"recipe": RECIPE, "dtype": "float16 (a T4 has no bf16)"}
    on_gpu = cuda()
    if on_gpu:
        result["cap"] = cap_like_a_gpu(args.cap_gib)
        os.environ["UNSLOTH_VLLM_STANDBY"] = "1"  # before `import unsloth`, as its notebooks set it
    peak = GpuUsedPeak().__enter__() if on_gpu else None
    started = time.perf_counter()
    if on_gpu:
        import unsloth  # noqa: F401  (patches TRL before it is imported)
        from unsloth import FastLanguageModel
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    result["import_s"] = round(time.perf_counter() - started, 1)
    if on_gpu:
        # the dict itself: vLLM's keywords (quantization, compilation, max_loras...) arrive in it when Unsloth builds it
        result["unsloth_vllm"] = show_unsloth_a_capped_gpu(args.cap_gib)
    started = time.perf_counter()
    model_kwargs: dict[str, Any] = {}
    if on_gpu:
        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name=str(args.model), max_seq_length=args.max_seq_len, dtype=torch.float16, load_in_4bit=True,
            fast_inference=True, max_lora_rank=args.rank, gpu_memory_utilization=RECIPE["gpu_memory_utilization"])
        model = FastLanguageModel.get_peft_model(
            model, r=args.rank, target_modules=RECIPE["target_modules"], lora_alpha=args.rank,
            use_gradient_checkpointing="unsloth", random_state=3407)
    else:  # dry run: TRL's own GRPOTrainer with a peft LoRA and transformers' generate
        from peft import LoraConfig

        model, tokenizer = str(args.model), AutoTokenizer.from_pretrained(args.model)
        model_kwargs = {"peft_config": LoraConfig(r=args.rank, lora_alpha=args.rank, task_type="CAUSAL_LM",
                                                  target_modules=RECIPE["target_modules"])}
    result["load_s"] = round(time.perf_counter() - started, 1)
    if on_gpu:
        result["memory_after_load"] = gpu_memory()
    write(result)

    walls: list[float] = []
    generated: list[float] = []
    result["generate_s_per_step"] = generated  # vLLM's generate inside each step (the rest: logprobs, training)

    class StepClock(TrainerCallback):
        began = 0.0

        def on_step_begin(self, _args: Any, state: Any, control: Any, **__: Any) -> None:
            self.began = time.perf_counter()

        def on_step_end(self, _args: Any, state: Any, control: Any, **__: Any) -> None:
            walls.append(time.perf_counter() - self.began)
            generated.append(round(sum(GENERATE_S), 3))
            GENERATE_S.clear()
            print(f"Unsloth step {len(walls)}: {walls[-1]:.2f} s", flush=True)
            if next_step_would_pass(walls, args.stop_by):
                control.should_training_stop = True

    calls = iter(range(10**9))

    def random_reward(completions: list[Any], **_: Any) -> list[float]:
        return [reward(next(calls)) for _ in completions]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="unsloth_bench_"), use_vllm=on_gpu, learning_rate=RECIPE["learning_rate"],
        adam_beta1=RECIPE["adam_beta1"], adam_beta2=RECIPE["adam_beta2"], weight_decay=RECIPE["weight_decay"],
        lr_scheduler_type="cosine", optim=RECIPE["optim"] if on_gpu else "adamw_torch",
        logging_steps=1, bf16=False, fp16=on_gpu, use_cpu=not on_gpu, per_device_train_batch_size=args.generations,
        gradient_accumulation_steps=1, num_generations=args.generations,
        max_completion_length=args.tokens,  # max_prompt_length: gone from TRL 1.15 (prompts here: ~150 tokens)
        generation_kwargs={"ignore_eos": True}, max_steps=args.steps, save_strategy="no",
        max_grad_norm=RECIPE["max_grad_norm"], report_to="none", seed=0, shuffle_dataset=False)
    prompts = rollout_prompts(args.steps)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=random_reward, args=config,
                          train_dataset=prompt_dataset(prompts), callbacks=[StepClock()], **model_kwargs)
    result["config"] = {k: getattr(config, k, None) for k in ("per_device_train_batch_size", "num_generations",
                        "gradient_accumulation_steps", "max_completion_length", "fp16", "bf16", "optim", "use_vllm")}
    result["trainer_build_s"] = round(time.perf_counter() - started, 1)
    write(result)
    try:
        trainer.train()
    finally:
        finish_part(result, peak, walls, args.steps)
        result["completion_lengths"] = [h.get("completions/mean_length") for h in trainer.state.log_history
                                        if "completions/mean_length" in h]
        write(result)
    return result


def prompt_dataset(prompts: list[Any]) -> Any:
    """An in-memory `datasets.Dataset` of conversational prompts (fixed fingerprint: no dill pickling)."""
    import pyarrow as pa
    from datasets import Dataset
    from datasets.table import InMemoryTable

    return Dataset(InMemoryTable(pa.table({"prompt": prompts})), fingerprint="art_nb-bench-t4-prompts")


# ---- art_nb's T4 configuration ----------------------------------------------------------------------------


async def art_part(args: argparse.Namespace, write: Any) -> dict[str, Any]:
    on_gpu = cuda()
    variant = ART_VARIANTS[args.part]
    result: dict[str, Any] = {"variant": variant}
    if on_gpu:
        result["cap"] = cap_like_a_gpu(args.cap_gib)
    peak = GpuUsedPeak().__enter__() if on_gpu else None
    import art_nb as art

    engine = args.art_engine if on_gpu else "hf"
    if engine == "vllm":
        os.environ.update(startup_env(variant["startup"]))
        if variant["startup"] == "compiled":
            result["size_pass_repaired"] = repair_vllm_size_pass()
    config = art.ModelConfig(engine=engine, trainer="unsloth" if on_gpu else "peft", dtype="float16" if on_gpu else "auto",
                             load_in_4bit=on_gpu, max_seq_len=args.max_seq_len,
                             lora=art.LoraConfig(rank=args.rank, alpha=float(args.rank),
                                                 target_modules=tuple(RECIPE["target_modules"])),
                             max_batch_size=args.generations, **(startup_fields(variant["startup"]) if engine == "vllm" else {}))
    result["config"] = config.model_dump(mode="json")
    model = art.TrainableModel(name="t4", project="bench", base_model=str(args.model), config=config)
    backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="art_nb_bench_", dir=variant.get("store")))
    started = time.perf_counter()
    await model.register(backend)
    result["register_s"] = round(time.perf_counter() - started, 1)
    result["choices"] = backend.choices(model)
    if on_gpu:
        result["memory_after_register"] = gpu_memory()
    write(result)
    client = model.openai_client()
    prompts = rollout_prompts(args.steps)
    train = art.TrainConfig(learning_rate=RECIPE["learning_rate"], max_grad_norm=RECIPE["max_grad_norm"],
                            weight_decay=RECIPE["weight_decay"], adam_betas=(RECIPE["adam_beta1"], RECIPE["adam_beta2"]))

    async def one(messages: list[dict[str, str]], seed: int) -> Any:
        completion = await client.chat.completions.create(
            model=model.name, messages=messages, max_tokens=args.tokens, temperature=1.0,
            extra_body={"ignore_eos": True})
        return art.Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=reward(seed),
                              metrics={"completion_tokens": completion.usage.completion_tokens})

    walls: list[float] = []
    result["step_rows"] = []
    try:
        for step in range(args.steps):
            if walls and next_step_would_pass(walls, args.stop_by):
                break
            mark = time.perf_counter()
            waited = 0.0
            if variant["settle"]:  # the previous step's checkpoint lands before the rollouts start
                await backend.wait_for_checkpoint(model)
                waited = time.perf_counter() - mark
            groups = await art.gather_trajectory_groups(
                [art.TrajectoryGroup(one(prompts[step], step * 100 + i) for i in range(args.generations))],
                pbar_desc=None)
            rollout_s = time.perf_counter() - mark - waited
            trained = await model.train(groups, config=train)
            walls.append(time.perf_counter() - mark)
            lengths = [t.metrics["completion_tokens"] for g in groups for t in g.trajectories]
            result["step_rows"].append({"step": trained.step, "wall_s": round(walls[-1], 3),
                                        "rollout_s": round(rollout_s, 3), "checkpoint_wait_s": round(waited, 3),
                                        "completion_tokens": lengths,
                                        **{k: round(float(v), 4) for k, v in trained.metrics.items()
                                           if k.startswith("time/")}})
            print(result["step_rows"][-1], flush=True)
            write(result)
    finally:
        finish_part(result, peak, walls, args.steps)
        write(result)
    await backend.close()
    return result


# ---- the run -------------------------------------------------------------------------------------------


def run_one_part(args: argparse.Namespace) -> None:
    measure_part(args.out, args.part,
                 lambda write: unsloth_part(args, write) if args.part == "unsloth" else asyncio.run(art_part(args, write)))


def repair_vllm_size_pass() -> bool:
    """Let this vLLM compile with LoRA (vllm_size_pass.py) and art_nb keep "compiled" (its start-up rule would
    otherwise start "fast" on vLLM 0.19-0.31); False when this vLLM has no such pass."""
    import vllm_size_pass

    from art_nb.local.engines.vllm import startup

    repaired = vllm_size_pass.install()
    if repaired:
        startup._compile_fails_with_lora = lambda: None
    return repaired


def compare(sections: dict[str, Any]) -> dict[str, Any]:
    """art_nb's seconds per step and peak memory over Unsloth's; the goal: <= 1.0x time at <= its memory."""
    art, uns = sections.get("art", {}), sections.get("unsloth", {})
    mean = lambda part: part.get("steps", {}).get("step_s", {}).get("mean")
    out: dict[str, Any] = {"art_nb_step_s": mean(art), "unsloth_step_s": mean(uns),
                           "art_nb_peak_gib": art.get("peak_gpu_used_gib"), "unsloth_peak_gib": uns.get("peak_gpu_used_gib"),
                           "goal": "art_nb step time <= 1.0x Unsloth's, at <= its peak memory",
                           "memory_measure": "device-wide used memory (total - free), sampled every 50 ms"}
    verdict = []
    # Each side's steps 2..N are its repeats: the median with the spread, the ratio with its per-step range.
    # Not interleaved: each side needs the GPU to itself at start-up for its 15 GiB cap (cap_like_a_gpu
    # counts whatever else holds memory as its own context), so the sides run one after the other.
    later = {name: part.get("steps", {}).get("every_step_s", [])[1:] for name, part in (("art", art), ("unsloth", uns))}
    h2h = head_to_head({name: values for name, values in later.items() if values}, unit="s per step")
    out["head_to_head"] = {**h2h, "interleaved": False}
    if out["art_nb_step_s"] and out["unsloth_step_s"]:
        out["art_nb_over_unsloth_time"] = round(out["art_nb_step_s"] / out["unsloth_step_s"], 3)
        out["time_goal_met"] = out["art_nb_over_unsloth_time"] <= 1.0
        verdict.append(f"art_nb / Unsloth step time = {out['art_nb_over_unsloth_time']:.2f}")
    if "unsloth/art" in h2h["ratios"]:
        ratio = h2h["ratios"]["unsloth/art"]
        out["art_nb_over_unsloth_median"] = round(1 / ratio["of_medians"], 3)
        verdict.append(f"medians {out['art_nb_over_unsloth_median']:.2f} (per step "
                       f"{1 / ratio['max']:.2f}-{1 / ratio['min']:.2f}{'' if ratio['holds'] else ', NOT settled'})")
    if out["art_nb_peak_gib"] and out["unsloth_peak_gib"]:
        out["memory_goal_met"] = out["art_nb_peak_gib"] <= out["unsloth_peak_gib"]
        verdict.append(f"peak {out['art_nb_peak_gib']} vs {out['unsloth_peak_gib']} GiB")
    for name in ART_VARIANTS:
        if name != "art" and mean(sections.get(name, {})) and out["unsloth_step_s"]:
            out[f"{name}_over_unsloth_time"] = round(mean(sections[name]) / out["unsloth_step_s"], 3)
            verdict.append(f"{name} / Unsloth {out[f'{name}_over_unsloth_time']:.2f}")
    out["verdict"] = "; ".join(verdict) or "incomplete"
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.part:
        run_one_part(args)
        return
    started, stop_by = time.monotonic(), time.time() + args.deadline_s
    results = Results(args.out / "gpu_t4_vs_unsloth.json", benchmark="gpu_t4_vs_unsloth",
                      weights=weights_note(args.model, args.quick),
                      settings={"cap_gib": args.cap_gib, "steps": args.steps, "completion_tokens": args.tokens,
                                "generations": args.generations, "lora_rank": args.rank, "quick": args.quick,
                                "max_seq_len": args.max_seq_len, "dtype": "float16", "base": "4-bit (NF4)",
                                "art_engine": args.art_engine, "art_variants": ART_VARIANTS,
                                "not_a_t4": "an H200 under a 15 GiB cap: same memory, far more bandwidth and compute"})
    model_dir = model_section(results, args.model, args.quick)
    if model_dir is None:
        return
    parts = [p for p in args.parts if cuda() or p in ART_VARIANTS or args.quick]
    for part in parts:
        left = args.deadline_s - (time.monotonic() - started)
        with results.section(part) as entry:
            if left < 90 and not args.quick:
                raise RuntimeError(f"skipped: {left:.0f} s left of the {args.deadline_s:.0f} s deadline; run it "
                                   f"alone with --parts {part}")
            # each side gets its share of what is left, so the first cannot starve the second
            share = PART_BUDGET_S[part] / sum(PART_BUDGET_S[p] for p in parts[parts.index(part):])
            own_stop = time.time() + left * share if not args.quick else stop_by
            argv = ["--out", str(args.out), "--model", str(model_dir), "--cap-gib", str(args.cap_gib), "--steps",
                    str(args.steps), "--tokens", str(args.tokens), "--stop-by", str(own_stop - 10),
                    "--art-engine", args.art_engine]
            entry.update(run_part(Path(__file__), part, argv + (["--quick"] if args.quick else []), args.out,
                                  timeout_s=1800 if args.quick else max(own_stop - time.time() + 30, 60)))
            if "error" in entry:
                raise RuntimeError(entry["error"])
            step = entry.get("steps", {}).get("step_s", {}).get("mean")
            entry["summary"] = (f"{step:.2f} s/step over steps {entry['steps']['steps_used']}" if step
                                else "no step after the first (which compiles): no seconds per step") + \
                               f"; peak {entry.get('peak_gpu_used_gib', '-')} GiB" + (" (cut short)" if entry.get("cut_short") else "")
    with results.section("comparison") as entry:
        entry.update(compare(results.data["sections"]))
        entry["summary"] = entry["verdict"]


if __name__ == "__main__":  # vLLM may spawn processes: keep the entry point guarded
    main()
