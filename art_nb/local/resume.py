"""What a checkpoint must be before it is loaded: trained on the base model asked for, with finite weights.

Register reads the newest checkpoint's meta.json before anything is built: a LoRA trained on one base
model, resumed on another, trains and serves nonsense without a word (after a restart nothing else
remembers what it was trained on). A checkpoint whose adapter holds NaN or inf is refused at load,
at register as when a request asks for an old step: served, it made every answer a 500. Either
refusal names the checkpoint relative to the model's directory (a remote client sees the message,
never the server's paths) and the newest earlier step that is intact.
"""

from __future__ import annotations

import json
import logging

from art_nb.store import ADAPTER_FILES, META_FILE, CheckpointError, ModelMismatchError, ModelStore, relative_text

__all__ = ["check_base_model", "check_finite", "resume_failed", "where"]

_log = logging.getLogger("art_nb")


def where(step: int) -> str:
    return f"checkpoint {step:04d} (checkpoints/{step:04d} in the model's directory)"


def check_base_model(store: ModelStore, base_model: str) -> None:
    """Refuse (`ModelMismatchError`, naming both) to resume a run trained on another base model."""
    step = store.latest_step()
    if step is None:
        return
    try:
        stored = json.loads((store.checkpoint_dir(step) / META_FILE).read_text()).get("base_model")
    except (OSError, ValueError, AttributeError) as error:  # no or unreadable meta: nothing to compare
        _log.warning("%s: meta.json unreadable (%s); its base model is not checked", where(step), type(error).__name__)
        return
    if isinstance(stored, str) and stored != base_model:
        raise ModelMismatchError(
            f"model {store.dir.name!r} was trained on base_model={stored!r} ({where(step)}'s meta.json), not "
            f"{base_model!r}: a LoRA resumed on another base model is meaningless. Register it with "
            f"base_model={stored!r}, or give the model on {base_model!r} another name")


def _nonfinite_tensor(store: ModelStore, step: int) -> str | None:
    """The name of the first adapter tensor of `step` holding NaN or inf, or None when all are finite."""
    import torch
    from safetensors.torch import load_file

    path = store.checkpoint_dir(step) / ADAPTER_FILES[0]
    try:
        tensors = load_file(str(path))
    except Exception as error:  # noqa: BLE001 - safetensors raises its own types for unreadable files
        raise CheckpointError(f"{where(step)}: its adapter cannot be read ({type(error).__name__}: "
                              f"{relative_text(str(error), store.dir)})") from None
    return next((name for name, tensor in tensors.items()
                 if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())), None)


def _previous_good(store: ModelStore, step: int) -> int | None:
    for earlier in reversed([s for s in store.steps() if s < step]):
        try:
            if _nonfinite_tensor(store, earlier) is None:
                return earlier
        except CheckpointError:
            continue
    return None


def _offer(store: ModelStore, step: int, purpose: str) -> str:
    good = _previous_good(store, step)
    if good is None:
        return "No earlier checkpoint is intact: register the model under another name to start afresh"
    if purpose == "serve":
        return f"The previous good step is {good}: ask for '{store.dir.name}@{good}'"
    return (f"The previous good step is {good}: to resume from it, move checkpoints/{step:04d} out of the model's "
            "directory (on the machine that holds it) and register again")


def check_finite(store: ModelStore, step: int, purpose: str = "resume") -> None:
    """Refuse (`CheckpointError`) checkpoint `step` when its adapter is not finite; `purpose` is
    "resume" (register) or "serve" (a request for an old step), which the offered fix depends on."""
    bad = _nonfinite_tensor(store, step)
    if bad is not None:
        verb = "it is not served" if purpose == "serve" else "register does not resume from it"
        raise CheckpointError(f"{where(step)} holds non-finite adapter weights ({bad}): {verb}. "
                              f"{_offer(store, step, purpose)}")


def resume_failed(store: ModelStore, step: int, error: BaseException) -> CheckpointError:
    """The error a register raises when loading checkpoint `step` failed: what failed, and the way back."""
    if isinstance(error, CheckpointError) and str(error).startswith(where(step)):
        return error  # already says it (check_finite)
    return CheckpointError(f"cannot resume from {where(step)}: {type(error).__name__}: "
                           f"{relative_text(str(error), store.dir)}. {_offer(store, step, 'resume')}")
