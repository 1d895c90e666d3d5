"""The LoRA learning rate for a base model, by its size: the one rule the demo and the notebooks read.

`TrainConfig`'s own default is ART's (5e-6, with the CISPO loss), so ported ART code trains as it
did; at our sizes and step counts that rate does not move a small model. Whoever picks a rate for
a user (`art-nb demo`, the notebooks' parameters cell) asks `learning_rate_for`, so a base model
swapped in gets a rate that learns with it, and the measured points below are written once.

It lives in the plan package because its inputs are ones the plan package reads: the model's size
(a local directory's safetensors headers, `memory.count_parameters`, else the size in its name),
and the notebooks may read art_nb.local only through this package.

`short_run`: a run of a few small steps (the CPU shape: 8 steps of 24 games). The smallest models
take a larger rate there, measured with the CPU demo; larger runs (a GPU's 20 steps of 64 games)
take the band's rate.
"""

from __future__ import annotations

import math
import os
import re

from .memory import count_parameters

__all__ = ["learning_rate_for", "learning_rate_for_size", "parameter_count"]

# LoRA learning rate by model size: smaller models take larger steps. (fewer parameters than, rate, why)
_RATES: tuple[tuple[float, float, str], ...] = (
    (0.3e9, 2e-4, ("SmolLM2-135M learned tic-tac-toe on an H200 at 2e-4 (reward -0.73 -> 0.13 in 14 steps) "
                   "and did not move at 2e-5")),
    (2e9, 1e-4, "the usual LoRA rate for 0.5-1.5B models (not measured by art_nb)"),
    (5e9, 5e-5, "the usual LoRA rate for 3B models (not measured by art_nb)"),
    (math.inf, 2e-5, "the usual LoRA rate for 7B and larger models (not measured by art_nb)"),
)
_SHORT_RUN_SMALL = (5e-4, ("with 24 games a step, LoRA on a 135M model learns legal moves in 4-6 steps "
                           "(the CPU demo: 2e-4 for 3 steps did not move, 5e-4 for 8 did)"))
_SIZE_IN_NAME = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)([mb])(?![a-z])", re.IGNORECASE)


def parameter_count(base_model: str, local_copy: str | os.PathLike[str] | None = None) -> int | None:
    """Parameters of `base_model`: read from a local directory's safetensors headers, else from the
    size in its name ("SmolLM2-135M", "Qwen2.5-0.5B", "Llama-3.2-1B"), else from the headers of
    `local_copy` (where a hub id was downloaded to); None when none says."""
    path = os.path.expanduser(base_model)
    if os.path.isdir(path):
        return count_parameters(path) or None
    found = _SIZE_IN_NAME.search(base_model.rsplit("/", 1)[-1].replace("_", "-"))
    if found is not None:
        return int(float(found.group(1)) * (1e6 if found.group(2).lower() == "m" else 1e9))
    return (count_parameters(local_copy) or None) if local_copy is not None else None


def learning_rate_for_size(parameters: int | None, short_run: bool) -> tuple[float, str]:
    """(learning rate, why) for a model of `parameters`. An unknown size gets the largest models'
    rate, the one that does least harm when wrong, and the reason says to set it."""
    if parameters is None:
        rate = _RATES[-1][1]
        return rate, (f"{rate:g}: the model's size is not in its name, so the rate for large models; "
                      "set the learning rate yourself if it does not learn")
    size = f"{parameters / 1e9:.1f}B" if parameters >= 1e9 else f"{parameters / 1e6:.0f}M"
    floor, rate, why = next(band for band in _RATES if parameters < band[0])
    if short_run and floor == _RATES[0][0]:
        rate, why = _SHORT_RUN_SMALL
    return rate, f"{rate:g} for a {size} model: {why}"


def learning_rate_for(base_model: str, short_run: bool) -> tuple[float, str]:
    """(learning rate, why) for `base_model` (a hub id or a local directory) in a short or a full run."""
    return learning_rate_for_size(parameter_count(base_model), short_run)
