"""bench/RESULTS.md and assets/benchmarks.png, generated from the raw results in bench/results/*.json.

Every number in the table is computed from the JSON files (medians of the raw repeats stored there);
a benchmark whose file is missing, or whose section failed, says so instead of showing a number.

    .venv/bin/python bench/make_table.py [--results bench/results] [--out bench/RESULTS.md] [--plot assets/benchmarks.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


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


LATER_THROUGHPUT = "gpu_throughput_fast_switch_interval"  # h200/: the run after the GIL switch-interval change


def gpu_throughput(data: dict[str, Any] | None) -> list[str]:
    lines = ["## Rollout throughput on GPU: art_nb's endpoint vs plain vLLM", ""]
    if not data:
        return lines + ["Not run yet (`bench/gpu_throughput.py`, on the H200).", ""]
    if "startup" in data.get("settings", {}):  # issue-15 format (one table per vLLM start-up mode)
        lines += gpu_throughput_by_startup(data)
        later = load(RESULTS, LATER_THROUGHPUT)
        if later:
            lines += [f"### A later run: the engine's thread gets the GIL back sooner (`h200/{LATER_THROUGHPUT}.json`)", "",
                      ("The same script with `--startup fast` after the vLLM thread lowered Python's GIL switch interval "
                       "to 0.5 ms (art_nb/local/engines/vllm/thread.py): with CUDA graphs a decode step is ~3 ms, and CPython's "
                       "5 ms default let the endpoint's and the client's threads hold the GIL that long after each GPU "
                       "wait. Plain vLLM was measured again in this run (this host's speed moves ~10% between runs)."), ""]
            lines += [line.replace("### vLLM start-up", "#### vLLM start-up") for line in gpu_throughput_by_startup(later)]
        return lines
    sections = data.get("sections", {})
    lines += [context(data), "", (f"Model: {data.get('weights')}. {data['settings']['completion_tokens']} tokens per "
              f"request (fixed), vLLM {data['settings']['vllm']}. Median tokens/s of "
              f"{data['settings']['repeats']} repeats."), "",
              ("| batch | plain `LLM.generate` | art_nb engine, driven like `LLM.generate` | art_nb engine, direct "
               "(asyncio driver) | art_nb endpoint | endpoint / plain | transformers engine (endpoint) |"),
              "|---|---|---|---|---|---|---|"]
    ratios = sections.get("comparison", {}).get("ratios", {})
    hf = sections.get("comparison", {}).get("hf_endpoint_tokens_per_s", {})

    def cell(r: dict[str, Any], mode: str, key: str) -> str:
        ms = r.get("ms_per_step", {}).get(mode)
        rate = r.get(key)
        if rate is None:
            return "-"
        return f"{rate:.0f}" + (f" ({ms:.1f} ms/step)" if ms is not None else "")

    for batch, r in ratios.items():
        hf_cell = f"{hf[batch]:.0f}" if batch in hf else ""
        lines.append(f"| {batch} | {cell(r, 'plain', 'plain_tokens_per_s')} | "
                     f"{cell(r, 'engine_sync', 'engine_sync_tokens_per_s')} | "
                     f"{cell(r, 'engine_direct', 'engine_direct_tokens_per_s')} | "
                     f"{cell(r, 'endpoint', 'endpoint_tokens_per_s')} | {r['endpoint_over_plain']:.2f} | {hf_cell} |")
    lines += failures(sections)
    previous = load(RESULTS, "gpu_throughput_run2")
    if previous:
        old = previous.get("sections", {}).get("comparison", {}).get("ratios", {})
        lines += ["", ("The previous run with the same engine code (`h200/gpu_throughput_run2.json`, earlier the same "
                  "day) measured endpoint / plain " + ", ".join(f"{r['endpoint_over_plain']:.2f} at {b}" for b, r in old.items())
                  + ": on this shared host a run's ratios move by ~0.1 from run to run. Where the time goes "
                  "(per-step timing of `step()` in every mode, `h200/gpu_throughput.json`): the asyncio driver adds "
                  "0.4 ms a step between steps; the endpoint's cost is per request (rendering, JSON with 128 logprobs "
                  "each, the OpenAI client parsing it, all in this process) and shows before the first and after the "
                  "last step.")]
    before = load(RESULTS, "gpu_throughput_before_scheduler_fix")
    if before:
        old = before.get("sections", {}).get("comparison", {}).get("ratios", {})
        lines += ["", ("Before the engine used `vllm.LLM`'s scheduler defaults (same script, same H200, earlier the same "
                  "day; `h200/gpu_throughput_before_scheduler_fix.json`): endpoint / plain "
                  + ", ".join(f"{r['endpoint_over_plain']:.2f} at {b}" for b, r in old.items())
                  + "; the engine then ran at most 128 sequences and 2048 tokens a step.")]
    return lines + ["", "Goal: endpoint / plain >= 0.9.", ""]


THROUGHPUT_GOAL = 0.95  # issue 15: the endpoint >= 0.95x plain vLLM at 8, 64 and 256, graphs on and off


def gpu_throughput_by_startup(data: dict[str, Any]) -> list[str]:
    """The issue-15 format: one table per vLLM start-up mode; the endpoint without logprobs is the headline."""
    sections, st = data.get("sections", {}), data["settings"]
    comparison = sections.get("comparison", {"startup": {}})
    lines = [context(data), "", (f"Model: {data.get('weights')}. {st['completion_tokens']} tokens per request (fixed); "
             f"median tokens/s of {st['repeats']} runs (plain, endpoint) and {st.get('side_repeats', st['repeats'])} "
             "(the other modes). Both sides use the same engine arguments (art_nb's `engine_args` for the mode). "
             "**endpoint**: `chat.completions.create` as a user's rollout calls it (art_nb returns token ids and "
             "logprobs anyway); **+logprobs**: the same with `logprobs=True`; **direct**: `engine.generate`, no HTTP."), ""]
    if not comparison.get("startup"):
        lines += ["No comparison yet: the run was cut short or is still going (sections: "
                  + ", ".join(f"{k} {v.get('status', 'running')}" for k, v in sections.items()) + ").", ""]
    for mode, found in comparison.get("startup", {}).items():
        graphs = describe_graphs(found.get("graph_setting"))
        same = found.get("same_graph_setting")
        lines += [f"### vLLM start-up \"{mode}\" ({graphs}{'' if same is not False else '; ENGINES DIFFER'})", "",
                  (f"Start-up: plain `LLM(...)` {found.get('plain_init_s', '-')} s, art_nb register "
                   f"{found.get('art_register_s', '-')} s."), "",
                  ("| concurrent | plain tok/s | endpoint tok/s | **endpoint / plain** | +logprobs / plain | direct / plain "
                   "| ms/step plain, endpoint | before first + after last step, endpoint (ms) |"),
                  "|---|---|---|---|---|---|---|---|"]
        for batch, r in found.get("ratios", {}).items():
            ms = r.get("ms_per_step", {})
            edge = [r.get(k, {}).get("endpoint") for k in ("lead_ms", "tail_ms")]
            mark = "" if r["endpoint_over_plain"] >= THROUGHPUT_GOAL else " (missed)"
            lines.append(f"| {batch} | {r['plain_tokens_per_s']:.0f} | {r['endpoint_tokens_per_s']:.0f} | "
                         f"**{r['endpoint_over_plain']:.2f}**{mark} | {_fmt(r.get('endpoint_logprobs_over_plain'))} | "
                         f"{_fmt(r.get('engine_direct_over_plain'))} | {_fmt(ms.get('plain'), 1)}, "
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
    # Before issue 15 a failed TRL side borrowed the previous run's; a run with start-up modes stands alone.
    earlier = None if "vllm_startup" in st else load(RESULTS, "gpu_step_run1")
    if trl.get("status") != "ok" and earlier and earlier["sections"].get("trl", {}).get("status") == "ok":
        trl = earlier["sections"]["trl"]
        old_art = earlier["sections"].get("art", {}).get("step_stats", {})
        lines += [("TRL's side below comes from the previous run of this script on the same H200 the same day "
                   f"(`h200/gpu_step_run1.json`, {earlier.get('date', '?')[:16]}); in that run art_nb, before vLLM "
                   "stayed awake through training and before its 8192-token steps, took "
                   f"{old_art.get('wall_s', {}).get('mean', 0):.2f} s a step (overhead "
                   f"{old_art.get('overhead_share', {}).get('mean', 0):.1%})."), ""]
    if trl.get("status") == "ok":
        trl_s = trl["step_stats"]["wall_s"]["mean"]
        lines += [(f"TRL {data['versions'].get('trl')}: {trl_s:.2f} s per step "
                  f"(every step: {', '.join(str(s['wall_s']) for s in trl['steps'])}); peak GPU memory used "
                  f"{trl.get('peak_gpu_used_gib')} GiB."), ""]
        if art.get("status") == "ok":
            art_s = art["step_stats"]["wall_s"]["mean"]
            goal = "goal >= 1.3" if "vllm_startup" in st else "goal: art_nb faster, > 1"
            missed = " **missed**" if verdict.get("step_goal_met") is False else ""
            lines += [f"**TRL step / art_nb step = {trl_s / art_s:.2f}** ({goal}){missed}.", ""]
    for key, label in (("overhead_goal_met", "overhead outside rollouts and training < 5%"),
                       ("swap_goal_met", "adapter hand-over (`time/swap`) <= 50 ms")):
        if key in verdict:
            lines += [f"Goal {label}: {'met' if verdict[key] else '**missed**'}.", ""]
    before = load(RESULTS, "gpu_step_before_background_checkpoint")
    if before and before.get("sections", {}).get("art", {}).get("status") == "ok":
        old = before["sections"]["art"]["step_stats"]
        lines += [("Before the checkpoint was finished in the background (`h200/gpu_step_before_background_checkpoint"
                   f".json`): save {old['time/save']['mean']:.2f} s, whole step {old['wall_s']['mean']:.2f} s, overhead "
                   f"{old['overhead_share']['mean']:.1%}. Since 2026-12-02 `time/save` is a CPU copy of the adapter and "
                   "`time/swap` vLLM taking those tensors (no file on the step's path); the whole checkpoint (adapter "
                   "file, optimizer state, fsync, rename) is written in the background during the next rollouts."), ""]
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
    bf16 = load(RESULTS, "gpu_memory_fit_vllm_bf16_7c80458")
    if bf16 and data.get("settings", {}).get("vllm_4bit"):
        lines += _fit_comparison(sections, bf16.get("sections", {}))
    old = load(RESULTS, "gpu_memory_fit_run3_old_margin")
    if old and "fits" in old.get("sections", {}).get("verdict", {}):
        v = old["sections"]["verdict"]
        lines += [(f"With the plan's earlier margin (1.5 GiB kept back; `h200/gpu_memory_fit_run3_old_margin.json`) the "
                   f"peak was {v['peak_used_gib']} GiB: {v['summary']}. The plan now keeps back max(3 GiB, 8%)."), ""]
    return lines + failures(sections)


def _kv_tokens(sections: dict[str, Any]) -> str:
    reasons = sections.get("register", {}).get("engine_reasons", [])
    found = [r.rsplit("KV for ~", 1)[-1].split(" ")[0] for r in reasons if "gpu_memory_utilization=" in r and "KV for ~" in r]
    return found[0] if found else "-"


def _fit_comparison(nf4: dict[str, Any], bf16: dict[str, Any]) -> list[str]:
    """The same configuration with vLLM serving bf16 weights (run just before, same machine and commit)."""
    rows = [("peak device memory used (GiB)", lambda s: s.get("verdict", {}).get("peak_used_gib", "-")),
            ("KV cache planned (tokens)", _kv_tokens),
            ("rollouts: 64 games of ~3900 tokens (s)", lambda s: s.get("rollouts", {}).get("seconds", "-")),
            ("train step (s)", lambda s: s.get("train_step", {}).get("seconds", "-")),
            ("mismatch KL, sampler vs trainer", lambda s: round(s.get("train_step", {}).get("metrics", {})
                                                                 .get("mismatch_kl", float("nan")), 3))]
    lines = ["vLLM's weights as NF4 (`ModelConfig.vllm_4bit`, on by default with a 4-bit trainer) against the same "
             "configuration with vLLM serving bf16 weights (`--vllm-4bit off`, `h200/gpu_memory_fit_vllm_bf16_7c80458.json`, "
             "the run before on the same machine):", "", "| | vLLM NF4 (the trainer's weights) | vLLM bf16 |", "|---|---|---|"]
    lines += [f"| {name} | {get(nf4)} | {get(bf16)} |" for name, get in rows]
    return lines + ["", ("Both at 7c80458, where PyTorch's cap was the whole 15 GiB although the CUDA context (~0.6 GiB) "
                         "sat outside it; a real 15 GiB GPU has that much less free, and the benchmark now caps PyTorch "
                         "at the cap less the context (e0c28f3)."), ""]


# art_nb's engine in the T4 head to head (runs before 2026-12-02's --art-engine used the transformers engine)
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
    share = uns.get("cap", {})
    if share.get("vllm_share_of_device") is not None:
        lines += [(f"Unsloth was shown a {share.get('unsloth_sees_total_gib')} GiB device: it gave vLLM "
                   f"{share.get('unsloth_share_of_cap')} of it (standby), {share.get('vllm_share_of_device')} of this "
                   "GPU. Memory: device-wide used (total - free), sampled every 50 ms."), ""]
    return lines + failures(sections)


def summary_table(results: dict[str, dict[str, Any] | None]) -> list[str]:
    """The README's table: one row per benchmark, art_nb against its peer, from the same JSON."""
    rows = ["| benchmark | art_nb | peer | ratio | goal |", "|---|---|---|---|---|"]
    cts = results.get("cpu_train_step")
    if cts and "summary" in cts:
        s = cts["summary"]
        a, t = s["seconds"]["art_nb"]["median"], s["seconds"]["trl"]["median"]
        rows.append(f"| GRPO step, CPU, SmolLM2-135M, 24 trajectories | {a:.1f} s, {s['peak_rss_mib']['art_nb'] / 1024:.1f} GiB "
                    f"| TRL {cts['versions'].get('trl')}: {t:.1f} s, {s['peak_rss_mib']['trl'] / 1024:.1f} GiB "
                    f"| {t / a:.2f}x faster | >= 1.5x, less memory |")
    eo = results.get("endpoint_overhead")
    if eo:
        ok = [v for v in eo.get("sections", {}).values() if v.get("status") == "ok"]
        if ok:
            worst = max(ok, key=lambda v: v["overhead"])
            overheads = ", ".join(format(v["overhead"], "+.1%") for v in ok)
            levels = ", ".join(str(v["concurrency"]) for v in ok)
            rows.append(f"| OpenAI endpoint vs engine called directly, CPU | {overheads} at {levels} concurrent | "
                        f"direct calls | worst {worst['overhead']:+.1%} | < 10% |")
    tp = results.get("gpu_throughput")
    ratios = (tp or {}).get("sections", {}).get("comparison", {}).get("ratios", {})
    for mode, found in (tp or {}).get("sections", {}).get("comparison", {}).get("startup", {}).items():
        r = found.get("ratios", {})
        if r:
            rows.append(f"| rollout tokens/s, H200, 3B (random weights), endpoint, vLLM \"{mode}\" | "
                        + ", ".join(f"{v['endpoint_tokens_per_s']:.0f}" for v in r.values()) + " at "
                        + ", ".join(r) + " concurrent | plain vLLM: "
                        + ", ".join(f"{v['plain_tokens_per_s']:.0f}" for v in r.values()) + " | "
                        + ", ".join(f"{v['endpoint_over_plain']:.2f}" for v in r.values())
                        + f" | >= {THROUGHPUT_GOAL}" + ("" if all(v["endpoint_over_plain"] >= THROUGHPUT_GOAL
                                                             for v in r.values()) else " (missed)") + " |")
    later = load(RESULTS, LATER_THROUGHPUT) if tp else None
    for mode, found in (later or {}).get("sections", {}).get("comparison", {}).get("startup", {}).items():
        r = found.get("ratios", {})
        if r:
            rows.append(f"| the same, vLLM \"{mode}\", GIL switch interval 0.5 ms (later run) | "
                        + ", ".join(f"{v['endpoint_tokens_per_s']:.0f}" for v in r.values()) + " | plain vLLM: "
                        + ", ".join(f"{v['plain_tokens_per_s']:.0f}" for v in r.values()) + " | "
                        + ", ".join(f"{v['endpoint_over_plain']:.2f}" for v in r.values())
                        + f" | >= {THROUGHPUT_GOAL}" + ("" if all(v["endpoint_over_plain"] >= THROUGHPUT_GOAL
                                                             for v in r.values()) else " (missed)") + " |")
    if ratios:
        rows.append("| rollout tokens/s, H200, 3B (random weights), endpoint | "
                    + ", ".join(f"{r['endpoint_tokens_per_s']:.0f}" for r in ratios.values()) + " at "
                    + ", ".join(ratios) + " concurrent | plain vLLM: "
                    + ", ".join(f"{r['plain_tokens_per_s']:.0f}" for r in ratios.values()) + " | "
                    + ", ".join(f"{r['endpoint_over_plain']:.2f}" for r in ratios.values()) + " | >= 0.9 |")
    step = results.get("gpu_step")
    art = (step or {}).get("sections", {}).get("art", {})
    new_format = "vllm_startup" in (step or {}).get("settings", {})
    earlier = None if new_format else load(RESULTS, "gpu_step_run1")
    trl = (step or {}).get("sections", {}).get("trl")
    when = ""
    if not trl and earlier:
        trl, when = earlier.get("sections", {}).get("trl", {}), " (previous run of the script)"
    if art.get("status") == "ok" and trl and trl.get("status") == "ok":
        a, t = art["step_stats"]["wall_s"]["mean"], trl["step_stats"]["wall_s"]["mean"]
        goal = ">= 1.3, overhead < 5%" if new_format else "> 1, overhead < 5%"
        rows.append(f"| GRPO step, H200, 3B, 64 rollouts x 128 tokens | {a:.2f} s ({art['step_stats']['overhead_share']['mean']:.0%} "
                    f"overhead) | TRL colocated{when}: {t:.2f} s | {t / a:.2f} | {goal} |")
    t4_data = results.get("gpu_t4_vs_unsloth") or {}
    t4 = t4_data.get("sections", {}).get("comparison", {})
    if t4.get("art_nb_over_unsloth_time") is not None:
        engine = _T4_ENGINES[t4_data.get("settings", {}).get("art_engine", "hf")]
        rows.append(f"| GRPO step, T4 settings (H200 capped at 15 GiB), 3B 4-bit, art_nb serving with the {engine} | "
                    f"{t4['art_nb_step_s']:.2f} s, peak "
                    f"{t4['art_nb_peak_gib']} GiB | Unsloth's T4 recipe: {t4['unsloth_step_s']:.2f} s, peak "
                    f"{t4['unsloth_peak_gib']} GiB | {t4['art_nb_over_unsloth_time']:.2f} | <= 1.0, <= its memory |")
    fit = results.get("gpu_memory_fit")
    verdict = (fit or {}).get("sections", {}).get("verdict", {})
    if "fits" in verdict:
        bf16 = (load(RESULTS, "gpu_memory_fit_vllm_bf16_7c80458") or {}).get("sections", {}).get("verdict", {})
        peer = f"vLLM bf16 weights: peak {bf16['peak_used_gib']} GiB" if "peak_used_gib" in bf16 else "-"
        met = "met" if verdict["peak_used_gib"] < 12.0 else "missed"
        rows.append(f"| 3B 4-bit, 2048-notebook shapes, under a 15 GiB cap, vLLM NF4 | peak {verdict['peak_used_gib']} GiB"
                    f" | {peer} | {'fits' if verdict['fits'] else 'does not fit'} | peak < 12 GiB ({met}) |")
    return rows


def write_readme_table(readme: Path, rows: list[str]) -> None:
    """Replace what sits between the README's bench markers with `rows`."""
    start, end = "<!-- bench:start (bench/make_table.py) -->", "<!-- bench:end -->"
    text = readme.read_text()
    if start not in text or end not in text:
        return
    head, rest = text.split(start, 1)
    readme.write_text(head + start + "\n" + "\n".join(rows) + "\n" + end + rest.split(end, 1)[1])


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
            by_mode = comparison.get("startup", {})  # issue-15 format: the first mode measured (the default)
            ratios = comparison.get("ratios") or next((m["ratios"] for m in by_mode.values() if m.get("ratios")), {})
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
            earlier = None if "vllm_startup" in data.get("settings", {}) else load(RESULTS, "gpu_step_run1")
            if not trl and earlier:  # before issue 15: TRL's side from the previous run (see RESULTS.md)
                trl = earlier["sections"].get("trl", {}).get("step_stats", {})
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
    """A results file in one line: each section's status, then the verdict (what run_issue15_h200.sh prints)."""
    if not path.exists():
        return f"{path.name}: not written"
    data = json.loads(path.read_text())
    sections = data.get("sections", {})
    states = ", ".join(f"{k} {v.get('status', 'running')}" for k, v in sections.items() if k != "comparison")
    verdict = sections.get("comparison", sections.get("verdict", {})).get("summary", "no verdict")
    return f"{data.get('benchmark', path.stem)}: {states}; {verdict}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS.md")
    parser.add_argument("--plot", type=Path, default=ROOT / "assets" / "benchmarks.png")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md", help="whose bench table to rewrite")
    parser.add_argument("--one-line", type=Path, default=None, metavar="JSON", help="print one results file's verdict")
    args = parser.parse_args()
    if args.one_line:
        print(one_line(args.one_line))
        return
    names = ("cpu_train_step", "endpoint_overhead", "gpu_throughput", "gpu_step", "gpu_t4_vs_unsloth", "gpu_memory_fit")
    results = {name: load(args.results, name) for name in names}
    figure = plot(results, args.plot)
    lines = ["# Benchmark results", "",
             ("Generated by `bench/make_table.py` from the raw JSON in `bench/results/` (every repeat is there, with "
             "the command, machine and versions); do not edit by hand. How to reproduce: `bench/README.md`."), "",
             f"![benchmarks]({Path('..') / figure if not figure.startswith('/') else figure})", ""]
    lines += cpu_train_step(results["cpu_train_step"])
    lines += endpoint_overhead(results["endpoint_overhead"])
    lines += gpu_throughput(results["gpu_throughput"])
    lines += gpu_step(results["gpu_step"])
    lines += gpu_t4_vs_unsloth(results["gpu_t4_vs_unsloth"])
    lines += gpu_memory_fit(results["gpu_memory_fit"])
    args.out.write_text("\n".join(lines).rstrip() + "\n")
    write_readme_table(args.readme, summary_table(results))
    print(f"wrote {args.out} and {figure}")


if __name__ == "__main__":
    main()
