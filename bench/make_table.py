"""bench/RESULTS.md, assets/benchmarks.png and the README's results table, generated from bench/results/.

Every number is computed from the results files (medians of the raw repeats stored there); a benchmark
whose file is missing, or whose section failed, says so instead of showing a number. Each run also gets
a row in bench/results/history.jsonl the first time this script sees its file (bench/run_history.py), so
the numbers of a run whose file was replaced stay in RESULTS.md's table of every run.

    .venv/bin/python bench/make_table.py [--commit SHA]   # --commit: the code the new files ran (a GPU run)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_history  # noqa: E402  (bench/ is a folder of scripts, not a package)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
README_START, README_END = "<!-- results:start (bench/make_table.py) -->", "<!-- results:end -->"


def load(results: Path, name: str) -> dict[str, Any] | None:
    """`name`.json from the results folder, else from its h200/ folder (GPU runs come back from there)."""
    for path in (results / f"{name}.json", results / "h200" / f"{name}.json"):
        if path.exists():
            return json.loads(path.read_text())
    return None


def context(data: dict[str, Any]) -> str:
    machine = data.get("machine", {})
    where = machine.get("gpu") or f"{machine.get('cpu', 'CPU')} ({machine.get('usable_cores')} cores)"
    versions = data.get("versions", {})
    picked = ", ".join(f"{k} {versions[k]}" for k in ("torch", "transformers", "peft", "trl", "vllm", "unsloth")
                       if versions.get(k))
    dry = " · **--quick dry run on a CPU: these numbers mean nothing**" if data.get("settings", {}).get("quick") else ""
    return f"_{data.get('date', '?')[:10]} · {where} · {picked} · `{data.get('command', '')}`_{dry}"


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def cpu_train_step(data: dict[str, Any] | None) -> list[str]:
    lines = ["## GRPO training step on CPU: art_nb vs TRL", ""]
    if not data or "summary" not in data:
        return lines + ["Not run yet (`bench/cpu_train_step.py`).", ""]
    s, shape = data["summary"], data["batch_shape"]
    runs = data["runs"]
    lines += [context(data), "",
              (f"Batch: {shape['sequences']} tic-tac-toe trajectories ({shape['groups']} groups x {shape['group_size']}), "
              f"{shape['tokens']} tokens ({shape['trained_tokens']} sampled, trained), SmolLM2-135M-Instruct fp32, "
              f"LoRA r{data['lora']['rank']} on all linear layers, {data['threads']} torch thread(s); "
              f"art_nb splits it into {data['art_nb_microbatches']['count']} microbatches, TRL gets as many "
              "gradient-accumulation chunks. TRL: "
              f"{data['versions'].get('trl')} (`GRPOTrainer.compute_loss` + backward + clip + optimizer step)."), "",
              "| | art_nb | TRL |", "|---|---|---|",
              (f"| step time, median of {len(runs['art_nb'])} (s) | {s['seconds']['art_nb']['median']:.1f} | "
              f"{s['seconds']['trl']['median']:.1f} |"),
              f"| every repeat (s) | {every(runs['art_nb'])} | {every(runs['trl'])} |",
              f"| CPU time, median (s) | {cpu(s, 'art_nb')} | {cpu(s, 'trl')} |",
              f"| tokens/s | {s['tokens_per_s']['art_nb']} | {s['tokens_per_s']['trl']} |",
              f"| padded tokens computed | {s['padded_tokens']['art_nb']} | {s['padded_tokens']['trl']} |",
              f"| peak RSS (MiB) | {s['peak_rss_mib']['art_nb']:.0f} | {s['peak_rss_mib']['trl']:.0f} |",
              f"| loss of the timed step | {runs['art_nb'][0]['loss']:.6f} | {runs['trl'][0]['loss']:.6f} |", "",
              (f"**TRL time / art_nb time: {s['ratio_trl_over_art_nb']}x wall clock, "
              f"{s.get('ratio_trl_over_art_nb_cpu_time', '-')}x CPU time** (wall, per repeat: "
              f"{', '.join(map(str, s['ratio_per_repeat']))}; goal >= 1.5x). art_nb's time includes `prepare_batch` "
              f"(chat template + tokenisation, median {s['art_nb_prepare_batch_s'].get('median', 0):.2f} s), which TRL "
              "does during generation. Load average during the repeats: "
              f"{min(r['loadavg_before'] for v in runs.values() for r in v):.1f}-"
              f"{max(r['loadavg_after'] for v in runs.values() for r in v):.1f} on a shared machine; CPU time "
              "(one torch thread: the work done) is the steadier measure there."), ""]
    if data.get("trl_on_cpu"):
        lines += [f"Why TRL {data['versions'].get('trl')}: {data['trl_on_cpu']}.", ""]
    for side, label in (("art_nb", "art_nb"), ("trl", "TRL")):
        rows = data.get("profile", {}).get(side, {}).get("profile", [])
        if rows:
            top = ", ".join(f"`{r['op']}` {r['share']:.0%}" for r in rows[:4])
            lines.append(f"- Profile of one {label} step (self CPU time): {top}.")
    return lines + [""]


def cpu(summary: dict[str, Any], side: str) -> str:
    value = summary.get("cpu_seconds", {}).get(side, {}).get("median")
    return "-" if value is None else f"{value:.1f}"


def every(runs: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['seconds']:.0f}" for r in runs)


def endpoint_overhead(data: dict[str, Any] | None) -> list[str]:
    lines = ["## OpenAI endpoint overhead on CPU", ""]
    if not data:
        return lines + ["Not run yet (`bench/endpoint_overhead.py`).", ""]
    lines += [context(data), "",
              (f"Concurrent chat completions of {data['sampling']['max_tokens']} tokens each (fixed length) through "
              "art_nb's endpoint vs `engine.generate` called directly, same engine (transformers, SmolLM2-135M), "
              "same seeds."), "",
              ("| concurrent requests | endpoint (s) | direct (s) | overhead | every repeat | CPU-time overhead "
              "| same tokens |"),
              "|---|---|---|---|---|---|---|"]
    for name, section in data.get("sections", {}).items():
        if section.get("status") != "ok":
            lines.append(f"| {name} | failed: {section.get('error', '')[:80]} | | | | |")
            continue
        lines.append(f"| {section['concurrency']} | {section['seconds']['endpoint']['median']:.2f} | "
                     f"{section['seconds']['direct']['median']:.2f} | {section['overhead']:+.1%} | "
                     f"{', '.join(f'{x:+.1%}' for x in section['overhead_per_repeat'])} | "
                     f"{section.get('cpu_overhead', 0):+.1%} | {section['same_tokens_sampled']} |")
    return lines + ["", "Goal: under 10%.", ""]


THROUGHPUT_GOAL = 0.95  # the endpoint >= 0.95x plain vLLM at 8, 64 and 256, graphs on and off


def gpu_throughput(data: dict[str, Any] | None) -> list[str]:
    """One table per vLLM start-up mode; the endpoint without logprobs (what a rollout calls) is the headline."""
    lines = ["## Rollout throughput on GPU: art_nb's endpoint vs plain vLLM and vLLM's own server", ""]
    if not data:
        return lines + ["Not run yet (`bench/gpu_throughput.py`, on the H200).", ""]
    sections, st = data.get("sections", {}), data["settings"]
    comparison = sections.get("comparison", {"startup": {}})
    lines += [context(data), "", (f"Model: {data.get('weights')}. {st['completion_tokens']} tokens per request (fixed); "
              f"median tokens/s of {st['repeats']} runs (plain, endpoint) and {st.get('side_repeats', st['repeats'])} "
              "(the other modes). Both sides use the same engine arguments (art_nb's `engine_args` for the mode). "
              "**endpoint**: `chat.completions.create` through `model.openai_client()`, as a user's rollout calls it "
              "(art_nb returns token ids and logprobs anyway); **+logprobs**: the same with `logprobs=True`; **HTTP**: "
              "a plain `AsyncOpenAI(base_url=...)` over loopback; **direct**: `engine.generate`, no HTTP; **vLLM server**: "
              "vLLM's own OpenAI server on the same engine arguments, the same requests over loopback HTTP (the way ART "
              "and most RL stacks serve rollouts)."), ""]
    if not comparison.get("startup"):
        lines += ["No comparison yet: the run was cut short or is still going (sections: "
                  + ", ".join(f"{k} {v.get('status', 'running')}" for k, v in sections.items()) + ").", ""]
    for mode, found in comparison.get("startup", {}).items():
        graphs = describe_graphs(found.get("graph_setting"))
        same = found.get("same_graph_setting")
        lines += [f"### vLLM start-up \"{mode}\" ({graphs}{'' if same is not False else '; ENGINES DIFFER'})", "",
                  (f"Start-up: plain `LLM(...)` {found.get('plain_init_s', '-')} s, art_nb register "
                   f"{found.get('art_register_s', '-')} s."), "",
                  ("| concurrent | plain tok/s | endpoint tok/s | **endpoint / plain** | +logprobs / plain | HTTP / plain "
                   "| direct / plain | endpoint, HTTP / vLLM server | ms/step plain, endpoint "
                   "| before first + after last step, endpoint (ms) |"),
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for batch, r in found.get("ratios", {}).items():
            ms = r.get("ms_per_step", {})
            edge = [r.get(k, {}).get("endpoint") for k in ("lead_ms", "tail_ms")]
            mark = "" if r["endpoint_over_plain"] >= THROUGHPUT_GOAL else " (missed)"
            lines.append(f"| {batch} | {r['plain_tokens_per_s']:.0f} | {r['endpoint_tokens_per_s']:.0f} | "
                         f"**{r['endpoint_over_plain']:.2f}**{mark} | {_fmt(r.get('endpoint_logprobs_over_plain'))} | "
                         f"{_fmt(r.get('endpoint_http_over_plain'))} | "
                         f"{_fmt(r.get('engine_direct_over_plain'))} | {_fmt(r.get('endpoint_over_vllm_server'))}, "
                         f"{_fmt(r.get('endpoint_http_over_vllm_server'))} | {_fmt(ms.get('plain'), 1)}, "
                         f"{_fmt(ms.get('endpoint'), 1)} | {' + '.join(_fmt(e, 0) for e in edge)} |")
        missed = [b for b, r in found.get("ratios", {}).items() if r["endpoint_over_plain"] < THROUGHPUT_GOAL]
        skipped = [k.split("/")[1] for k, v in sections.items() if k.startswith(f"{mode}/") and v.get("status") != "ok"]
        lines += [""]
        if missed:
            lines += [(f"Goal endpoint / plain >= {THROUGHPUT_GOAL} **missed** at {', '.join(missed)} concurrent "
                      "(the columns to the right say where the time goes: per request before the first and after the "
                      "last step, or per step between steps)."), ""]
        if skipped:
            lines += [f"Not measured in this mode: {', '.join(skipped)} (see below).", ""]
    return lines + failures(sections)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def describe_graphs(setting: dict[str, Any] | None) -> str:
    """As bench/_common.py's: eager, or the compile mode and CUDA-graph mode an engine ran with."""
    if not setting:
        return "setting not recorded"
    if setting.get("enforce_eager"):
        return "eager"
    return f"compile {setting.get('compile_mode')}, CUDA graphs {setting.get('cudagraph_mode')}"


def gpu_step(data: dict[str, Any] | None) -> list[str]:
    lines = ["## GRPO step on GPU: art_nb (vLLM + Unsloth) vs TRL (colocated vLLM)", ""]
    if not data:
        return lines + ["Not run yet (`bench/gpu_step.py`, on the H200).", ""]
    sections = data.get("sections", {})
    st = data["settings"]
    lines += [context(data), "", (f"Model: {data.get('weights')}. {st['groups']} prompts x {st['group_size']} rollouts "
              f"of {st['completion_tokens']} tokens per step, LoRA r{st['lora_rank']}; means over steps 2..{st['steps']} "
              "(step 1 compiles)."), ""]
    verdict = sections.get("comparison", {})
    if "graph_setting" in verdict:
        g = verdict["graph_setting"]
        lines += [(f"vLLM start-up \"{st.get('vllm_startup')}\": art_nb's engine ran {describe_graphs(g.get('art_nb'))}, "
                   f"TRL's {describe_graphs(g.get('trl'))}"
                   + (" (the same)." if verdict.get("same_graph_setting") else
                      " (**not the same**: the comparison is not like for like)." if "same_graph_setting" in verdict
                      else ".")), ""]
    art = sections.get("art", {})
    if art.get("status") == "ok":
        s = art["step_stats"]
        get = lambda k: s.get(k, {}).get("mean", 0.0)
        lines += ["| art_nb step part | seconds |", "|---|---|",
                  f"| rollouts (endpoint) | {get('rollout_s'):.2f} |",
                  f"| pause + vLLM sleep | {get('time/pause'):.2f} |", f"| train | {get('time/train'):.2f} |",
                  f"| save checkpoint | {get('time/save'):.2f} |", f"| wake + load LoRA | {get('time/swap'):.2f} |",
                  f"| **whole step** | **{get('wall_s'):.2f}** |", "",
                  (f"Overhead outside rollouts and training: {get('overhead_share'):.1%} (goal < 5%); "
                  f"{get('trained_tokens_per_s'):.0f} trained tokens/s; peak GPU memory used "
                  f"{art.get('peak_gpu_used_gib')} GiB."), ""]
    trl = sections.get("trl", {})
    h2h = verdict.get("head_to_head")
    if trl.get("status") == "ok" and not h2h:  # a run before interleaved turns: one run per side, means
        trl_s = trl["step_stats"]["wall_s"]["mean"]
        lines += [(f"TRL {data['versions'].get('trl')}: {trl_s:.2f} s per step "
                  f"(every step: {', '.join(str(s['wall_s']) for s in trl['steps'])}); peak GPU memory used "
                  f"{trl.get('peak_gpu_used_gib')} GiB."), ""]
        if art.get("status") == "ok":
            art_s = art["step_stats"]["wall_s"]["mean"]
            goal = "goal >= 1.3"
            missed = " **missed**" if verdict.get("step_goal_met") is False else ""
            lines += [f"**TRL step / art_nb step = {trl_s / art_s:.2f}** ({goal}){missed}.", ""]
    if h2h:  # interleaved turns (bench/_common.head_to_head)
        lines += ["| side | seconds per step (median of turns) | spread | steps per hour |", "|---|---|---|---|"]
        lines += [f"| {side} | {e['median']:.2f} ({', '.join(f'{v:.2f}' for v in e['repeats'])}) | "
                  f"{e['spread']:.0%} | {3600 / e['median']:.0f} |" for side, e in h2h["sides"].items()]
        lines += ["", "| ratio | of medians | per round | holds |", "|---|---|---|---|"]
        lines += [f"| {pair} | {r['of_medians']:.2f} | {', '.join(f'{v:.2f}' for v in r['per_round'])} | "
                  f"{'yes' if r['holds'] else '**no**'} |" for pair, r in h2h["ratios"].items()]
        lines += ["", f"Method: {h2h['method']}.", "", f"**{verdict.get('verdict', '')}**.", ""]
    for key, label in (("overhead_goal_met", "overhead outside rollouts and training < 5%"),
                       ("swap_goal_met", "adapter hand-over (`time/swap`) <= 50 ms")):
        if key in verdict:
            lines += [f"Goal {label}: {'met' if verdict[key] else '**missed**'}.", ""]
    lines += [("`time/save` is the adapter's copy at the end of the step and `time/swap` vLLM taking those tensors "
               "(no file on the step's path); the whole checkpoint (adapter file, optimizer state, fsync, rename) is "
               "written in the background during the next rollouts."), ""]
    return lines + failures(sections)


def gpu_memory_fit(data: dict[str, Any] | None) -> list[str]:
    lines = ["## Memory fit: the 2048 notebook's GPU configuration under a T4's 15 GB", ""]
    if not data:
        return lines + ["Not run yet (`bench/gpu_memory_fit.py`, on the H200).", ""]
    sections = data.get("sections", {})
    st = data["settings"]
    lines += [context(data), "", (f"Model: {data.get('weights')}, trainer {st['trainer']}, max_seq_len "
              f"{st['max_seq_len']}, {st['groups']} x {st['group_size']} rollouts; vLLM "
              f"{st.get('vllm') or 'start-up ' + str(st.get('vllm_startup'))}."), "",
              "| phase | seconds | peak device memory used (GiB) |", "|---|---|---|"]
    for name in ("register", "rollouts", "train_step"):
        section = sections.get(name, {})
        lines.append(f"| {name} | {section.get('seconds', '-')} | {section.get('peak_used_gib', section.get('error', '-'))} |")
    verdict = sections.get("verdict", {})
    if "fits" in verdict:
        lines += ["", f"**{verdict['summary']}** (torch max reserved {verdict['torch_max_reserved_gib']} GiB).", ""]
    headroom = sections.get("register", {}).get("headroom_gib")
    if headroom is not None:
        lines += [f"Headroom under the cap after register: {headroom} GiB.", ""]
    kl = sections.get("train_step", {}).get("metrics", {}).get("mismatch_kl")
    if kl is not None:
        weights = "bf16" if st.get("vllm_4bit") == "off" else "NF4, the trainer's own"
        lines += [(f"vLLM's weights: {weights} "
                   f"(`--vllm-4bit {st.get('vllm_4bit', 'auto')}`); sampler/trainer mismatch KL of the train step "
                   f"{kl:.3f}."), ""]
    return lines + failures(sections)


# art_nb's engine in the T4 head to head (`--art-engine`; runs without the setting used the transformers engine)
_T4_ENGINES = {"hf": "transformers engine", "vllm": "vLLM engine"}


def gpu_t4_vs_unsloth(data: dict[str, Any] | None) -> list[str]:
    lines = ["## T4 head to head: art_nb's T4 configuration vs Unsloth's T4 GRPO recipe, 15 GiB cap", ""]
    if not data:
        return lines + ["Not run yet (`bench/gpu_t4_vs_unsloth.py`, on the H200).", ""]
    sections, st = data.get("sections", {}), data["settings"]
    lines += [context(data), "", (f"Model: {data.get('weights')}, {st['base']} base, {st['dtype']}, LoRA r{st['lora_rank']}; "
              f"per step 1 prompt x {st['generations']} completions of {st['completion_tokens']} tokens; "
              f"both under a {st['cap_gib']} GiB cap. {st['not_a_t4']}: the ratio, not the seconds, carries over."), "",
              f"| | art_nb ({_T4_ENGINES[st.get('art_engine', 'hf')]}, Unsloth trainer) | Unsloth's recipe (vLLM standby, TRL GRPOTrainer) |",
              "|---|---|---|"]
    art, uns = sections.get("art", {}), sections.get("unsloth", {})

    def cell(part: dict[str, Any], what: str) -> str:
        if part.get("status") not in ("ok", None) and not part.get("steps"):
            return f"failed: {part.get('error', '')[:80]}"
        steps = part.get("steps", {})
        if what == "step":
            mean = steps.get("step_s", {}).get("mean")
            return "-" if mean is None else f"{mean:.2f} (every step: {', '.join(map(str, steps.get('every_step_s', [])))})"
        if what == "start":
            return str(part.get("register_s") or part.get("trainer_build_s") or "-")
        return str(part.get("peak_gpu_used_gib", "-"))

    lines += [f"| seconds per step, mean of steps 2..N | {cell(art, 'step')} | {cell(uns, 'step')} |",
              f"| start-up (register / load + trainer build), s | {cell(art, 'start')} | {cell(uns, 'start')} |",
              f"| peak device memory used, GiB | {cell(art, 'peak')} | {cell(uns, 'peak')} |", ""]
    c = sections.get("comparison", {})
    if c.get("art_nb_over_unsloth_time") is not None:
        goals = [("time", "step time <= 1.0x Unsloth's"), ("memory", "peak memory <= Unsloth's")]
        missed = [label for key, label in goals if c.get(f"{key}_goal_met") is False]
        lines += [(f"**art_nb / Unsloth step time = {c['art_nb_over_unsloth_time']:.2f}**; "
                   + ("goals met." if not missed else "goal **missed**: " + "; ".join(missed) + ".")), ""]
    share = uns.get("unsloth_vllm") or uns.get("cap", {})  # "cap" in runs before 9ddf466 (where it stayed empty)
    if share.get("vllm_share_of_device") is not None:
        lines += [(f"Unsloth was shown a {share.get('unsloth_sees_total_gib')} GiB device: it gave vLLM "
                   f"{share.get('unsloth_share_of_cap')} of it (standby), {share.get('vllm_share_of_device')} of this "
                   "GPU. Memory: device-wide used (total - free), sampled every 50 ms."), ""]
    return lines + failures(sections)


def gpu_startup(data: dict[str, Any] | None) -> list[str]:
    lines = ["## Start-up: register with vLLM + Unsloth in a fresh process", ""]
    if not data:
        return lines + ["Not run yet (`bench/gpu_startup.py`, on the H200).", ""]
    lines += [context(data), "", f"Model: {data.get('model')}.", "", "| vLLM start-up | register (s) | phases |",
              "|---|---|---|"]
    for mode, section in data.get("sections", {}).items():
        lines.append(f"| {mode} | {section.get('register_s', '-')} | {section.get('startup', section.get('error', '-'))} |")
    return lines + [""] + failures(data.get("sections", {}))


# The results table: what each benchmark measures and its goal, in the order the table shows them.
BENCHMARKS = {
    "cpu_demo": ("`bash scripts/demo.sh`: SmolLM2-135M learns tic-tac-toe (base -> trained, fixed games)",
                 "the evaluation improves"),
    "cpu_train_step": ("a GRPO step vs TRL's `GRPOTrainer` (24 tic-tac-toe trajectories)", ">= 1.5x, less memory"),
    "endpoint_overhead": ("the OpenAI endpoint vs calling the engine directly", "< 10%"),
    "endpoint_per_request": ("CPU per chat completion: `model.openai_client()` (in-process) vs HTTP", "-"),
    "hf_prefix_cache": ("multi-turn rollouts with the transformers engine's prefix cache on vs off", "faster, same replies"),
    "hf_adapter_swap": ("a step's adapter hand-over in the transformers engine", "-"),
    "load_endpoint": ("256 concurrent 3-turn rollouts, twice, a train step in the middle", "0 failed"),
    "loss_menu_cpu": ("each loss of the menu on a tiny task, 15 steps", "the reward rises"),
    "sft_warm_start_cpu": ("SFT on 8 demonstrations before 3 GRPO steps", "-"),
    "cpu_threads": ("torch threads on a 2-core CPU", "-"),
    "gpu_tictactoe": ("SmolLM2-135M learns tic-tac-toe with vLLM + Unsloth", "-"),
    "gpu_startup": ("register with vLLM + Unsloth (SmolLM2-135M) in a fresh process", "< 90 s"),
    "gpu_throughput": ("rollout tokens/s, 3B shape: the endpoint vs plain `vllm.LLM`, vLLM's own OpenAI server "
                       "and art_nb's engine called directly", ">= 0.95 of the engine called directly"),
    "gpu_step": ("a GRPO step vs TRL with colocated vLLM, 3B shape, 64 x 128 tokens (and `art.pipeline`)",
                 ">= 1.3x (pipelined >= 1.5x), overhead < 5%, swap <= 50 ms"),
    "cpu_pipeline": ("`art.pipeline` vs the synchronous loop on a 2-core CPU (SmolLM2, tic-tac-toe)",
                     "the plan's CPU default"),
    "gpu_t4_vs_unsloth": ("T4 settings (15 GiB cap, 3B 4-bit) vs Unsloth's own T4 GRPO recipe", "<= 1.0x time, <= its memory"),
    "gpu_memory_fit": ("the 2048 notebook's 3B 4-bit configuration under a 15 GiB cap", "peak < 12 GiB"),
}


def latest_rows(rows: list[dict[str, Any]], root: Path = ROOT) -> list[dict[str, Any]]:
    """The newest run of each benchmark on each machine among the files bench/results/ still holds."""
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        if row["benchmark"] in BENCHMARKS and run_history.kept(row, root):
            key = (row["benchmark"], row["machine"].split(",")[0])
            if key not in latest or row["date"] > latest[key]["date"]:
                latest[key] = row
    order = list(BENCHMARKS)
    return sorted(latest.values(), key=lambda r: (order.index(r["benchmark"]), r["machine"]))


def results_table(rows: list[dict[str, Any]], base: str = "") -> list[str]:
    """The README's table (and RESULTS.md's first): one row per benchmark, each linking its raw file."""
    lines = ["| benchmark | machine | result | goal | raw |", "|---|---|---|---|---|"]
    for r in rows:
        what, goal = BENCHMARKS[r["benchmark"]]
        lines.append(f"| {what} | {r['machine']} | {r['result'].replace('|', '/')} | {goal} | "
                     f"[{Path(r['file']).name}]({base}{r['file']}) |")
    return lines


def write_readme_table(readme: Path, lines: list[str]) -> None:
    """Replace what sits between the README's results markers with `lines`."""
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        return
    head, rest = text.split(README_START, 1)
    readme.write_text(head + README_START + "\n" + "\n".join(lines) + "\n" + README_END + rest.split(README_END, 1)[1])


def readme_block(readme: Path) -> list[str]:
    """What sits between the README's results markers now."""
    text = readme.read_text()
    return text.split(README_START, 1)[1].split(README_END, 1)[0].strip("\n").splitlines() if README_START in text else []

def failures(sections: dict[str, Any]) -> list[str]:
    failed = [(k, v) for k, v in sections.items() if v.get("status") == "error"]
    return [f"- `{k}` failed: {v.get('error', '')[:300]}" for k, v in failed] + ([""] if failed else [])


def plot(results: dict[str, dict[str, Any] | None], path: Path) -> str:
    """One figure, a panel per benchmark that has data: raw repeats as points, medians as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("cpu_train_step", "endpoint_overhead", "gpu_throughput", "gpu_step") if results.get(k)]
    if not panels:
        return "no results to plot"
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, name in zip(axes[0], panels):
        data = results[name]
        if name == "cpu_train_step" and "runs" in data:
            for i, side in enumerate(("art_nb", "trl")):
                runs = data["runs"][side]
                values = [r.get("cpu_s", r["seconds"]) for r in runs]
                ax.bar(i, median(values), color=("#3b7dd8", "#b0b0b0")[i])
                ax.scatter([i] * len(values), values, color="black", s=12, zorder=3)
                peak = max(r["peak_rss_mib"] for r in runs) / 1024
                ax.text(i, median(values) * 0.05, f"peak RSS\n{peak:.1f} GiB", ha="center", va="bottom", fontsize=8,
                        color="white")
            ax.set_xticks([0, 1], ["art_nb", f"TRL {data['versions'].get('trl', '')}"])
            ax.set_ylabel("CPU seconds per step (lower is better)")
            ax.set_title("GRPO step, CPU, SmolLM2-135M")
        elif name == "endpoint_overhead":
            rows = [s for s in data.get("sections", {}).values() if s.get("status") == "ok"]
            ax.bar([str(s["concurrency"]) for s in rows], [100 * s["overhead"] for s in rows], color="#3b7dd8")
            ax.axhline(10, color="red", lw=1, ls="--", label="goal: < 10%")
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel("endpoint overhead (%)")
            ax.set_title("OpenAI endpoint vs direct, CPU")
            ax.legend(fontsize=8)
        elif name == "gpu_throughput":
            comparison = data.get("sections", {}).get("comparison", {})
            by_mode = comparison.get("startup", {})  # the first mode measured: the default
            ratios = next((m["ratios"] for m in by_mode.values() if m.get("ratios")), {})
            batches = list(ratios)
            x = range(len(batches))
            ax.bar([i - 0.2 for i in x], [ratios[b]["plain_tokens_per_s"] for b in batches], 0.4, label="plain vLLM",
                   color="#b0b0b0")
            ax.bar([i + 0.2 for i in x], [ratios[b]["endpoint_tokens_per_s"] for b in batches], 0.4,
                   label="art_nb endpoint", color="#3b7dd8")
            ax.set_xticks(list(x), batches)
            ax.set_xlabel("batch size")
            ax.set_ylabel("tokens/s")
            ax.set_title("Rollout throughput, 3B (random weights)")
            ax.legend(fontsize=8)
        elif name == "gpu_step":
            sections = data.get("sections", {})
            art = sections.get("art", {}).get("step_stats", {})
            trl = sections.get("trl", {}).get("step_stats", {})
            parts = [("rollout_s", "rollouts"), ("time/pause", "pause+sleep"), ("time/train", "train"),
                     ("time/save", "save"), ("time/swap", "wake+LoRA")]
            bottom = 0.0
            for key, label in parts:
                value = art.get(key, {}).get("mean", 0.0)
                ax.bar(0, value, bottom=bottom, label=label)
                bottom += value
            if trl:
                ax.bar(1, trl["wall_s"]["mean"], color="#b0b0b0", label="TRL step")
            ax.set_xticks([0, 1], ["art_nb", "TRL"])
            ax.set_ylabel("seconds per step")
            ax.set_title("GRPO step, 3B (random weights)")
            ax.legend(fontsize=7)
        if data.get("settings", {}).get("quick"):
            ax.set_title(ax.get_title() + " (DRY RUN)", color="red")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def one_line(path: Path) -> str:
    """A results file in one line: each section's status, then the verdict (what run_h200.sh prints)."""
    if not path.exists():
        return f"{path.name}: not written"
    data = json.loads(path.read_text())
    sections = data.get("sections", {})
    states = ", ".join(f"{k} {v.get('status', 'running')}" for k, v in sections.items() if k != "comparison")
    verdict = sections.get("comparison", sections.get("verdict", {})).get("summary", "no verdict")
    return f"{data.get('benchmark', path.stem)}: {states}; {verdict}"


NAMES = ("cpu_train_step", "endpoint_overhead", "gpu_throughput", "gpu_step", "gpu_t4_vs_unsloth", "gpu_memory_fit",
         "gpu_startup")


def results_markdown(results: dict[str, dict[str, Any] | None], rows: list[dict[str, Any]], figure: str) -> str:
    """RESULTS.md: the latest run of each benchmark, the details of the main ones, then every run."""
    lines = ["# Benchmark results", "",
             ("Generated by `bench/make_table.py` from the raw files in `bench/results/` (every repeat is there, with "
              "the command, machine and versions) and the run history in `bench/results/history.jsonl`; do not edit "
              "by hand. How to reproduce: `bench/README.md`."), "",
             f"![benchmarks]({figure})", "", "## The latest run of each benchmark", ""]
    lines += results_table(latest_rows(rows), base="../") + [""]
    lines += cpu_train_step(results["cpu_train_step"])
    lines += endpoint_overhead(results["endpoint_overhead"])
    lines += gpu_startup(results["gpu_startup"])
    lines += gpu_throughput(results["gpu_throughput"])
    lines += gpu_step(results["gpu_step"])
    lines += gpu_t4_vs_unsloth(results["gpu_t4_vs_unsloth"])
    lines += gpu_memory_fit(results["gpu_memory_fit"])
    lines += ["## Every run", "",
              ("One row per run of a benchmark, a GPU test session or a notebook run on the GPU, oldest first: the "
               "files of older runs have left the tree (git history keeps them), their numbers stay here. The commit is "
               "the code the run ran, where it is known."), ""]
    lines += run_history.render(rows, base="../")
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS.md")
    parser.add_argument("--plot", type=Path, default=ROOT / "assets" / "benchmarks.png")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md", help="whose results table to rewrite")
    parser.add_argument("--commit", default=None, help="the commit the new results files ran (a GPU run's JSON may "
                                                        "name a stale one)")
    parser.add_argument("--one-line", type=Path, default=None, metavar="JSON", help="print one results file's verdict")
    args = parser.parse_args()
    if args.one_line:
        print(one_line(args.one_line))
        return
    added = run_history.update(commit=args.commit)
    rows = run_history.read()
    results = {name: load(args.results, name) for name in NAMES}
    figure = plot(results, args.plot)
    relative = Path("..") / figure if not figure.startswith("/") else figure
    args.out.write_text(results_markdown(results, rows, str(relative)))
    write_readme_table(args.readme, results_table(latest_rows(rows)))
    print(f"wrote {args.out}, {figure} and the README's table; {len(added)} new run(s) in the history")


if __name__ == "__main__":
    main()
