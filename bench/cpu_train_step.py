"""One GRPO training step on CPU: art_nb's PeftTrainer against TRL's GRPOTrainer, on the same tokens.

The batch is real: tic-tac-toe games played by SmolLM2-135M-Instruct through art_nb's own OpenAI
endpoint (the CPU notebook's shape: 4 groups x 6 games, LoRA rank 16 on every linear layer), saved
once to bench/results/cpu_train_step_batch.json so both sides train on exactly the same token ids,
masks, engine logprobs and advantages. Generation is excluded on both sides.

- art_nb: `PeftTrainer.train_step(groups)`, i.e. `prepare_batch` (chat template + tokenisation, which
  TRL does during generation and so is *not* timed on its side) + `grpo_step` (length-sorted
  microbatches, forward, PPO-clip loss against the engine's logprobs, backward, clip, AdamW).
- TRL: a `GRPOTrainer` built from the model path with a peft `LoraConfig` (its own loading path and
  its fused LM head), fed the dict its `_generate_and_score_completions` produces for multi-turn
  rollouts: prompt (left-padded) + completion (right-padded, the later turns included) with
  `tool_mask` marking the sampled tokens, advantages and `old_per_token_logps` (the engine's). Then
  `compute_loss` + `accelerator.backward` per gradient-accumulation chunk, clip, `optimizer.step()`.
  Same loss ("grpo": per-sequence token mean, then mean over sequences; beta 0; epsilon 0.2), fp32,
  no gradient checkpointing, the same number of microbatches as art_nb's step uses.

Each side runs in its own subprocess (peak RSS is its own), warms up once, then the repeats alternate
A B B A ... so that load from other jobs on this shared machine hits both alike; the 1-minute load
average is recorded around every repeat. The warm-up losses and gradient norms of the two sides are
compared too: same adapter initialisation, same objective, so they must agree.

    .venv/bin/python bench/cpu_train_step.py [--repeats 4] [--threads 1] [--profile]
    .venv/bin/python bench/cpu_train_step.py --make-batch   # re-play the games (otherwise reused)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (MIN_REPEATS, ROOT, Results, current_rss_mib, head_to_head, loadavg, peak_rss_mib, stats,
                     wait_for_memory)

RESULTS = ROOT / "bench" / "results"
BATCH = RESULTS / "cpu_train_step_batch.json"
LORA_RANK, LORA_ALPHA, LEARNING_RATE, MAX_SEQ_LEN = 16, 32.0, 2e-4, 1024
TRL_ON_CPU = ("TRL 1.15.0's GRPOTrainer cannot compute its loss on a CPU (its fused LM head calls a Triton kernel "
              "unconditionally: AttributeError: 'NoneType' object has no attribute 'apply' in trl/trainer/utils.py "
              "_fused_forward); 1.14.2 is the newest release with a PyTorch path on CPU, so this comparison uses it")
TAG = "@@bench "  # worker replies are the stdout lines that start with this (libraries print too)


# ---- the batch -----------------------------------------------------------------------------------------


async def play_games(groups: int, group_size: int, seed: int) -> list[Any]:
    """Tic-tac-toe groups from the real stack (LocalBackend, HF engine, OpenAI endpoint); groups with signal only."""
    import art_nb as art
    from art_nb.envs import tic_tac_toe as ttt
    from art_nb.local.plan.base_models import TINY_MODEL

    model = art.TrainableModel(
        name="bench-ttt", project="bench", base_model=TINY_MODEL,
        config=art.ModelConfig(max_seq_len=MAX_SEQ_LEN, lora=art.LoraConfig(rank=LORA_RANK, alpha=LORA_ALPHA)),
    )
    backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="art_nb_bench_"))
    await model.register(backend)
    kept: list[Any] = []
    scenario = seed
    while len(kept) < groups and scenario < seed + 10 * groups:
        batch = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(ttt.rollout(model, ttt.TicTacToeScenario(seed=scenario + g)) for _ in range(group_size))
             for g in range(groups - len(kept))),
            pbar_desc=None,
        )
        scenario += groups
        kept += [g for g in batch if len(g.trajectories) == group_size and len(set(g.rewards())) > 1]
    await backend.close()
    return kept[:groups]


def dump_groups(groups: list[Any]) -> list[list[dict[str, Any]]]:
    from art_nb.trajectories import Choice

    out = []
    for group in groups:
        rows = []
        for t in group.trajectories:
            items = [{"choice": m.model_dump(mode="json")} if isinstance(m, Choice) else {"message": m}
                     for m in t.messages_and_choices]
            rows.append({"reward": t.reward, "items": items})
        out.append(rows)
    return out


def load_groups(raw: list[list[dict[str, Any]]]) -> list[Any]:
    from art_nb.trajectories import Choice, Trajectory, TrajectoryGroup

    return [
        TrajectoryGroup(
            Trajectory(reward=row["reward"],
                       messages_and_choices=[Choice.model_validate(i["choice"]) if "choice" in i else i["message"]
                                             for i in row["items"]])
            for row in group)
        for group in raw
    ]


def make_batch(groups: int, group_size: int, seed: int) -> dict[str, Any]:
    """Play the games, then tokenise once with art_nb: the token ids both sides train on."""
    from transformers import AutoTokenizer

    from art_nb.config import TrainConfig
    from art_nb.grpo.advantages import prepare_batch
    from art_nb.local.plan.base_models import TINY_MODEL, resolve_base_model

    played = asyncio.run(play_games(groups, group_size, seed))
    raw = dump_groups(played)
    path = resolve_base_model(TINY_MODEL).path
    prepared = prepare_batch(load_groups(raw), AutoTokenizer.from_pretrained(path), TrainConfig(), MAX_SEQ_LEN)
    items = [{"input_ids": i.input_ids, "mask": [int(m) for m in i.assistant_mask],
              "engine_logprobs": [None if math.isnan(x) else x for x in i.engine_logprobs],
              "advantage": i.advantage, "group": i.group_index} for i in prepared.items]
    lengths = [len(i["input_ids"]) for i in items]
    return {
        "what": "tic-tac-toe games of SmolLM2-135M-Instruct (HF engine through art_nb's OpenAI endpoint, "
                "temperature 1), then art_nb.grpo.prepare_batch; groups whose rewards all tie are replayed",
        "groups": raw, "items": items,
        "shape": {"groups": len(raw), "group_size": group_size, "sequences": len(items),
                  "tokens": sum(lengths), "trained_tokens": sum(sum(i["mask"][1:]) for i in items),
                  "min_len": min(lengths), "max_len": max(lengths)},
    }


# ---- the two workers ------------------------------------------------------------------------------------


class ArtSide:
    """art_nb's CPU trainer, exactly as LocalBackend runs it (minus the checkpoint write)."""

    def __init__(self, batch: dict[str, Any], model_path: Path) -> None:
        from art_nb.config import LoraConfig, ModelConfig, TrainConfig
        from art_nb.local.trainers.peft_trainer import PeftTrainer

        self.groups = load_groups(batch["groups"])
        self.config = TrainConfig(learning_rate=LEARNING_RATE, loss="ppo")  # what was measured against TRL
        self.trainer = PeftTrainer(model_path, ModelConfig(
            dtype="float32", max_seq_len=MAX_SEQ_LEN, lora=LoraConfig(rank=LORA_RANK, alpha=LORA_ALPHA)))  # on CPU the plan gives cpu
        self._check_tokens(batch)

    def _check_tokens(self, batch: dict[str, Any]) -> None:
        from art_nb.grpo.advantages import prepare_batch

        prepared = prepare_batch(self.groups, self.trainer.tokenizer, self.config, MAX_SEQ_LEN)
        if [i.input_ids for i in prepared.items] != [i["input_ids"] for i in batch["items"]]:
            raise RuntimeError("art_nb tokenised the saved games differently from the saved batch; run --make-batch")

    def warm_up(self) -> dict[str, Any]:
        started = time.perf_counter()
        metrics = self.trainer.train_step(self.groups[:1], self.config)
        return {"seconds": time.perf_counter() - started, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}

    def step(self) -> dict[str, Any]:
        from art_nb.grpo.advantages import prepare_batch

        started, cpu = time.perf_counter(), time.process_time()
        metrics = self.trainer.train_step(self.groups, self.config)
        seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu
        mark = time.perf_counter()  # tokenisation alone, outside the timed step, to split it out
        prepare_batch(self.groups, self.trainer.tokenizer, self.config, MAX_SEQ_LEN)
        return {"seconds": seconds, "cpu_s": cpu_s, "prepare_batch_s": time.perf_counter() - mark,
                "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "tokens_trained": metrics["tokens_trained"]}


class TrlSide:
    """TRL's GRPOTrainer: its model loading, its loss (compute_loss), its accelerator and optimizer."""

    def __init__(self, batch: dict[str, Any], model_path: Path, chunks: int) -> None:
        import torch
        from datasets import Dataset
        from peft import LoraConfig
        from transformers import AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        from art_nb.config import LoraConfig as ArtLora

        items = batch["items"]
        group_size = batch["shape"]["group_size"]
        if len(items) % chunks:
            raise ValueError(f"{len(items)} sequences do not split into {chunks} equal chunks")
        self.chunks = chunks
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        args = GRPOConfig(
            output_dir=tempfile.mkdtemp(prefix="trl_bench_"), use_cpu=True, bf16=False, fp16=False,
            gradient_checkpointing=False, per_device_train_batch_size=len(items) // chunks,
            gradient_accumulation_steps=chunks, num_generations=group_size, loss_type="grpo", beta=0.0,
            epsilon=0.2, temperature=1.0, learning_rate=LEARNING_RATE, max_grad_norm=1.0, weight_decay=0.0,
            report_to="none", save_strategy="no", logging_steps=1, seed=0,
            model_init_kwargs={"dtype": torch.float32},
        )
        lora = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                          target_modules=list(ArtLora().target_modules), task_type="CAUSAL_LM")
        self.trainer = GRPOTrainer(
            model=str(model_path), reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
            train_dataset=Dataset.from_dict({"prompt": ["unused: generation is not part of this benchmark"] * 8}),
            processing_class=tokenizer, peft_config=lora,
        )
        self.model = self.trainer.model
        self.model.train()
        self.optimizer = self.trainer.create_optimizer()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.inputs = trl_inputs(items, tokenizer.pad_token_id, chunks)
        self.warm_inputs = trl_inputs(items[:group_size], tokenizer.pad_token_id, 1)  # art_nb warms up on group 0

    def warm_up(self) -> dict[str, Any]:
        return self._step(self.warm_inputs)

    def step(self) -> dict[str, Any]:
        return self._step(self.inputs)

    def _step(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        started, cpu = time.perf_counter(), time.process_time()
        self.trainer.current_gradient_accumulation_steps = len(inputs)  # compute_loss divides by it
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        for chunk in inputs:
            loss = self.trainer.compute_loss(self.model, chunk)
            self.trainer.accelerator.backward(loss)
            loss_total += float(loss.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, 1.0))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu
        padded = sum(int(c["prompt_ids"].numel() + c["completion_ids"].numel()) for c in inputs)
        return {"seconds": seconds, "cpu_s": cpu_s, "loss": loss_total, "grad_norm": grad_norm,
                "microbatches": len(inputs), "padded_tokens": padded}


def trl_inputs(items: list[dict[str, Any]], pad_id: int, chunks: int) -> list[dict[str, Any]]:
    """What TRL's `_generate_and_score_completions` returns for these rollouts, split as its
    training loop splits a generation batch: padded once over the whole batch, then cut in chunks.

    Multi-turn rollouts in TRL: the prompt is everything before the first sampled token; the rest is
    the completion, with the environment's turns in it masked out by `tool_mask`.
    """
    import torch

    prompts, completions, tool_masks, old = [], [], [], []
    for item in items:
        first = item["mask"].index(1)
        prompts.append(item["input_ids"][:first])
        completions.append(item["input_ids"][first:])
        tool_masks.append(item["mask"][first:])
        old.append([0.0 if x is None else x for x in item["engine_logprobs"][first:]])
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    n = len(items)
    prompt_ids = torch.full((n, width_p), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, width_p), dtype=torch.long)
    completion_ids = torch.full((n, width_c), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((n, width_c), dtype=torch.long)
    tool_mask = torch.zeros((n, width_c), dtype=torch.long)
    old_logps = torch.zeros((n, width_c), dtype=torch.float32)
    for row in range(n):
        p, c = prompts[row], completions[row]
        prompt_ids[row, width_p - len(p):] = torch.tensor(p)
        prompt_mask[row, width_p - len(p):] = 1
        completion_ids[row, :len(c)] = torch.tensor(c)
        completion_mask[row, :len(c)] = 1
        tool_mask[row, :len(c)] = torch.tensor(tool_masks[row])
        old_logps[row, :len(c)] = torch.tensor(old[row])
    advantages = torch.tensor([i["advantage"] for i in items], dtype=torch.float32)
    size = n // chunks
    return [{
        "prompt_ids": prompt_ids[s:s + size], "prompt_mask": prompt_mask[s:s + size],
        "completion_ids": completion_ids[s:s + size], "completion_mask": completion_mask[s:s + size],
        "tool_mask": tool_mask[s:s + size], "old_per_token_logps": old_logps[s:s + size],
        "advantages": advantages[s:s + size],
        "num_items_in_batch": (completion_mask * tool_mask).sum(),
    } for s in range(0, n, size)]


def profile_step(side: Any, top: int = 25) -> list[dict[str, Any]]:
    """One step under torch.profiler: the ops that took the most time (self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        side.step()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) or 1
    return [{"op": e.key, "self_cpu_s": round(e.self_cpu_time_total / 1e6, 3),
             "share": round(e.self_cpu_time_total / total, 3), "calls": e.count} for e in rows]


def worker(kind: str, threads: int, chunks: int, profile: bool) -> None:
    """One side in its own process: load, warm up on the first group, then one timed (or profiled) full step."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    from art_nb.local.plan.base_models import TINY_MODEL, resolve_base_model

    batch = json.loads(BATCH.read_text())
    path = resolve_base_model(TINY_MODEL).path
    started = time.perf_counter()
    side = ArtSide(batch, path) if kind == "art" else TrlSide(batch, path, chunks)
    row: dict[str, Any] = {"load_s": time.perf_counter() - started, "rss_after_load_mib": current_rss_mib(),
                           "threads": torch.get_num_threads()}
    warm = side.warm_up()  # the same group on both sides: lazy inits, thread pools, AdamW state
    row["warmup"] = {k: warm[k] for k in ("seconds", "loss", "grad_norm")}
    if profile:
        row["profile"] = profile_step(side)
    else:
        row.update(side.step())
    row.update(peak_rss_mib=peak_rss_mib(), rss_mib=current_rss_mib())
    print(TAG + json.dumps(row), flush=True)


def run_worker(kind: str, threads: int, chunks: int, profile: bool = False) -> dict[str, Any]:
    """Start one side's process and return its report (stdout lines other than ours are library noise)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, __file__, "--worker", kind, "--threads", str(threads), "--chunks", str(chunks)]
    done = subprocess.run(command + (["--profile"] if profile else []), capture_output=True, text=True, env=env,
                          cwd=ROOT, check=False)
    for line in done.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    raise RuntimeError(f"the {kind} worker failed (exit {done.returncode}): {done.stderr[-3000:]}")


# ---- the comparison -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=max(4, MIN_REPEATS), help="timed steps per side (each after a warm-up)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both sides (default: art_nb's own choice for this machine)")
    parser.add_argument("--profile", action="store_true", help="also profile one step per side")
    parser.add_argument("--make-batch", action="store_true", help="play the games again and overwrite the batch")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=6)
    parser.add_argument("--need-gib", type=float, default=8.0, help="free memory to wait for before each run")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_train_step.json")
    parser.add_argument("--worker", choices=("art", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--chunks", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.threads or 1, args.chunks, args.profile)
        return

    from art_nb.local.plan.threads import choose_cpu_threads

    threads, why = (args.threads, "--threads") if args.threads else choose_cpu_threads()
    if args.make_batch or not BATCH.exists():
        print("playing the games for the batch ...", flush=True)
        batch = make_batch(args.groups, args.group_size, seed=0)
        BATCH.write_text(json.dumps(batch) + "\n")
    batch = json.loads(BATCH.read_text())
    layout = art_microbatches(batch)
    print("batch:", batch["shape"], "art_nb microbatches:", layout, flush=True)

    results = Results(args.out, benchmark="cpu_train_step", batch_file=str(BATCH.relative_to(ROOT)),
                      batch_shape=batch["shape"], threads=threads, threads_reason=why,
                      model="HuggingFaceTB/SmolLM2-135M-Instruct (art_nb's offline GGUF copy, float32)",
                      lora={"rank": LORA_RANK, "alpha": LORA_ALPHA, "targets": "all linear"},
                      learning_rate=LEARNING_RATE, art_nb_microbatches=layout, trl_on_cpu=TRL_ON_CPU,
                      method="each repeat is a fresh process per side: load, warm-up step on group 0, one timed "
                             "step on the whole batch; sides alternate A B B A; peak RSS = getrusage maxrss")
    runs: dict[str, list[dict[str, Any]]] = {"art_nb": [], "trl": []}
    kinds = {"art_nb": "art", "trl": "trl"}
    for repeat in range(args.repeats):
        order = ("art_nb", "trl") if repeat % 2 == 0 else ("trl", "art_nb")
        for name in order:
            waited = wait_for_memory(args.need_gib)
            before = loadavg()
            row = run_worker(kinds[name], threads, layout["count"])
            row.update(repeat=repeat, loadavg_before=before, loadavg_after=loadavg(), waited_for_memory_s=waited)
            runs[name].append(row)
            print(f"  repeat {repeat} {name}: {row['seconds']:.1f} s ({row['cpu_s']:.1f} s CPU), loss "
                  f"{row['loss']:.5f}, peak RSS {row['peak_rss_mib']:.0f} MiB (load {before} -> {row['loadavg_after']})", flush=True)
            results.data["runs"] = runs
            results.save()
    if args.profile:
        results.data["profile"] = {}
        for name in ("art_nb", "trl"):
            wait_for_memory(args.need_gib)
            results.data["profile"][name] = run_worker(kinds[name], threads, layout["count"], profile=True)
            results.save()
    results.data["summary"] = summarize(runs, batch["shape"], layout)
    results.save()
    print(json.dumps(results.data["summary"], indent=1))


def art_microbatches(batch: dict[str, Any]) -> dict[str, Any]:
    """How art_nb's step splits this batch (TRL is given as many gradient-accumulation chunks)."""
    from art_nb.config import TrainConfig
    from art_nb.grpo.step import microbatches
    from art_nb.grpo.tokens import TokenizedTrajectory

    items = [TokenizedTrajectory(i["input_ids"], [bool(m) for m in i["mask"]], [0.0] * len(i["mask"]))
             for i in batch["items"]]
    # PeftTrainer's own choice when TrainConfig leaves it open (1024 padded tokens on CPU).
    groups = microbatches(items, TrainConfig().microbatch_tokens or 1024)
    return {"count": len(groups), "sizes": [len(g) for g in groups],
            "padded_tokens": sum(len(g) * len(g[0].input_ids) for g in groups)}


def summarize(runs: dict[str, list[dict[str, Any]]], shape: dict[str, Any], layout: dict[str, Any]) -> dict[str, Any]:
    seconds = {k: [r["seconds"] for r in v] for k, v in runs.items()}
    art_step_only = [r["seconds"] - r["prepare_batch_s"] for r in runs["art_nb"]]
    median = {k: stats(v)["median"] for k, v in seconds.items()}
    cpu = {k: [r["cpu_s"] for r in v] for k, v in runs.items()}
    cpu_median = {k: stats(v)["median"] for k, v in cpu.items()}
    return {
        # median of the interleaved repeats (A B B A ...) with the spread, the ratio with its per-repeat range
        "head_to_head": head_to_head({"art_nb": seconds["art_nb"], "trl": seconds["trl"]}),
        "seconds": {k: stats(v) for k, v in seconds.items()},
        "cpu_seconds": {k: stats(v) for k, v in cpu.items()},
        "ratio_trl_over_art_nb_cpu_time": round(cpu_median["trl"] / cpu_median["art_nb"], 3),
        "art_nb_prepare_batch_s": stats([r["prepare_batch_s"] for r in runs["art_nb"]]),
        "ratio_trl_over_art_nb": round(median["trl"] / median["art_nb"], 3),
        "ratio_trl_over_art_nb_step_only": round(median["trl"] / stats(art_step_only)["median"], 3),
        "ratio_per_repeat": [round(t["seconds"] / a["seconds"], 3) for a, t in zip(runs["art_nb"], runs["trl"])],
        "tokens_per_s": {k: round(shape["tokens"] / v, 1) for k, v in median.items()},
        "trained_tokens_per_s": {k: round(shape["trained_tokens"] / v, 1) for k, v in median.items()},
        "padded_tokens": {"art_nb": layout["padded_tokens"], "trl": runs["trl"][0]["padded_tokens"]},
        "peak_rss_mib": {k: max(r["peak_rss_mib"] for r in v) for k, v in runs.items()},
        "loss": {k: [r["loss"] for r in v] for k, v in runs.items()},
        "warmup_loss": {k: v[0]["warmup"]["loss"] for k, v in runs.items()},
        "warmup_grad_norm": {k: v[0]["warmup"]["grad_norm"] for k, v in runs.items()},
        "note": "ratio = median TRL step time / median art_nb step time (art_nb's includes prepare_batch, "
                "TRL's excludes its tokenisation); cpu time = the process's CPU seconds during the step (with one "
                "torch thread, the work done, whatever else runs on the machine); tokens/s = real (unpadded) "
                "tokens of the batch per wall second",
    }


if __name__ == "__main__":
    main()
