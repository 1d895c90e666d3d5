"""art_nb's vLLM engine behind the real LocalBackend on vLLM's CPU build: backend_check.py (in .venv-vllm)
kills the engine while requests decode, checks that they and later ones fail with the engine's reason, and
registers again."""

from __future__ import annotations

import pytest
from vllm_venv import run_check

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def revived(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("vllm_backend")
    return run_check("backend_check.py", work / "runs", tmp=work)


def test_a_dead_vllm_engine_says_why_and_fails_requests(revived):
    assert revived.get("engine") == "VLLMEngine", revived["_log_tail"]
    assert revived["served_before"]["model"] == "revive@0" and revived["served_before"]["text"]
    # Three requests were decoding (from this loop, not the backend's) when the step raised: each one fails
    assert revived["in_flight"] == ["EngineDeadError"] * 3 and revived["in_flight_dead"], revived.get("in_flight")
    failed = revived["request_after_kill"]
    assert failed["failed"] and failed["status"] == 503, failed
    reason = revived["dead_reason"]
    assert isinstance(reason, str) and reason.startswith("vLLM stopped ("), reason
    assert reason in failed["message"] and "re-register the model" in failed["message"]


def test_registering_again_replaces_a_dead_vllm_engine(revived):
    assert revived.get("closed") and revived["_returncode"] == 0, revived["_log_tail"]
    assert revived["replaced"] is True
    assert revived["new_engine"] == {"type": "VLLMEngine", "dead_reason": None}
    assert revived["dead_reason"] in revived["choices"]["engine_restart"]
    after = revived["served_after"]
    assert after["model"] == "revive@0" and after["text"] and after["finish_reason"] in ("stop", "length")


def test_vllm_is_given_the_sampled_ids_of_the_previous_turn(revived):
    """The endpoint computes prompt ids before the engine: vLLM gets the same token-in/token-out prompts,
    from the first engine and from the one register started in its place."""
    assert revived["two_turns_before"]["extends"] and revived["two_turns_after"]["extends"], revived["_log_tail"]


def test_after_an_sft_step_vllm_serves_the_trainers_adapter(revived):
    """A warm start's update reaches the engine: its greedy reply is the trainer's own, and the demonstration's."""
    served = revived.get("sft_served")
    assert served is not None, revived["_log_tail"]
    assert served["model"] == "revive@1"
    assert served["text"].startswith(revived["sft_trainer"]) or revived["sft_trainer"].startswith(served["text"])
    assert served["text"].startswith("Banana")
