"""GGUF export up to and around the converter call, with a stand-in converter script (the real one runs
in tests/integration/test_export_gguf_real.py): type choice, where the converter is found, what is taken
out of the downloaded sdist, the file written next to the adapter, and failures that say what to do."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest
from test_export import checkpoint  # noqa: F401 - the tiny base model + LoRA checkpoint fixture

from art_nb.local import gguf as export_gguf
from art_nb.local.export import export_adapter
from art_nb.local.gguf import convert_to_gguf, find_converter, gguf_type

FAKE_CONVERTER = """
import json, sys
args = sys.argv[1:]
if "fail" in open(args[0] + "/config.json").read() or {fail}:
    print("ValueError: boom in the converter", file=sys.stderr)
    sys.exit(3)
out = args[args.index("--outfile") + 1]
open(out, "wb").write(b"GGUF" + json.dumps(args).encode())
"""


def fake_llama_cpp(root: Path, fail: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER.format(fail=fail))
    return root


@pytest.fixture(autouse=True)
def no_converter_around(monkeypatch, tmp_path):
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    monkeypatch.setenv("ART_NB_CACHE", str(tmp_path / "cache"))


def test_gguf_types_and_the_k_quants_that_need_compiled_llama_cpp():
    assert gguf_type(True) == "q8_0" and gguf_type("F16") == "f16" and gguf_type("bf16") == "bf16"
    with pytest.raises(ValueError, match="llama-quantize .*Q4_K_M"):
        gguf_type("q4_k_m")
    with pytest.raises(ValueError, match="not one of q8_0, f16"):
        gguf_type("q9")


def test_the_converter_is_found_from_the_argument_the_environment_or_the_cache(tmp_path, monkeypatch):
    given = fake_llama_cpp(tmp_path / "llama.cpp")
    assert find_converter(given) == given
    with pytest.raises(FileNotFoundError, match="has no convert_hf_to_gguf.py"):
        find_converter(tmp_path)
    monkeypatch.setenv("LLAMA_CPP_DIR", str(given))
    assert find_converter() == given
    monkeypatch.delenv("LLAMA_CPP_DIR")
    with pytest.raises(RuntimeError, match="git clone https://github.com/ggml-org/llama.cpp.*LLAMA_CPP_DIR"):
        find_converter(fetch=False)
    cached = fake_llama_cpp(export_gguf._cache_dir())
    assert find_converter(fetch=False) == cached


def fake_sdist(path: Path) -> Path:
    """Shaped like llama-cpp-python's sdist: the converter under vendor/llama.cpp among much else."""
    files = {
        "vendor/llama.cpp/convert_hf_to_gguf.py": "print('converter')",
        "vendor/llama.cpp/conversion/__init__.py": "",
        "vendor/llama.cpp/gguf-py/gguf/__init__.py": "",
        "vendor/llama.cpp/ggml/src/ggml.c": "int main;",
        "llama_cpp/llama.py": "",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_python-0.3.36/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("llama_cpp_python-0.3.36/vendor/llama.cpp/conversion/evil")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    return path


def test_only_the_converter_is_taken_from_the_sdist(tmp_path):
    export_gguf._extract_converter(fake_sdist(tmp_path / "s.tar.gz"), tmp_path / "out")
    kept = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*"))
    assert kept == ["conversion", "conversion/__init__.py", "convert_hf_to_gguf.py", "gguf-py", "gguf-py/gguf",
                    "gguf-py/gguf/__init__.py"]


def test_fetching_goes_through_pip_and_a_refusal_says_what_to_install(tmp_path, monkeypatch):
    calls = []

    def pip(command, **kwargs):
        calls.append(command)
        if "fail" in command[command.index("--dest") + 1]:
            return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found")
        fake_sdist(Path(command[command.index("--dest") + 1]) / "llama_cpp_python-0.3.36.tar.gz")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(export_gguf.subprocess, "run", pip)
    root = find_converter()
    assert root == export_gguf._cache_dir() and (root / "convert_hf_to_gguf.py").is_file()
    assert calls[0][1:] == ["-m", "pip", "download", "llama-cpp-python==0.3.36", "--no-deps", "--no-binary",
                            ":all:", "--dest", calls[0][9], "--quiet"]
    assert find_converter() == root and len(calls) == 1  # cached: fetched once
    monkeypatch.setenv("ART_NB_CACHE", str(tmp_path / "fail"))
    with pytest.raises(RuntimeError, match="No matching distribution found.*LLAMA_CPP_DIR"):
        find_converter()


def test_export_writes_the_gguf_next_to_the_adapter(checkpoint, tmp_path):  # noqa: F811
    base_dir, ckpt = checkpoint
    converter = fake_llama_cpp(tmp_path / "llama.cpp")
    result = export_adapter(ckpt, tmp_path / "out", name="m", base_model=str(base_dir), gguf=True,
                            llama_cpp_dir=converter, make_zip=False)
    assert result.gguf_path == tmp_path / "out" / "m-step3-q8_0.gguf"
    args = json.loads(result.gguf_path.read_bytes()[4:])
    assert args == [str(result.merged_dir), "--outfile", args[2], "--outtype", "q8_0"]
    assert result.merged_dir == tmp_path / "out" / "m-step3-merged"  # GGUF is made from the merged model
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["m-step3-lora", "m-step3-merged",
                                                                    "m-step3-q8_0.gguf"]
    assert "gguf:    " in str(result) and any("GGUF q8_0" in note for note in result.notes)


def test_a_failed_conversion_leaves_no_file_and_shows_the_converters_error(checkpoint, tmp_path):  # noqa: F811
    base_dir, _ = checkpoint
    converter = fake_llama_cpp(tmp_path / "llama.cpp", fail=True)
    with pytest.raises(RuntimeError, match="failed \\(exit 3\\):\nValueError: boom in the converter"):
        convert_to_gguf(base_dir, tmp_path / "out" / "x.gguf", "f16", converter)
    assert list((tmp_path / "out").iterdir()) == []


def test_a_bad_gguf_type_fails_before_anything_is_written(checkpoint, tmp_path):  # noqa: F811
    _, ckpt = checkpoint
    with pytest.raises(ValueError, match="llama-quantize"):
        export_adapter(ckpt, tmp_path / "out", gguf="q4_k_m")
    assert not (tmp_path / "out").exists()


def test_the_export_view_links_the_gguf(tmp_path, monkeypatch):
    from art_nb.local.export import ExportResult
    from art_nb.notebook import export_view

    monkeypatch.setattr(export_view, "in_colab", lambda: False)
    result = ExportResult(step=2, adapter_dir=tmp_path / "a", gguf_path=tmp_path / "m-step2-q8_0.gguf")
    assert "GGUF for llama.cpp / Ollama" in export_view.show_export(result)._repr_html_()
