"""The trainer that runs everywhere: transformers + peft LoRA + AdamW, CPU or GPU.

The model stays resident between steps (loading it is the slow part). The GRPO math is
`art_nb.grpo`, shared with the Unsloth trainer; this file only owns weights, optimizer and files.

Stopping a step (`should_stop`, set when the user interrupts the cell): it is checked before each
microbatch's forward pass and once more right before the optimizer steps. Until the optimizer
steps, stopping abandons the step with nothing changed (gradients dropped, `stopped` = 1 in the
metrics); once it has stepped, the step is complete and the caller saves it.

Nothing non-finite is kept or saved: an update that leaves a non-finite weight is reported
(`nonfinite_weights`, `skipped_nonfinite`) for the caller to roll back, and `save` refuses
non-finite weights or optimizer state.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import pickle
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig, TrainConfig
from ..grpo.advantages import prepare_batch
from ..grpo.step import grpo_step
from ..store import CheckpointError
from ..trajectory import TrajectoryGroup
from ..store import TRAINER_STATE

__all__ = ["PeftTrainer", "pick_dtype"]

_log = logging.getLogger("art_nb")


def pick_dtype(config: ModelConfig, device: str) -> tuple[torch.dtype, str]:
    """The training dtype and why: fp32 on CPU, bf16 where the GPU has it, else fp16."""
    if config.dtype != "auto":
        return getattr(torch, config.dtype), f"{config.dtype}: set in ModelConfig.dtype"
    if device == "cpu":
        return torch.float32, "float32: CPU (bf16 matmuls are slow or emulated on most CPUs)"
    if torch.cuda.is_bf16_supported():
        return torch.bfloat16, "bfloat16: the GPU supports it"
    major, minor = torch.cuda.get_device_capability()
    return torch.float16, f"float16: this GPU (sm{major}{minor}) has no bf16"


class PeftTrainer:
    name = "peft"

    def __init__(self, model_path: Path, config: ModelConfig, device: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.config = config
        dtype, reason = pick_dtype(config, self.device)
        _log.info("trainer: %s on %s, %s%s", self.name, self.device, reason,
                  ", 4-bit base" if config.load_in_4bit else "")
        self.dtype_reason = reason
        torch.manual_seed(config.seed)
        # The tokenizer the server and the engine use: tokens trained must be tokens served.
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = self._build_model(Path(model_path), dtype)
        self.model.train()
        self._optimizer: torch.optim.Optimizer | None = None
        self._optimizer_key: tuple[float, float, tuple[float, float]] | None = None
        self._pending_optimizer_state: dict[str, Any] | None = None

    def _build_model(self, model_path: Path, dtype: torch.dtype) -> Any:
        """The base model wrapped with a fresh LoRA; subclasses (Unsloth) build it their way."""
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device)
        base.config.use_cache = False
        lora = self.config.lora
        return get_peft_model(base, LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules), task_type="CAUSAL_LM",
        ))

    def _optimizer_for(self, config: TrainConfig) -> torch.optim.Optimizer:
        """AdamW over the LoRA parameters; its moments survive steps and checkpoints."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(
                params, lr=config.learning_rate, betas=config.adam_betas, weight_decay=config.weight_decay
            )
            if self._pending_optimizer_state is not None:
                self._optimizer.load_state_dict(self._pending_optimizer_state)
                self._pending_optimizer_state = None
        for group in self._optimizer.param_groups:  # the user may change these between steps
            group["lr"] = config.learning_rate
            group["betas"] = config.adam_betas
            group["weight_decay"] = config.weight_decay
        return self._optimizer

    def train_step(self, groups: list[TrajectoryGroup], config: TrainConfig, should_stop: Any = None) -> dict[str, float]:
        try:
            return self._train_step(groups, config, should_stop)
        finally:
            if self.device != "cpu":
                # Hand the step's activation memory back to the driver: vLLM re-allocates its KV cache
                # outside PyTorch's caching allocator when it wakes, and would not see cached blocks as free.
                gc.collect()
                torch.cuda.empty_cache()

    def _train_step(self, groups: list[TrajectoryGroup], config: TrainConfig, should_stop: Any) -> dict[str, float]:
        batch = prepare_batch(groups, self.tokenizer, config, self.config.max_seq_len)
        metrics = batch.metrics()
        if not batch.items:
            metrics["skipped_empty"] = 1.0
            return metrics
        if config.microbatch_tokens is None:
            config = config.model_copy(update={"microbatch_tokens": 1024 if self.device == "cpu" else 8192})
        optimizer = self._optimizer_for(config)
        self.model.train()
        try:
            with _stoppable(self.model, optimizer, should_stop):
                metrics.update(grpo_step(self.model, optimizer, batch, config, device=self.device))
        except _Stopped:
            optimizer.zero_grad(set_to_none=True)
            metrics["stopped"] = 1.0
            return metrics
        bad = self._nonfinite_weight()
        if bad is not None:
            _log.warning("the update left non-finite values in %s", bad)
            metrics["nonfinite_weights"] = 1.0
            metrics["skipped_nonfinite"] = 1.0
        return metrics

    def _nonfinite_weight(self) -> str | None:
        """The name of a trainable parameter holding NaN/inf, or None (one device sync, not one per tensor)."""
        named = [(name, param) for name, param in self.model.named_parameters() if param.requires_grad]
        if not named:
            return None
        finite = torch.stack([torch.isfinite(param).all() for _, param in named]).tolist()
        return next((name for (name, _), ok in zip(named, finite, strict=True) if not ok), None)

    def save(self, directory: Path) -> None:
        self.save_adapter(directory)
        self.snapshot_state()(directory)

    def save_adapter(self, directory: Path) -> None:
        """Write the PEFT adapter (safetensors + config): what an engine loads to serve this step."""
        bad = self._nonfinite_weight()
        if bad is not None:
            raise ValueError(f"refusing to save non-finite adapter weights ({bad})")
        self.model.save_pretrained(directory, safe_serialization=True)

    def snapshot_state(self) -> Callable[[Path], None]:
        """Copy optimizer and RNG state to CPU now; the returned function writes that copy later.

        The copy is what lets the file be written in the background while the next step's rollouts
        run: the optimizer's own tensors change in place at the next step.
        """
        optimizer = self._optimizer.state_dict() if self._optimizer is not None else self._pending_optimizer_state
        if optimizer is not None:
            optimizer = _to_cpu(optimizer)
        state = {"optimizer": optimizer, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}

        def write(directory: Path) -> None:
            if optimizer is not None and not _all_finite(optimizer.get("state", {})):
                raise ValueError("refusing to save a non-finite optimizer state")
            torch.save(state, directory / TRAINER_STATE)

        return write

    def load(self, directory: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        weights_path = directory / "adapter_model.safetensors"
        try:
            weights = load_file(str(weights_path), device=self.device)
        except Exception as error:  # safetensors raises its own error type for unreadable files
            raise CheckpointError(f"cannot read {weights_path}: {type(error).__name__}: {error}") from error
        result = set_peft_model_state_dict(self.model, weights)
        if getattr(result, "unexpected_keys", None):
            raise RuntimeError(f"checkpoint {directory} has unexpected adapter keys: {result.unexpected_keys[:3]}")
        state_path = directory / TRAINER_STATE
        if state_path.exists():
            try:  # weights_only: tensors and plain containers; a pickled object that runs code is refused
                state = torch.load(state_path, weights_only=True, map_location=self.device)
            except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
                raise CheckpointError(
                    f"refused to load {state_path}: it is not a plain tensor file ({type(error).__name__}: "
                    f"{str(error).splitlines()[0] if str(error) else ''}); delete this checkpoint to resume from "
                    "the one before"
                ) from error
            self._pending_optimizer_state = state.get("optimizer")
            self._optimizer = None
            if state.get("torch_rng") is not None:
                torch.set_rng_state(state["torch_rng"].cpu())
            if state.get("python_rng") is not None:
                python_rng = state["python_rng"]
                random.setstate((python_rng[0], tuple(python_rng[1]), python_rng[2]))


class _Stopped(Exception):
    """Raised inside a step when `should_stop()` says so, before the optimizer has stepped."""


@contextlib.contextmanager
def _stoppable(model: Any, optimizer: torch.optim.Optimizer, should_stop: Callable[[], bool] | None) -> Iterator[None]:
    """Check `should_stop` before each microbatch's decoder pass and right before `optimizer.step`."""
    if should_stop is None:
        yield
        return

    def check(*_: Any) -> None:
        if should_stop():
            raise _Stopped

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    handle = decoder.register_forward_pre_hook(check)
    step = optimizer.step

    def guarded_step(*args: Any, **kwargs: Any) -> Any:
        check()
        return step(*args, **kwargs)

    own_step = vars(optimizer).get("step")  # normally None: `step` is the class's method
    optimizer.step = guarded_step  # type: ignore[method-assign]
    try:
        yield
    finally:
        handle.remove()
        if own_step is None:
            del optimizer.step
        else:
            optimizer.step = own_step  # type: ignore[method-assign]


def _to_cpu(state: Any) -> Any:
    """A CPU copy of a (nested) state dict; tensors already on CPU are cloned, so later in-place updates miss it."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: _to_cpu(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_cpu(value) for value in state)
    return state


def _all_finite(state: Any) -> bool:
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, dict):
        return all(_all_finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(_all_finite(v) for v in state)
    return True
