"""How vLLM starts (engines/startup.py): the mode and its reason, the keys per mode, the capture sizes,
and the guard against compilation keys the installed vLLM does not know. Pure: no vLLM, no GPU."""

from __future__ import annotations

import pytest
from test_vllm_plan import H200, fake_model_dir

from art_nb.config import ModelConfig
from art_nb.local.engines.vllm import args as vllm_plan
from art_nb.local.engines.vllm import startup
from art_nb.local.engines.vllm.args import engine_args, planned_memory
from art_nb.local.engines.vllm.startup import capture_sizes, compilation_fields, startup_kwargs, startup_mode
from art_nb.local.plan.memory import GiB


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("ART_NB_VLLM_STARTUP", raising=False)
    monkeypatch.delenv("ART_NB_VLLM_ENFORCE_EAGER", raising=False)
    monkeypatch.setattr(startup, "_compilation_fields", lambda: None)  # no vLLM here: keys unchecked
    monkeypatch.setattr(startup, "installed_version", lambda package: None)


def test_the_mode_comes_from_the_caller_then_the_env_then_the_config(monkeypatch):
    assert startup_mode(ModelConfig())[0] == "fast"
    assert "default" in startup_mode(ModelConfig())[1]
    assert startup_mode(ModelConfig(vllm_startup="compiled")) == ("compiled", "set in ModelConfig.vllm_startup")
    monkeypatch.setenv("ART_NB_VLLM_ENFORCE_EAGER", "1")  # the old switch still means eager
    assert startup_mode(ModelConfig(vllm_startup="compiled"))[0] == "eager"
    assert startup_mode(ModelConfig(vllm_startup="compiled"), enforce_eager=False)[0] == "compiled"
    monkeypatch.setenv("ART_NB_VLLM_STARTUP", "Compiled")  # the benchmarks' switch wins over both
    assert startup_mode(ModelConfig(vllm_startup="eager")) == ("compiled", "ART_NB_VLLM_STARTUP is set")
    assert startup_mode(ModelConfig(), enforce_eager=True)[0] == "eager"  # a caller's order wins over all
    monkeypatch.setenv("ART_NB_VLLM_STARTUP", "quick")
    with pytest.raises(ValueError, match="expected one of fast, compiled, eager"):
        startup_mode(ModelConfig())


@pytest.mark.parametrize(("version", "compiles"), [("0.11.2", True), ("0.19.0", False), ("0.25.0+cu130", False),
                                                    ("0.31.1", False), ("0.32.0+cpu", True)])
def test_compiled_is_fast_where_vllm_cannot_compile_a_lora_model(monkeypatch, version, compiles):
    monkeypatch.setattr(startup, "installed_version", lambda package: version)
    mode, why = startup_mode(ModelConfig(vllm_startup="compiled"))
    assert mode == ("compiled" if compiles else "fast")
    if not compiles:
        assert why.startswith("compiled asked (set in ModelConfig.vllm_startup), but vLLM ") and version in why
    monkeypatch.setenv("ART_NB_VLLM_STARTUP", "compiled")  # the benchmarks' switch too
    assert startup_mode(ModelConfig())[0] == mode
    assert startup_mode(ModelConfig(vllm_startup="eager"), enforce_eager=True)[0] == "eager"


def test_capture_sizes_are_a_short_list_within_the_step():
    assert capture_sizes(8192) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96]


def test_keys_per_mode_on_a_gpu():
    fast, _ = startup_kwargs("fast", True, 8192)
    assert fast["enforce_eager"] is False
    assert fast["compilation_config"]["mode"] == 0 and fast["compilation_config"]["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert fast["compilation_config"]["cudagraph_specialize_lora"] is False
    compiled, reasons = startup_kwargs("compiled", True, 8192)
    assert set(compiled["compilation_config"]) == {"cudagraph_capture_sizes", "cudagraph_specialize_lora"}
    assert "LoRA-active only" in reasons[0]
    assert startup_kwargs("eager", True, 8192) == ({"enforce_eager": True}, [])
    assert startup_kwargs("fast", False, 8192)[0] == {"enforce_eager": False}  # the CPU build chooses its own


def test_keys_the_installed_vllm_lacks_are_left_out_and_said(monkeypatch):
    monkeypatch.setattr(startup, "_compilation_fields", lambda: frozenset({"cudagraph_capture_sizes", "level"}))
    kwargs, reasons = startup_kwargs("fast", True, 8192)
    assert set(kwargs["compilation_config"]) == {"cudagraph_capture_sizes"}
    assert "no compilation key cudagraph_mode, cudagraph_specialize_lora, mode" in reasons[-1]


def test_compilation_fields_are_read_from_source_without_importing():
    source = "import torch\n@config\nclass CompilationConfig:\n    '''doc'''\n    mode: int = None\n" \
             "    cudagraph_mode: str = None\n    def f(self): x: int = 1\nclass Other:\n    level: int = 0\n"
    assert compilation_fields(source) == {"mode", "cudagraph_mode"}
    with pytest.raises(ValueError):
        compilation_fields("class Other:\n    mode: int = 0\n")


def test_engine_args_carries_the_mode_and_its_reason(tmp_path):
    path = fake_model_dir(tmp_path / "m")
    setup = engine_args(path, ModelConfig(dtype="bfloat16"), True, None, H200, dtype="bfloat16")
    assert setup.kwargs["compilation_config"]["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert any(r.startswith("start-up fast: art_nb's default") for r in setup.reasons)
    eager = engine_args(path, ModelConfig(dtype="bfloat16", vllm_startup="eager"), True, None, H200, dtype="bfloat16")
    assert eager.kwargs["enforce_eager"] is True and "compilation_config" not in eager.kwargs
    cpu = engine_args(path, ModelConfig(), False, None)
    assert "compilation_config" not in cpu.kwargs and cpu.kwargs["enforce_eager"] is False


def test_a_snapshot_taken_before_the_trainer_is_what_the_plan_sees(tmp_path):
    path, config = fake_model_dir(tmp_path / "m"), ModelConfig(dtype="bfloat16")
    with planned_memory((40 * GiB, 141 * GiB, 141 * GiB, None)):
        inside = engine_args(path, config, True, None, dtype="bfloat16")
    assert any("40.0 GiB of 141.0 GiB free" in r for r in inside.reasons)
    assert vllm_plan._SNAPSHOT.get() is None  # outside the block the device is read again
