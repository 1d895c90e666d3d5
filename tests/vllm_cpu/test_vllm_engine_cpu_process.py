"""art_nb's vLLM engine with its engine core in a child process (`ModelConfig.vllm_core="process"`, the
default on GPUs of 24 GiB or more), on vLLM's CPU build: engine_check.py's checks, minus the
comparisons with transformers. What differs from the in-process core: every call crosses vLLM's
socket, and a train step's adapter reaches vLLM as files in /dev/shm, not through its socket
(engines/vllm_lora.py says why)."""

from __future__ import annotations

import pytest
from engine_cases import case_names
from vllm_venv import run_check

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    return run_check("engine_check.py", "process", tmp=tmp_path_factory.mktemp("vllm_cpu_process"))


def test_the_check_ran_to_the_end_with_the_core_in_a_child(recorded):
    assert recorded["_returncode"] == 0 and recorded.get("closed"), recorded["_log_tail"]
    assert any(r.startswith("engine core: process: set in ModelConfig.vllm_core") for r in recorded["reasons"])
    assert not any("GIL switch interval" in r for r in recorded["reasons"])  # only an in-process core needs it


def test_sampling_batching_and_adapters_work_across_the_process_boundary(recorded):
    assert all(0 < s["n_tokens"] == s["n_logprobs"] for s in recorded["samples"])
    assert recorded["concurrent_completed"] == 6 and recorded["context_too_long_raised"] is True
    adapters = recorded["adapters"]
    assert adapters["base"] != adapters["first"] != adapters["second"]
    assert adapters["unloaded_refused"] and adapters["after_unload"] == adapters["base"]
    assert recorded["joined"]["short_done_at_step"] < recorded["joined"]["steps"]  # joined the running batch
    assert recorded["cancel"]["unfinished_in_vllm"] is False


def test_adapters_handed_over_through_shared_memory_serve_exactly_what_their_files_serve(recorded):
    memory = recorded["memory"]
    assert memory["served_from"] == "/dev/shm" and memory["path_exists"] is False
    assert memory["tokens_equal"] and memory["r8_tokens_equal"] and memory["differs_from_r8"]
    assert memory["max_abs_logprob_gap"] == 0.0 == memory["r8_max_abs_logprob_gap"]
    evicted = recorded["evicted"]  # re-loaded from /dev/shm after vLLM's cache dropped it
    assert evicted["evicted"] and evicted["tokens_equal"] and evicted["weights_untouched"]
    assert recorded["spill"]["tokens_equal"] and recorded["spill"]["removed"] and recorded["spill"]["held_after_unload"]
    assert recorded["handover"]["held_after_all_unloaded"] == 0


def test_sleep_wake_and_the_protocol_cases_pass(recorded):
    assert recorded["greedy_after_sleep_wake_equal"]
    assert recorded["conformance"] == {name: "ok" for name in case_names()}
