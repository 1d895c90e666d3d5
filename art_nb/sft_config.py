"""`TrainSFTConfig`: what one `model.train_sft(trajectories, config)` call does, with ART's fields.

ART's `art.TrainSFTConfig` has three fields, kept here with the same names and defaults:
`learning_rate` (one value, or one per batch so a schedule such as ART's `create_lr_schedule`
ports unchanged), `batch_size` (trajectories per optimizer step; "auto" is ART's local default,
2) and `assistant_turns` ("all": every assistant turn is a label; "last": only the final one, the
earlier turns are context). The optimizer settings ART hard-codes for SFT (weight decay 0.01,
gradient norm clipped at 1.0) are fields here so they can be read and changed.

Pure data (layer 0): validated at construction, with messages that say how to fix the input.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["AUTO_SFT_BATCH_SIZE", "TrainSFTConfig"]

AUTO_SFT_BATCH_SIZE = 2  # ART's LocalBackend resolves batch_size="auto" to 2


class TrainSFTConfig(BaseModel):
    """Supervised fine-tuning knobs: one optimizer step per batch, one checkpoint per call."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    learning_rate: float | list[float] = Field(
        5e-5, description="one rate for every batch, or one per batch (a schedule), as in ART")
    batch_size: int | Literal["auto"] = Field(
        "auto", description=f"trajectories per optimizer step; 'auto' is {AUTO_SFT_BATCH_SIZE} (ART's local default)")
    assistant_turns: Literal["all", "last"] = Field(
        "all", description="which assistant turns are labels: every one, or only the last (the rest is context)")
    weight_decay: float = Field(0.01, ge=0, allow_inf_nan=False, description="AdamW weight decay (ART's SFT value)")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient norm clip per batch (ART's SFT value)")

    @field_validator("learning_rate")
    @classmethod
    def _positive_rates(cls, value: float | list[float]) -> float | list[float]:
        rates = value if isinstance(value, list) else [value]
        if isinstance(value, list) and not value:
            raise ValueError("learning_rate=[]: give one rate, or one per batch")
        for rate in rates:
            if not math.isfinite(rate) or rate < 0 or rate > 1:
                raise ValueError(f"learning_rate {rate} must be a finite number in [0, 1], e.g. 5e-5")
        return value

    @field_validator("batch_size")
    @classmethod
    def _positive_batch(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"batch_size={value}: give at least 1 trajectory per batch, or 'auto'")
        return value

    @property
    def resolved_batch_size(self) -> int:
        """`batch_size` with "auto" resolved (ART's local backend: 2)."""
        return AUTO_SFT_BATCH_SIZE if self.batch_size == "auto" else int(self.batch_size)

    def schedule(self, trajectories: int) -> list[float]:
        """One learning rate per batch of `trajectories` demonstrations: ceil(trajectories / batch size)
        batches, the last one shorter if they do not divide evenly (as ART batches them)."""
        return self.learning_rates(-(-trajectories // self.resolved_batch_size))

    def learning_rates(self, batches: int) -> list[float]:
        """One learning rate per batch: the single rate repeated, or the schedule given, which must
        have exactly one rate per batch (ART raises on a mismatch too)."""
        if not isinstance(self.learning_rate, list):
            return [float(self.learning_rate)] * batches
        if len(self.learning_rate) != batches:
            raise ValueError(
                f"learning_rate has {len(self.learning_rate)} rates but the trajectories make {batches} batches of "
                f"{self.resolved_batch_size}: give one rate per batch, or a single rate")
        return [float(rate) for rate in self.learning_rate]
