"""Export a trained checkpoint: the LoRA as a PEFT directory and a zip, optionally merged, optionally on the Hub.

    result = await export_model(model, backend, "out/export", merge=True, hub_repo="me/ttt-lora")

What is written under `destination`:

    {name}-step{step}-lora/        adapter_model.safetensors, adapter_config.json, tokenizer files, README.md
    {name}-step{step}-lora.zip     the same directory, zipped (the thing to download from Colab)
    {name}-step{step}-merged/      with merge=True: base + LoRA folded into 16-bit weights (safetensors)
    {name}-step{step}-{type}.gguf  with gguf=True ("q8_0") or "f16"/"bf16"/"f32": that merged model for
                                   llama.cpp/Ollama (gguf.py: where the converter comes from)

The adapter directory loads with `PeftModel.from_pretrained(base, path)`. Its `adapter_config.json`
names the base model as the user gave it (a hub id), not the local cache path it was trained from,
so the directory works on another machine. Optimizer state is not exported: it only matters for
resuming, and the checkpoint directory keeps it.

The Hub token is found the way every key is (`art_nb.secrets.find_secret`): the `token` argument,
else a Colab secret or environment variable HF_TOKEN (then HUGGING_FACE_HUB_TOKEN), else
huggingface_hub's saved login. It stays a masked `Secret` and is revealed only into the Hub client:
never printed, logged, stored in the result or written to disk. No token means no push, with the
reason in `result.notes`; the files are exported either way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from art_nb.secrets import Secret, find_secret
from art_nb.store import ADAPTER_FILES, META_FILE, checkpoint_path, checkpoint_steps, checkpoints_dir
from art_nb.types import ExportResult, check_name

from .gguf import convert_to_gguf, gguf_type

if TYPE_CHECKING:
    from art_nb.backend import Backend
    from art_nb.model import TrainableModel

__all__ = ["ExportResult", "export_adapter", "export_model", "find_hub_token", "merge_adapter"]

_log = logging.getLogger("art_nb")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "chat_template.jinja", "added_tokens.json")
_HUB_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


_NO_HUB_TOKEN = ("no Hugging Face token: pass token=..., add a Colab secret named HF_TOKEN (key icon, with "
                 "notebook access on), or set the environment variable HF_TOKEN")


def find_hub_token(token: str | Secret | None = None) -> Secret | None:
    """The Hugging Face Hub token as a masked `Secret` (its `source` says where it was found), or None.

    Looked up like every key (`find_secret`: argument, Colab secret, environment) under HF_TOKEN,
    then HUGGING_FACE_HUB_TOKEN, then huggingface_hub's saved login (`huggingface-cli login`).
    """
    found = (find_secret(token or None, name="HF_TOKEN", required=False)
             or find_secret(None, name="HUGGING_FACE_HUB_TOKEN", required=False))
    if found is not None:
        return found
    saved = _saved_hub_login()
    return Secret(saved, "huggingface_hub's saved login") if saved else None


def _saved_hub_login() -> str | None:
    try:
        from huggingface_hub import get_token

        return get_token() or None
    except Exception:  # noqa: BLE001 - huggingface_hub missing or an unreadable token file: no saved login
        return None


def export_adapter(
    checkpoint_dir: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    name: str = "model",
    base_model: str | None = None,
    make_zip: bool = True,
    merge: bool = False,
    merge_dtype: Literal["auto", "float16", "bfloat16"] = "auto",
    gguf: bool | str = False,
    llama_cpp_dir: str | os.PathLike[str] | None = None,
    hub_repo: str | None = None,
    hub_private: bool = True,
    token: str | Secret | None = None,
) -> ExportResult:
    """Export the checkpoint in `checkpoint_dir` (a `checkpoints/{step:04d}` directory) into `destination`.

    `base_model`: the hub id or path to name in `adapter_config.json` and to merge into (default:
    what the checkpoint says). `gguf` (True = "q8_0", or "f16"/"bf16"/"f32"): also a GGUF file of the
    merged model (merged even when `merge` is False), converted offline by llama.cpp's Python converter
    found in `llama_cpp_dir`, `LLAMA_CPP_DIR` or the cache (gguf.py). `hub_repo` ("user/name"):
    upload the adapter there when a token is found.
    """
    outtype = gguf_type(gguf) if gguf else None  # a bad type fails before anything is written
    source = Path(checkpoint_dir)
    missing = [f for f in ADAPTER_FILES if not (source / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{source} is not a checkpoint: {', '.join(missing)} missing")
    if hub_repo is not None and not _HUB_REPO.match(hub_repo):
        raise ValueError(f"hub_repo {hub_repo!r} is not a Hub repo id; use 'user/name'")
    check_name("name", name)
    meta = _read_json(source / META_FILE)
    step = int(meta.get("step", _step_from_dir(source)))
    base_model = base_model or meta.get("base_model") or _read_json(source / "adapter_config.json").get(
        "base_model_name_or_path")
    if not base_model:
        raise ValueError(f"cannot tell the base model of {source}; pass base_model=")

    out = Path(destination)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-step{step}"
    adapter_dir = _write_adapter_dir(source, out / f"{stem}-lora", base_model, step)
    notes: list[str] = []
    zip_path = _zip_dir(adapter_dir, out / f"{stem}-lora.zip") if make_zip else None
    merged_dir = None
    gguf_path = None
    if merge or outtype:
        merged_dir, dtype_note = merge_adapter(adapter_dir, out / f"{stem}-merged", base_model, merge_dtype)
        notes.append(dtype_note)
    if outtype and merged_dir is not None:
        gguf_path = convert_to_gguf(merged_dir, out / f"{stem}-{outtype}.gguf", outtype, llama_cpp_dir)
        notes.append(f"GGUF {outtype} written by llama.cpp's Python converter (K-quants need its compiled "
                     "llama-quantize)")
    hub_url = None
    if hub_repo is not None:
        found = find_hub_token(token)
        if found is None:
            notes.append(f"hub push skipped: {_NO_HUB_TOKEN}")
        else:
            hub_url = _push(adapter_dir, hub_repo, found, hub_private)
            notes.append(f"pushed to {hub_url} with the token from {found.source}")
    return ExportResult(step, adapter_dir, zip_path, merged_dir, gguf_path, hub_url, tuple(notes))


async def export_model(
    model: TrainableModel,
    backend: Backend | None = None,
    destination: str | os.PathLike[str] = "exports",
    *,
    step: int | None = None,
    **options: Any,
) -> ExportResult:
    """Export `model`'s served checkpoint (or `step`) with `export_adapter`, off the event loop.

    The checkpoint must be on this machine, under `backend.model_dir(model)`: a RemoteBackend's
    `download_checkpoint` or a ServerlessBackend's `pull_checkpoint` puts it there.
    """
    backend = backend if backend is not None else model.backend
    served = await backend.wait_for_checkpoint(model)  # a checkpoint still being written is not exported
    step = served if step is None else step
    checkpoints = checkpoints_dir(backend.model_dir(model))
    here = await asyncio.to_thread(checkpoint_steps, checkpoints)
    if step not in here:
        raise FileNotFoundError(f"no checkpoint {step} of {model.name!r} under {checkpoints} (there: "
                                f"{here or 'none'}); a RemoteBackend's download_checkpoint or a ServerlessBackend's "
                                "pull_checkpoint brings one to this machine")
    checkpoint = checkpoint_path(checkpoints, step)
    options.setdefault("base_model", model.base_model)
    options.setdefault("name", model.name)
    return await asyncio.to_thread(export_adapter, checkpoint, destination, **options)


def _write_adapter_dir(source: Path, target: Path, base_model: str, step: int) -> Path:
    """Copy the adapter (+ the base's tokenizer, so the directory is self-contained) atomically."""
    tmp = _private_temp_dir(target)
    for file in ADAPTER_FILES:
        shutil.copy2(source / file, tmp / file)
    config = _read_json(tmp / "adapter_config.json")
    config["base_model_name_or_path"] = base_model
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer_source = _local_base_dir(base_model)
    if tokenizer_source is not None:
        for file in _TOKENIZER_FILES:
            if (tokenizer_source / file).is_file():
                shutil.copy2(tokenizer_source / file, tmp / file)
    (tmp / "README.md").write_text(_model_card(base_model, step, config))
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target


def _local_base_dir(base_model: str) -> Path | None:
    """The base model's directory (for its tokenizer files). It was just trained from, so it resolves
    from the local cache; when it cannot be found the adapter is still complete without a tokenizer."""
    path = Path(base_model).expanduser()
    if path.is_dir():
        return path
    try:
        from .plan.base_models import resolve_base_model

        return resolve_base_model(base_model).path
    except Exception:  # noqa: BLE001 - any failure only means "no tokenizer copy"
        return None


def _model_card(base_model: str, step: int, config: dict[str, Any]) -> str:
    return (
        "---\n"
        f"base_model: {base_model}\n"
        "library_name: peft\n"
        "tags: [lora, grpo, art_nb]\n"
        "---\n\n"
        f"# LoRA adapter for {base_model}\n\n"
        f"Trained with GRPO by art_nb for {step} steps (LoRA rank {config.get('r')}, alpha "
        f"{config.get('lora_alpha')}).\n\n"
        "```python\n"
        "from peft import PeftModel\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f"base = AutoModelForCausalLM.from_pretrained({base_model!r})\n"
        "model = PeftModel.from_pretrained(base, 'path/to/this/directory')\n"
        "```\n"
    )


def _private_temp_dir(target: Path) -> Path:
    """A new directory beside `target`, created exclusively under an unpredictable name.

    A fixed name (`.{target}.tmp`) could be planted beforehand as a symlink to elsewhere, and the
    export would write (or delete) through it; mkdtemp creates the directory itself or fails.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))


def _zip_dir(directory: Path, target: Path) -> Path:
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)  # exclusive create
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as handle, zipfile.ZipFile(handle, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for file in sorted(directory.rglob("*")):
                if file.is_file():
                    archive.write(file, Path(directory.name) / file.relative_to(directory))
        os.replace(tmp, target)  # replaces a link at `target` itself, never what it points to
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def merge_adapter(
    adapter_dir: str | os.PathLike[str],
    target: str | os.PathLike[str],
    base_model: str,
    dtype: Literal["auto", "float16", "bfloat16"] = "auto",
) -> tuple[Path, str]:
    """Fold the LoRA into the base weights and save a standalone 16-bit model; returns (dir, why this dtype).

    `auto` keeps the base's own 16-bit dtype when its config names one, else float16 (loads on any GPU).
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .plan.base_models import resolve_base_model

    base_dir = resolve_base_model(base_model).path
    if dtype == "auto":
        declared = str(_read_json(base_dir / "config.json").get("torch_dtype") or
                       _read_json(base_dir / "config.json").get("dtype") or "")
        dtype = "bfloat16" if declared == "bfloat16" else "float16"
        why = f"merged in {dtype}: " + ("the base model's own dtype" if declared == "bfloat16"
                                        else "the base model is not bf16; float16 loads on every GPU")
    else:
        why = f"merged in {dtype}: as requested"
    # Merge in float32 (exact), then cast once: merging in 16-bit would round twice.
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged = merged.to({"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype])
    out = Path(target)
    tmp = _private_temp_dir(out)
    merged.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out, why


def _push(adapter_dir: Path, repo: str, token: Secret, private: bool) -> str:
    from huggingface_hub import HfApi

    api = HfApi(token=token.reveal())
    api.create_repo(repo, private=private, exist_ok=True)
    api.upload_folder(folder_path=str(adapter_dir), repo_id=repo, commit_message="art_nb: LoRA adapter")
    return f"https://huggingface.co/{repo}"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _step_from_dir(path: Path) -> int:
    return int(path.name) if path.name.isdigit() else 0
