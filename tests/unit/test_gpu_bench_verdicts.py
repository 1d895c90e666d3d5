"""The GPU benchmarks' pure parts: ratios, goals, graph settings, the tables made from them.

The scripts run on an H200 only; what decides their verdicts (which number is over which, whether both
engines ran alike, whether a goal is missed) is plain Python and is checked here on synthetic results.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str) -> Any:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FAST = {"enforce_eager": False, "compile_mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY",
        "max_cudagraph_capture_size": 512}


def row(*rates: float, tokens: int = 1024) -> dict[str, Any]:
    """A side's row as `summarize` writes it: every repeat's seconds for the same tokens, and the median rate."""
    return {"seconds": [tokens / r for r in rates], "tokens": [tokens] * len(rates),
            "tokens_per_s_stats": {"median": statistics.median(rates)}}


def throughput_sections() -> dict[str, Any]:
    return {
        "fast/plain_vllm": {"status": "ok", "init_s": 40.0, "graph_setting": FAST,
                            "batches": {"8": row(1000.0, 990.0, 1010.0), "64": row(8000.0, 8100.0, 7900.0),
                                        "256": {"skipped": "deadline"}}},
        "fast/art_vllm": {"status": "ok", "register_s": 50.0, "graph_setting": FAST,
                          "batches": {"8": {"endpoint": row(960.0, 950.0, 970.0),
                                            "endpoint_logprobs": row(900.0, 900.0),  # a diagnostic: fewer repeats
                                            # faster than plain in one round, slower in two: not settled
                                            "engine_direct": row(990.0, 1000.0, 995.0)},
                                      "64": {"endpoint": row(7000.0, 7100.0, 6900.0),
                                             "engine_direct": row(7900.0, 7800.0, 8000.0, tokens=1000)}}},
    }


def test_throughput_compare_puts_the_endpoint_over_plain_and_judges_the_goal() -> None:
    tp = load("gpu_throughput")
    found = tp.compare(throughput_sections(), ["fast"])["startup"]["fast"]
    assert set(found["ratios"]) == {"8", "64"}  # a skipped batch has no ratio
    eight, sixty_four = found["ratios"]["8"], found["ratios"]["64"]
    assert eight["endpoint_over_plain"] == 0.96 and eight["goal_met"]
    assert eight["endpoint_logprobs_over_plain"] == 0.9
    assert sixty_four["endpoint_over_plain"] == 0.875 and not sixty_four["goal_met"]
    assert "endpoint_logprobs_over_plain" not in sixty_four
    assert eight["same_token_counts"] and not sixty_four["same_token_counts"]
    assert found["same_graph_setting"] is True
    assert (found["plain_init_s"], found["art_register_s"]) == (40.0, 50.0)


def test_throughput_compare_puts_the_endpoint_over_vllms_own_server_where_it_ran() -> None:
    tp = load("gpu_throughput")
    sections = throughput_sections()
    sections["fast/art_vllm"]["batches"]["8"]["endpoint_http"] = row(800.0, 820.0, 810.0)
    sections["fast/vllm_server"] = {"status": "ok", "batches": {"8": row(640.0, 650.0, 660.0)}}
    ratios = tp.compare(sections, ["fast"])["startup"]["fast"]["ratios"]
    assert ratios["8"]["vllm_server_tokens_per_s"] == 650.0
    assert ratios["8"]["endpoint_over_vllm_server"] == round(960 / 650, 3)
    assert ratios["8"]["endpoint_http_over_vllm_server"] == round(810 / 650, 3)
    assert "endpoint_over_vllm_server" not in ratios["64"]  # the server did not run at 64


def test_the_engine_arguments_become_vllms_server_flags() -> None:
    tp = load("gpu_throughput")
    argv = tp.server_argv({"model": "/m", "max_model_len": 2048, "enable_lora": True, "enforce_eager": False,
                           "structured_outputs_config": {"backend": "guidance"}, "quantization": None})
    assert argv == ["--model", "/m", "--max-model-len", "2048", "--enable-lora", "--no-enforce-eager",
                    "--structured-outputs-config", '{"backend": "guidance"}']


def test_throughput_compare_pairs_the_repeats_of_every_side_of_a_ratio() -> None:
    tp = load("gpu_throughput")
    eight = tp.compare(throughput_sections(), ["fast"])["startup"]["fast"]["ratios"]["8"]["head_to_head"]
    # endpoint_logprobs (a diagnostic with fewer repeats) is no side of a ratio
    assert set(eight["sides"]) == {"engine_direct", "endpoint", "plain"} and eight["enough_repeats"]
    assert eight["sides"]["plain"]["median"] == round(1024 / 1000, 4)
    assert eight["sides"]["endpoint"]["repeats"] == [round(1024 / r, 4) for r in (960, 950, 970)]
    assert eight["sides"]["endpoint"]["spread"] == round((1024 / 950 - 1024 / 970) / (1024 / 960), 4)
    # seconds for the same tokens: plain's over the endpoint's is the endpoint's rate over plain's
    endpoint = eight["ratios"]["plain/endpoint"]
    assert endpoint["of_medians"] == 0.96 and endpoint["holds"]
    assert endpoint["per_round"] == [round(e / p, 4) for p, e in ((1000, 960), (990, 950), (1010, 970))]
    direct = eight["ratios"]["plain/engine_direct"]
    assert direct["of_medians"] == round(995 / 1000, 4) and direct["max"] > 1 > direct["min"]
    assert not direct["holds"]
    common = load("_common")
    assert common.describe_ratio(eight, "plain/endpoint") == "0.96x (rounds 0.96-0.96, holds; n=3)"
    assert "NOT settled" in common.describe_ratio(eight, "plain/engine_direct")


def test_throughput_compare_reads_a_file_whose_rows_kept_only_their_rates() -> None:
    tp = load("gpu_throughput")
    sections = throughput_sections()
    for part in ("fast/plain_vllm", "fast/art_vllm"):
        for batch in sections[part]["batches"].values():
            for side in [batch, *(v for v in batch.values() if isinstance(v, dict))]:
                side.pop("seconds", None)
    ratios = tp.compare(sections, ["fast"])["startup"]["fast"]["ratios"]
    assert (ratios["8"]["endpoint_over_plain"], ratios["64"]["endpoint_over_plain"]) == (0.96, 0.875)
    assert "head_to_head" not in ratios["8"] and "head_to_head" not in ratios["64"]


def test_throughput_compare_notices_engines_that_ran_differently() -> None:
    tp = load("gpu_throughput")
    sections = throughput_sections()
    sections["fast/art_vllm"]["graph_setting"] = {**FAST, "compile_mode": "VLLM_COMPILE"}
    assert tp.compare(sections, ["fast"])["startup"]["fast"]["same_graph_setting"] is False


def test_a_part_stops_repeating_when_the_next_round_would_pass_the_deadline() -> None:
    import time

    tp = load("gpu_throughput")
    deadline = tp.Deadline(time.time() + 10, margin_s=1)
    assert deadline.fits()
    deadline.longest = 20.0
    assert not deadline.fits()
    deadline.longest = 5.0
    assert deadline.fits() and not deadline.fits(scale=2.0)


def turns(warmup: float, *seconds_per_step: float) -> list[dict[str, Any]]:
    """A resident side's turns: the untimed warm-up, then one per round."""
    return [{"s_per_step": warmup, "warmup": True}, *({"s_per_step": s, "warmup": False} for s in seconds_per_step)]


def step_sections(rounds: int = 3) -> dict[str, Any]:
    stats = lambda **means: {k: {"mean": v} for k, v in means.items()}
    return {"art": {"step_stats": stats(wall_s=2.0, overhead_share=0.08, **{"time/swap": 0.03, "time/save": 0.1}),
                    "graph_setting": FAST, "turns": turns(9.0, 2.0, 2.1, 1.9)[:rounds + 1]},
            # TRL / pipelined is 1.56 of the medians, but TRL was the faster in the third round: not settled
            "art_pipelined": {"turns": turns(9.0, 1.8, 1.7, 3.0)[:rounds + 1]},
            "trl": {"step_stats": stats(wall_s=2.8), "graph_setting": {**FAST, "cudagraph_mode": "PIECEWISE"},
                    "turns": turns(20.0, 2.8, 3.0, 2.7)[:rounds + 1]}}


def test_step_compare_judges_every_goal_and_the_graph_setting() -> None:
    step = load("gpu_step")
    out = step.compare(step_sections(), ["art_sync", "art_pipelined", "trl"])
    h2h = out["head_to_head"]
    assert h2h["sides"]["art_sync"]["repeats"] == [2.0, 2.1, 1.9]  # the warm-up turn (compiles) left out
    assert (h2h["sides"]["art_sync"]["median"], h2h["sides"]["trl"]["median"]) == (2.0, 2.8)
    assert out["steps_per_hour"] == {"art_pipelined": 2000.0, "art_sync": 1800.0, "trl": round(3600 / 2.8, 1)}
    assert h2h["ratios"]["trl/art_sync"]["per_round"] == [1.4, round(3.0 / 2.1, 4), round(2.7 / 1.9, 4)]
    assert out["trl_over_art_sync"] == 1.4 and out["art_sync_goal_met"] is True
    assert out["trl_over_art_nb"] == 1.4 and out["step_goal_met"] is True  # the fields earlier files had
    assert (out["art_nb_step_s"], out["trl_step_s"]) == (2.0, 2.8)
    assert out["trl_over_art_pipelined"] == round(2.8 / 1.8, 4) >= step.PIPELINE_GOAL
    assert out["art_pipelined_goal_met"] is False and not h2h["ratios"]["trl/art_pipelined"]["holds"]
    assert out["sync_over_pipelined"] == round(2.0 / 1.8, 4)
    assert "TRL / art_sync = 1.40x (rounds 1.40-1.43, holds; n=3) (goal >= 1.3)" in out["verdict"]
    assert "TRL / art_pipelined = 1.56x (rounds 0.90-1.76, NOT settled" in out["verdict"]
    assert out["overhead_goal_met"] is False and out["swap_goal_met"] is True
    assert out["same_graph_setting"] is False and "DIFFERENT" in out["verdict"]


def test_step_compare_wants_enough_rounds_and_reads_a_file_without_turns() -> None:
    step = load("gpu_step")
    out = step.compare(step_sections(rounds=2), ["art_sync", "trl"])
    assert out["trl_over_art_nb"] == round(2.9 / 2.05, 4) and out["head_to_head"]["ratios"]["trl/art_sync"]["holds"]
    assert out["step_goal_met"] is False  # two rounds agree, but fewer than MIN_REPEATS decide nothing
    assert "art_pipelined" not in out["head_to_head"]["sides"]  # not asked for: its section is ignored

    sections = step_sections()
    for entry in sections.values():
        entry.pop("turns")
    out = step.compare(sections, ["art_sync", "trl"])  # a run before interleaved turns: no ratio, still the rest
    assert out["head_to_head"]["ratios"] == {} and "trl_over_art_nb" not in out and "step_goal_met" not in out
    assert out["overhead_goal_met"] is False and out["same_graph_setting"] is False


def test_t4_compare_wants_no_more_time_and_no_more_memory_than_unsloth() -> None:
    t4 = load("gpu_t4_vs_unsloth")
    side = lambda mean, peak: {"steps": {"step_s": {"mean": mean}}, "peak_gpu_used_gib": peak}
    out = t4.compare({"art": side(9.0, 11.0), "unsloth": side(10.0, 12.5)})
    assert out["art_nb_over_unsloth_time"] == 0.9 and out["time_goal_met"] and out["memory_goal_met"]
    out = t4.compare({"art": side(12.0, 13.0), "unsloth": side(10.0, 12.5)})
    assert not out["time_goal_met"] and not out["memory_goal_met"]
    assert t4.compare({"art": side(12.0, 13.0)})["verdict"] == "incomplete"
    assert t4.step_summary([30.0, 5.0, 7.0])["step_s"]["mean"] == 6.0  # step 1 (compilation) left out
    # Sides cut short after step 1 (its compile time judged the next step too long): no seconds, no ratio
    only_first = t4.step_summary([41.8])
    assert only_first["step_s"] == {} and only_first["steps_used"] == []
    both_first = {name: {"steps": t4.step_summary([wall]), "peak_gpu_used_gib": 10.0} for name, wall in
                  (("art", 37.1), ("unsloth", 41.8))}
    assert "art_nb_over_unsloth_time" not in t4.compare(both_first)


def test_t4_sides_take_a_second_step_after_the_compiling_first() -> None:
    t4 = load("gpu_t4_vs_unsloth")
    now = time.time()
    assert not t4.next_step_would_pass([40.0], now + 20)  # a later step is ~1/10 of the first
    assert t4.next_step_would_pass([40.0], now + 5)
    assert t4.next_step_would_pass([40.0, 4.0, 5.0], now + 7) and not t4.next_step_would_pass([40.0, 4.0, 5.0], now + 9)


def test_startup_helpers_pick_the_switches_and_read_what_the_engine_ran() -> None:
    common = load("_common")
    assert common.startup_env("eager") == {"ART_NB_VLLM_STARTUP": "eager", "ART_NB_VLLM_ENFORCE_EAGER": "1"}
    assert common.startup_env("fast")["ART_NB_VLLM_ENFORCE_EAGER"] == "0"
    with pytest.raises(ValueError, match="startup mode"):
        common.startup_env("turbo")
    kwargs = {"model": "m", "enforce_eager": False, "compilation_config": {"mode": 0}, "max_lora_rank": 16}
    assert common.graph_kwargs(kwargs) == {"enforce_eager": False, "compilation_config": {"mode": 0}}
    config = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=False),
                             compilation_config=SimpleNamespace(mode=SimpleNamespace(name="NONE"),
                                                                cudagraph_mode=SimpleNamespace(name="FULL_DECODE_ONLY"),
                                                                max_cudagraph_capture_size=512))
    assert common.graph_setting(config) == FAST
    assert common.describe_graphs(FAST) == "compile NONE, CUDA graphs FULL_DECODE_ONLY"
    assert common.graph_setting(None)["cudagraph_mode"] is None


def test_make_table_renders_the_new_results_and_says_where_a_goal_is_missed(tmp_path: Path) -> None:
    tp, table = load("gpu_throughput"), load("make_table")
    sections = throughput_sections()
    sections["comparison"] = tp.compare(sections, ["fast"])
    data = {"settings": {"completion_tokens": 128, "repeats": 3, "side_repeats": 2, "startup": ["fast"]},
            "weights": "random", "sections": sections}
    text = "\n".join(table.gpu_throughput(data))
    assert 'vLLM start-up "fast"' in text and "**0.96**" in text and "**0.88** (missed)" in text
    assert "missed** at 64 concurrent" in text
    history = load("run_history")
    assert history.headline("gpu_throughput", data) == ('"fast" endpoint / plain vLLM 0.96, 0.88 at 8, 64; '
                                                         'of the engine called directly 0.96, 0.89')

    t4 = load("gpu_t4_vs_unsloth")
    side = lambda mean, peak: {"status": "ok", "steps": {"step_s": {"mean": mean}, "every_step_s": [30, mean]},
                               "peak_gpu_used_gib": peak}
    t4_sections = {"art": side(12.0, 11.0), "unsloth": side(10.0, 12.5)}
    t4_sections["comparison"] = t4.compare(t4_sections)
    t4_data = {"settings": {"base": "4-bit", "dtype": "float16", "lora_rank": 64, "generations": 8,
                            "completion_tokens": 200, "cap_gib": 15.0, "not_a_t4": "not a T4"},
               "sections": t4_sections}
    text = "\n".join(table.gpu_t4_vs_unsloth(t4_data))
    assert "= 1.20**" in text and "**missed**: step time <= 1.0x" in text

    path = tmp_path / "gpu_t4_vs_unsloth.json"
    path.write_text(json.dumps({"benchmark": "gpu_t4_vs_unsloth", "sections": {
        "art": {"status": "ok"}, "unsloth": {"status": "error"}, "comparison": {"summary": "incomplete"}}}))
    assert table.one_line(path) == "gpu_t4_vs_unsloth: art ok, unsloth error; incomplete"


def test_make_table_renders_the_committed_gpu_results() -> None:
    table = load("make_table")
    results = {name: table.load(BENCH / "results", name) for name in table.NAMES}
    assert all(results.values()), [name for name, data in results.items() if not data]
    assert "| trl/art_pipelined | 1.54 |" in "\n".join(table.gpu_step(results["gpu_step"]))
    assert "| 256 |" in "\n".join(table.gpu_throughput(results["gpu_throughput"]))
    assert "| fast |" in "\n".join(table.gpu_startup(results["gpu_startup"]))


def test_the_segment_script_parses_and_refuses_an_unknown_segment(tmp_path: Path) -> None:
    script = BENCH / "run_h200.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    done = subprocess.run(["bash", str(script), "nonsense"], cwd=tmp_path, capture_output=True, text=True,
                          env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}, check=False)
    assert done.returncode == 2 and "unknown segment" in done.stdout


def test_step_stats_say_when_requests_reached_the_engine_against_its_first_step() -> None:
    tp = load("gpu_throughput")
    spans = [(0.250, 0.258), (0.259, 0.266), (0.267, 0.275)]
    adds = [0.002, 0.120, 0.248, 0.249, 0.262]
    stats = tp.step_stats(spans, mark=0.0, done=0.300, adds=adds)
    assert stats["lead_s"] == pytest.approx(0.250) and stats["first_add_s"] == pytest.approx(0.002)
    assert stats["half_added_s"] == pytest.approx(0.248) and stats["last_add_s"] == pytest.approx(0.262)
    assert stats["added_before_step_1"] == 4  # the engine had work from 2 ms on and first stepped at 250 ms
    assert "first_add_s" not in tp.step_stats(spans, mark=0.0, done=0.300)  # plain engines without adds timed


def test_the_size_pass_repair_turns_sizes_by_dimension_into_functions_and_keeps_the_result():
    """bench/vllm_size_pass.py: vLLM 0.25's pass fails on `x.size(0)` nested in a shape tuple (its LoRA buffers);
    after the repair only whole-shape sizes are left for it, and the graph computes the same."""
    import torch
    from torch import fx

    class Buffers(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            buffer = torch.zeros((2, x.size(0), 3))
            return buffer.sum() + x[: x.size(0)].sum() * x.size(-1) + x.view(x.size()).sum()

    graph = fx.symbolic_trace(Buffers())
    x = torch.randn(5, 4)
    expected = graph(x)
    assert load("vllm_size_pass").sizes_by_dim_to_sym_size(graph) == 3
    sizes = [node for node in graph.graph.nodes if node.op == "call_method" and node.target == "size"]
    assert [node.args for node in sizes] == [(graph.graph.find_nodes(op="placeholder")[0],)]  # x.size() alone
    assert all(node in user.args for node in sizes for user in node.users)  # a direct argument: vLLM's pass copes
    assert torch.equal(graph(x), expected)
    assert graph(torch.randn(7, 2)).shape == expected.shape

