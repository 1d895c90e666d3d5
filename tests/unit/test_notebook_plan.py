"""The notebooks' defaults joined to the plan, on simulated hardware: the notebook picks sizes, rates and
shapes; engine, trainer and dtype stay "auto", so the plan picks them, its reasons are what the choices
cell shows, and on a T4 the transformers engine can still take over when vLLM cannot start."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from art_nb.local.plan.choices import engine_fallback, plan_for
from art_nb.local.plan.hardware import Hardware
from art_nb.local.plan.rates import learning_rate_for, learning_rate_for_size, parameter_count
from art_nb.local.plan.versions import pins
from art_nb.notebook.hardware import pick_defaults

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Each simulated machine has the set its install cell installs there (art_nb/constraints/{stack}.txt).
NO_GPU = Hardware(cpu_count=2, packages=pins("cpu"))
T4 = Hardware(cpu_count=2, gpu_name="Tesla T4", gpu_capability=(7, 5), gpu_memory_gib=15.0, packages=pins("turing"))
A100 = Hardware(cpu_count=12, gpu_name="NVIDIA A100-SXM4-40GB", gpu_capability=(8, 0), gpu_memory_gib=39.6,
                packages=pins("ampere"))
H200 = Hardware(cpu_count=16, gpu_name="NVIDIA H200", gpu_capability=(9, 0), gpu_memory_gib=139.8,
                packages=pins("ampere"))
VLLM_FAILED = RuntimeError("No attention backend supports this configuration\n(traceback lines follow)")


def shown(defaults, **chosen) -> dict[str, tuple[object, str]]:
    """The choices cell's table: name -> (value, why)."""
    return {name: (value, why) for name, value, why in defaults.report(**chosen).rows}


def test_the_notebook_leaves_engine_trainer_and_dtype_to_the_plan():
    for hardware in (NO_GPU, T4, A100):
        config = pick_defaults(hardware).model_config(max_seq_len=768)
        assert (config.engine, config.trainer, config.dtype, config.max_seq_len) == ("auto", "auto", "auto", 768)
        assert not {"engine", "trainer", "dtype"} & config.model_fields_set


def test_a_t4_gets_vllm_0_11_and_the_transformers_fallback_with_its_reason():
    defaults = pick_defaults(T4, "tic_tac_toe")
    config = defaults.model_config()
    plan = plan_for(config, T4)
    assert (plan.device, plan.dtype, plan.engine, plan.trainer) == ("cuda", "float16", "vllm", "unsloth")
    assert plan.reasons["engine"].startswith("vLLM 0.11.2:") and "the transformers engine serves" in plan.reasons["engine"]
    assert "sm75" in plan.reasons["dtype"]
    # Register's loop: vLLM fails to start, and the notebook's config lets the plan fall back.
    fallback = engine_fallback(plan, config, VLLM_FAILED)
    assert fallback is not None and fallback.engine == "hf"
    assert fallback.reasons["engine"].startswith("transformers: vLLM failed to start on this sm75 GPU (RuntimeError: "
                                                 "No attention backend supports this configuration)")
    assert (fallback.dtype, fallback.trainer) == ("float16", "unsloth")
    # What the old defaults did (engine set in the config) switched the fallback off.
    assert engine_fallback(plan, defaults.model_config(engine="vllm"), VLLM_FAILED) is None
    rows = shown(defaults)
    assert rows["engine"] == ("vllm", plan.reasons["engine"]) and rows["trainer"] == ("unsloth", plan.reasons["trainer"])
    assert "0.5B" in defaults.base_model and "slow GPU" in rows["base_model"][1]


def test_a_t4_with_a_later_vllm_is_served_by_transformers_and_says_why():
    t4 = replace(T4, packages={**T4.packages, "vllm": "0.25.0"})
    plan = plan_for(pick_defaults(t4).model_config(), t4)
    assert plan.engine == "hf" and "no attention backend for sm75" in plan.reasons["engine"]


def test_an_a100_gets_vllm_unsloth_and_bfloat16():
    defaults = pick_defaults(A100, "2048")
    plan = plan_for(defaults.model_config(), A100)
    assert (plan.dtype, plan.engine, plan.trainer) == ("bfloat16", "vllm", "unsloth")
    assert plan.reasons["engine"].startswith("vLLM 0.25.0 on sm80")
    assert defaults.base_model == "Qwen/Qwen2.5-3B-Instruct" and defaults.max_turns == 40
    assert engine_fallback(plan, defaults.model_config(), VLLM_FAILED) is None  # sm80+: a fault to see


def test_the_tool_agent_gets_a_limit_on_model_calls_and_room_for_its_prompt():
    cpu, a100 = pick_defaults(NO_GPU, "tool_agent"), pick_defaults(A100, "tool_agent")
    assert (cpu.max_turns, a100.max_turns) == (3, 6)  # the two-lookup questions take 3 model calls
    assert "3 model calls" in cpu.reasons["max_turns"] and "questions" in cpu.reasons["eval_games"]
    assert cpu.max_seq_len >= 1536 and a100.max_seq_len >= 4096  # tools, one worked question, 3 turns
    assert pick_defaults(NO_GPU, "custom").max_turns is None


def test_an_a100_without_unsloth_trains_with_peft_and_says_why():
    a100 = replace(A100, packages={**A100.packages, "unsloth": None})
    rows = shown(pick_defaults(a100))
    assert rows["trainer"] == ("peft", "peft: Unsloth is not installed (pip install 'art-nb[gpu]')")


def test_a_cpu_gets_transformers_peft_float32_and_the_offline_tiny_model():
    defaults = pick_defaults(NO_GPU, "tic_tac_toe")
    plan = plan_for(defaults.model_config(), NO_GPU)
    assert (plan.device, plan.dtype, plan.engine, plan.trainer) == ("cpu", "float32", "hf", "peft")
    assert defaults.base_model == TINY and "offline" in defaults.reasons["base_model"]
    assert defaults.steps <= 8 and defaults.max_turns is None
    rows = shown(defaults)
    assert rows["engine"] == ("hf", "transformers: no CUDA GPU, vLLM needs one")
    assert rows["trainer"] == ("peft", "peft: no CUDA GPU, Unsloth needs one")
    assert rows["dtype"][0] == "float32" and rows["dtype"][1].startswith("float32: CPU")
    assert "cpu_threads" in rows


@pytest.mark.parametrize("hardware", [NO_GPU, T4, A100], ids=["cpu", "t4", "a100"])
def test_the_choices_cell_shows_the_plans_reasons_not_set_in_modelconfig(hardware):
    defaults = pick_defaults(hardware, "custom")
    config = defaults.model_config(max_seq_len=768)
    plan = plan_for(config, hardware)
    report = defaults.report(config, max_seq_len=768, steps=defaults.steps)
    rows = {name: (value, why) for name, value, why in report.rows}
    for name in ("dtype", "engine", "trainer"):
        assert rows[name] == (getattr(plan, name), plan.reasons[name])
    text = str(report) + report._repr_markdown_()
    assert "set in ModelConfig" not in text
    assert rows["max_seq_len"] == (768, "set in the parameters cell")
    assert hardware.describe() in text


def test_an_engine_the_user_set_is_reported_as_theirs():
    defaults = pick_defaults(T4)
    rows = {name: (value, why) for name, value, why in defaults.report(defaults.model_config(engine="hf")).rows}
    assert rows["engine"] == ("hf", "hf: set in ModelConfig.engine")


def test_report_says_which_values_the_user_set():
    d = pick_defaults(NO_GPU, "custom")
    report = d.report(steps=2, base_model=d.base_model)
    rows = {name: (value, why) for name, value, why in report.rows}
    assert rows["steps"] == (2, "set in the parameters cell")
    assert rows["base_model"][1] == d.reasons["base_model"]
    assert "| `steps` | `2` | set in the parameters cell |" in report._repr_markdown_()
    assert "no CUDA GPU" in str(report)


def test_unknown_task_is_rejected():
    with pytest.raises(ValueError, match="tic_tac_toe"):
        pick_defaults(NO_GPU, "chess")


# ---- the learning rate, by the model's size: one rule for the notebooks and the demo --------------


def test_learning_rate_follows_the_model_size_and_keeps_the_tuned_defaults():
    assert pick_defaults(NO_GPU, "tic_tac_toe").learning_rate == 5e-4  # the CPU demo's tuned rate
    assert pick_defaults(T4, "tic_tac_toe").learning_rate == 1e-4  # 0.5B
    assert pick_defaults(A100, "2048").learning_rate == 5e-5  # 3B
    h200 = pick_defaults(H200, "tic_tac_toe")
    assert (h200.base_model, h200.learning_rate) == ("Qwen/Qwen2.5-7B-Instruct", 2e-5)
    # SmolLM2 swapped in on an H200 kept 7B's 2e-5 and did not learn; the rule gives 2e-4.
    assert h200.learning_rate_for(TINY, h200.learning_rate) == 2e-4
    assert h200.learning_rate_for(TINY, 3e-4) == 3e-4  # a rate the user set is theirs
    assert pick_defaults(NO_GPU).learning_rate_for("Qwen/Qwen2.5-1.5B-Instruct", 5e-4) == 1e-4


def test_the_demo_and_the_cpu_notebook_take_the_same_rate_from_the_one_rule():
    from art_nb.demo import DemoConfig

    rate, why = learning_rate_for(TINY, short_run=True)
    assert rate == pick_defaults(NO_GPU).learning_rate == DemoConfig().rate()[0] == 5e-4 and "CPU demo" in why
    assert DemoConfig().learning_rate is None  # picked at run time, for the base model given
    assert DemoConfig(base_model="Qwen/Qwen2.5-3B-Instruct").rate()[0] == 5e-5
    assert DemoConfig(learning_rate=1e-3).rate() == (1e-3, "0.001: set in DemoConfig.learning_rate")


@pytest.mark.parametrize("name,count", [(TINY, 135_000_000), ("Qwen/Qwen2.5-0.5B-Instruct", 500_000_000),
                                        ("meta-llama/Llama-3.2-1B-Instruct", 1_000_000_000),
                                        ("google/gemma-3-270m-it", 270_000_000), ("microsoft/phi-4", None)])
def test_parameter_count_from_the_name(name, count):
    assert parameter_count(name) == count


def test_parameter_count_of_a_local_directory_reads_its_weights(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(10, 20), "b": torch.zeros(5)}, str(tmp_path / "model.safetensors"))
    assert parameter_count(str(tmp_path)) == 205
    assert learning_rate_for_size(205, short_run=False)[0] == 2e-4
    # a hub id without its size in the name is read from where it was downloaded; the name wins when it says
    assert parameter_count("microsoft/phi-4", local_copy=tmp_path) == 205
    assert parameter_count("Qwen/Qwen2.5-0.5B-Instruct", local_copy=tmp_path) == 500_000_000


def test_an_unknown_size_gets_the_large_models_rate_and_says_so():
    rate, why = learning_rate_for_size(None, short_run=True)
    assert rate == 2e-5 and "set the learning rate yourself" in why


def test_report_gives_the_swapped_model_its_rate_and_reason():
    d = pick_defaults(H200, "tic_tac_toe")
    rate = d.learning_rate_for(TINY, d.learning_rate)
    rows = shown(d, base_model=TINY, learning_rate=rate)
    assert rows["base_model"] == (TINY, "set in the parameters cell")
    assert rows["learning_rate"][0] == 2e-4 and "135M" in rows["learning_rate"][1] and "H200" in rows["learning_rate"][1]
    rows = shown(d, base_model=TINY, learning_rate=2e-5)
    assert rows["learning_rate"] == (2e-5, "set in the parameters cell")
    assert rows["packages"][0] == "ampere set"


# ---- one owner of hardware detection ---------------------------------------------------------------

NOTEBOOK_PACKAGE = Path(__file__).resolve().parents[2] / "art_nb" / "notebook"


def _local_imports(path: Path) -> set[str]:
    """The art_nb.local modules `path` imports (relative imports resolved from art_nb/notebook/)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = ("art_nb." + (node.module or "")) if node.level == 2 else (node.module or "")
            names = [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found |= {name for name in names if name.startswith("art_nb.local.")}
    return found


def test_the_notebook_reads_art_nb_local_only_through_the_plan_package():
    files = sorted(NOTEBOOK_PACKAGE.glob("*.py"))
    imports = {path.name: _local_imports(path) for path in files}
    assert "art_nb.local.plan.choices.plan_for" in imports["hardware.py"]  # the scan sees them
    outside = {name: sorted(m for m in found if not m.startswith("art_nb.local.plan."))
               for name, found in imports.items()}
    assert not any(outside.values()), outside


def test_one_patch_of_the_plans_detection_moves_the_notebook_and_register_alike(monkeypatch):
    from art_nb.local.plan import hardware as detection

    monkeypatch.setattr(detection, "detect_hardware", lambda: T4)  # what a simulated T4 run patches
    defaults = pick_defaults(task="tic_tac_toe")
    assert defaults.hardware is T4 and "0.5B" in defaults.base_model
    plan = plan_for(defaults.model_config())  # as register calls it: no hardware passed
    assert (plan.capability, plan.dtype, plan.engine) == ((7, 5), "float16", "vllm")


def test_the_notebook_detects_no_hardware_itself():
    source = "".join(path.read_text() for path in NOTEBOOK_PACKAGE.glob("*.py") if path.name != "install.py")
    for probe in ("nvidia-smi", "get_device_properties", "get_device_capability", "find_spec(\"unsloth\")",
                  "find_spec(\"vllm\")", "is_available()"):
        assert probe not in source, probe
    assert not re.search(r"\bdef detect_hardware\b", source)


def test_picking_the_defaults_imports_no_engine():
    code = ("import sys; from art_nb.local.plan.hardware import Hardware; from art_nb.notebook import pick_defaults; "
            "pick_defaults(Hardware(gpu_name='T4', gpu_capability=(7, 5), gpu_memory_gib=15.0)).report(); "
            "print([m for m in ('vllm', 'unsloth', 'transformers', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
