"""Where vLLM fails to start, which plans fall back to the transformers engine and which keep the error."""

from __future__ import annotations

from dataclasses import replace

import pytest
from faults.tiny import tiny_model_config

from art_nb.local.plan.choices import Plan, engine_fallback

T4_VLLM = Plan(device="cuda", dtype="float16", engine="vllm", trainer="unsloth", load_in_4bit=True, cpu_threads=None,
               capability=(7, 5), reasons={"engine": "vLLM 0.11.2: one of the last releases with a backend for sm75"})
FAILED = RuntimeError("No attention backend supports this configuration\n(traceback lines follow)")


def test_a_t4_whose_vllm_fails_gets_the_transformers_engine_and_the_reason():
    fallback = engine_fallback(T4_VLLM, tiny_model_config(engine="auto"), FAILED)
    assert fallback is not None and fallback.engine == "hf"
    why = fallback.reasons["engine"]
    assert why.startswith("transformers: vLLM failed to start on this sm75 GPU")
    assert "RuntimeError: No attention backend supports this configuration)" in why  # the first line only
    assert "engine='vllm'" in why
    assert (fallback.dtype, fallback.trainer, fallback.load_in_4bit) == ("float16", "unsloth", True)  # the rest stays


@pytest.mark.parametrize("plan,config,error,why", [
    (replace(T4_VLLM, capability=(8, 0)), tiny_model_config(engine="auto"), FAILED, "sm80+: a fault to see"),
    (replace(T4_VLLM, capability=(9, 0)), tiny_model_config(engine="auto"), FAILED, "an H100/H200"),
    (T4_VLLM, tiny_model_config(engine="vllm"), FAILED, "the user chose vLLM"),
    (replace(T4_VLLM, engine="hf"), tiny_model_config(engine="auto"), FAILED, "the engine that failed is not vLLM"),
    (T4_VLLM, tiny_model_config(engine="auto"), KeyboardInterrupt(), "an interrupt stays an interrupt"),
])
def test_everywhere_else_the_error_stands(plan, config, error, why):
    assert engine_fallback(plan, config, error) is None, why
