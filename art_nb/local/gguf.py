"""A merged 16-bit model as one GGUF file (llama.cpp, Ollama, LM Studio), made offline.

llama.cpp's own Python converter (`convert_hf_to_gguf.py`, with its `conversion/` package and the
`gguf-py` it ships) writes f32, f16, bf16 and q8_0 without any compiled code; that is what runs
here. The K-quants (q4_k_m, ...) need the compiled `llama-quantize` and are refused with how to make
them from our f16 file. Unsloth's exporter instead clones and builds llama.cpp from GitHub, which a
machine without internet cannot do.

Where the converter comes from, first found wins:
1. `llama_cpp_dir=` or the environment variable `LLAMA_CPP_DIR`: a llama.cpp checkout;
2. the cache, `$ART_NB_CACHE/llama.cpp/<release>` (default `~/.cache/art_nb/...`), filled once from
   the source distribution of llama-cpp-python (which vendors llama.cpp) through pip, so whatever
   index pip is set up with (a mirror, a proxy) serves it: about 76 MB, only the converter is kept;
3. otherwise a RuntimeError that says what to install.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Literal

__all__ = ["CONVERTER_RELEASE", "GGUF_TYPES", "GgufType", "convert_to_gguf", "find_converter", "gguf_type"]

_log = logging.getLogger("art_nb")

GgufType = Literal["q8_0", "f16", "bf16", "f32"]
GGUF_TYPES: tuple[str, ...] = ("q8_0", "f16", "bf16", "f32")
"""What the Python converter writes without compiled llama.cpp. q8_0 is the default: half of f16's size,
and its greedy tokens match the 16-bit model's on SmolLM2 (tests/integration/test_export_gguf_real.py)."""

CONVERTER_RELEASE = "llama-cpp-python==0.3.36"
"""The source distribution the converter is taken from (its vendor/llama.cpp)."""

_SCRIPT = "convert_hf_to_gguf.py"
_KEEP = (_SCRIPT, "conversion", "gguf-py")  # what the script imports, relative to the llama.cpp root
_K_QUANTS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_0", "q4_1", "q5_0", "q5_1", "iq")


def gguf_type(value: bool | str) -> GgufType:
    """`export(gguf=...)`'s value as a converter output type: True means q8_0."""
    if value is True:
        return "q8_0"
    name = str(value).lower()
    if name in GGUF_TYPES:
        return name  # type: ignore[return-value]
    if name.startswith(_K_QUANTS):
        raise ValueError(
            f"gguf={value!r} needs llama.cpp's compiled llama-quantize, which this export does not build; "
            f"export gguf='f16' and run `llama-quantize <file>-f16.gguf <file>-{name}.gguf {name.upper()}` "
            "where llama.cpp is built (or use gguf='q8_0', which needs no compiled code)")
    raise ValueError(f"gguf={value!r} is not one of {', '.join(GGUF_TYPES)} (or True for q8_0)")


def find_converter(llama_cpp_dir: str | os.PathLike[str] | None = None, *, fetch: bool = True) -> Path:
    """The llama.cpp directory holding `convert_hf_to_gguf.py` (see the module docstring for the order)."""
    given = llama_cpp_dir or os.environ.get("LLAMA_CPP_DIR")
    if given:
        root = Path(given).expanduser()
        if not (root / _SCRIPT).is_file():
            raise FileNotFoundError(f"{root} has no {_SCRIPT}: point llama_cpp_dir= (or LLAMA_CPP_DIR) at a "
                                    "llama.cpp checkout")
        return root
    cached = _cache_dir()
    if (cached / _SCRIPT).is_file():
        return cached
    if not fetch:
        raise RuntimeError(_missing("not fetched (fetch=False)"))
    return _fetch(cached)


def convert_to_gguf(merged_dir: str | os.PathLike[str], target: str | os.PathLike[str], outtype: GgufType = "q8_0",
                    llama_cpp_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write `target` (a .gguf file) from the transformers model in `merged_dir`; returns its path.

    Runs the converter in a child interpreter (it imports its own copy of `gguf`), into a temporary
    name that replaces `target` only when complete. A failure raises RuntimeError with the converter's
    last lines.
    """
    if outtype not in GGUF_TYPES:
        raise ValueError(f"outtype {outtype!r} is not one of {', '.join(GGUF_TYPES)}")
    missing = [name for name in ("sentencepiece", "numpy", "torch", "transformers")
               if importlib.util.find_spec(name) is None]
    if missing:  # llama-family vocabularies are read through sentencepiece even from tokenizer.json
        raise RuntimeError(f"the GGUF converter needs {', '.join(missing)}: pip install {' '.join(missing)}")
    root = find_converter(llama_cpp_dir)
    out = Path(target)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)  # exclusive create
    os.close(fd)
    tmp = Path(name)
    command = [sys.executable, str(root / _SCRIPT), str(merged_dir), "--outfile", str(tmp), "--outtype", outtype]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0 or tmp.stat().st_size == 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
            raise RuntimeError(f"{_SCRIPT} from {root} failed (exit {done.returncode}):\n{tail}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _cache_dir() -> Path:
    root = os.environ.get("ART_NB_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "art_nb"
    return base / "llama.cpp" / CONVERTER_RELEASE.replace("==", "-")


def _missing(why: str) -> str:
    return (f"no GGUF converter: LLAMA_CPP_DIR is not set and {CONVERTER_RELEASE}'s source could not be "
            f"fetched through pip ({why}). Either `git clone https://github.com/ggml-org/llama.cpp` and pass "
            "llama_cpp_dir= (or set LLAMA_CPP_DIR), or let pip reach an index that has llama-cpp-python's "
            "source distribution; the 16-bit merged model is exported either way")


def _fetch(target: Path) -> Path:
    """Download the sdist with pip, keep only the converter's files, and move them into `target`."""
    _log.warning("fetching the GGUF converter from %s's source distribution through pip (about 76 MB, once)",
                 CONVERTER_RELEASE)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        command = [sys.executable, "-m", "pip", "download", CONVERTER_RELEASE, "--no-deps", "--no-binary", ":all:",
                   "--dest", work, "--quiet"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        archives = sorted(Path(work).glob("*.tar.gz"))
        if done.returncode != 0 or not archives:
            last = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(_missing(last[-1] if last else "pip downloaded no archive"))
        staged = Path(work) / "converter"
        _extract_converter(archives[0], staged)
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)
    return target


def _extract_converter(archive: Path, into: Path) -> None:
    """Copy vendor/llama.cpp/{convert_hf_to_gguf.py, conversion/, gguf-py/} out of the sdist into `into`."""
    with tarfile.open(archive) as tar:
        members = []
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if len(parts) < 4 or parts[1:3] != ("vendor", "llama.cpp") or parts[3] not in _KEEP:
                continue
            if not (member.isfile() or member.isdir()):
                continue  # no links or devices out of a downloaded archive
            member.name = str(Path(*parts[3:]))
            members.append(member)
        if not any(m.name == _SCRIPT for m in members):
            raise RuntimeError(f"{archive.name} has no vendor/llama.cpp/{_SCRIPT}")
        tar.extractall(into, members=members, filter="data")
