"""A quiet register on vLLM's CPU build (quiet_check.py in .venv-vllm): vLLM's own logging, configured at
its import during register with a handler on that moment's stdout, and its load bar end up in the model's
logs/register.log, not in what the process printed; so do the first rollout's notices."""

from __future__ import annotations

import re

import pytest
from vllm_venv import run_check

pytestmark = pytest.mark.slow

VLLM_LINE = re.compile(r"(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d")  # vLLM's format: "INFO 12-03 08:05:34"


def test_vllms_output_goes_to_the_register_log(tmp_path) -> None:
    result = run_check("quiet_check.py", tmp_path / "work", tmp=tmp_path)
    printed = result["_log_tail"]
    assert result["_returncode"] == 0, printed
    assert "register.log" in printed and "register: 4/4 phases" in printed and "engine: vllm" in printed
    assert "first rollout:" in printed
    assert not VLLM_LINE.search(printed), printed
    log = result["log"]
    assert "Initializing a V1 LLM engine" in log and VLLM_LINE.search(log)
    assert "Loading safetensors checkpoint shards" not in printed + log  # the bar is off (a widget in a notebook)
