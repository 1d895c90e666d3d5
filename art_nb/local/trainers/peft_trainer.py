"""The trainer that runs everywhere: transformers + peft LoRA + AdamW, CPU or GPU.

The model stays resident between steps (loading it is the slow part). The GRPO math is
`art_nb.grpo`, shared with the Unsloth trainer; this file only owns weights, optimizer and files.
Device, dtype and 4-bit come from the model's `Plan` (art_nb/local/plan/choices.py): the trainer does
not decide them, so it trains in the dtype the engine serves in.

4-bit (`plan.load_in_4bit`, CUDA only): the linear layers load as bitsandbytes NF4 (double-quantised,
computing in the plan's dtype); what stays unquantised (embeddings, norms, lm head) stays in the
plan's dtype. Not peft's `prepare_model_for_kbit_training`: without gradient checkpointing its one
effect is to upcast those to float32, which puts the whole residual stream in float32: so prepared, a
long 3B step took more GPU memory in NF4 than in bf16; loaded as here, less. The LoRA weights are
float32 either way (peft upcasts adapters over a half-precision base), so a 4-bit checkpoint is the
same adapter files an engine loads over its full-precision base.

Stopping a step (`should_stop`, set when the user interrupts the cell): `grpo_step` asks it before
each microbatch and once more right before the optimizer steps. Until the optimizer steps,
stopping abandons the step with nothing changed (gradients dropped, `stopped` = 1 in the metrics);
once it has stepped, the step is complete and the caller saves it.

float16 (a T4, sm75: no bf16): the base computes in float16 and the LoRA weights are float32, but the
gradient flowing back through the base is float16, and GRPO's per-token gradients (an advantage over
tokens x trajectories) fall below float16's smallest subnormal (6e-8) and become 0. So the trainer
keeps a `torch.amp.GradScaler` for float16 plans: the loss is scaled before backward, gradients are
unscaled before clipping, an overflow skips the step (counted as `skipped_nonfinite`) and halves the
scale; its state persists across steps and checkpoints. On a tiny Llama on CPU, a loss scaled by 1e-6
gave all-zero LoRA gradients in float16 without it and matched float32 within 0.2% with it
(tests/unit/test_loss_fp16.py).

Nothing non-finite is kept or saved: an update that leaves a non-finite weight is reported
(`nonfinite_weights`, `skipped_nonfinite`) for the caller to roll back, and `save` refuses
non-finite weights or optimizer state.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import pickle
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from art_nb.config import ModelConfig, TrainConfig, default_microbatch_tokens
from art_nb.grpo.advantages import prepare_batch
from art_nb.grpo.step import grpo_step
from art_nb.sft_config import TrainSFTConfig
from art_nb.store import TRAINER_STATE, CheckpointError, write_adapter
from art_nb.trajectories import Trajectory, TrajectoryGroup
from art_nb.types import ProgressCallback

from ..engines.base import AdapterWeights, packed_copies
from ..plan.choices import Plan, plan_for
from ..plan.compat import quiet_checkpointing_alias

__all__ = ["PeftTrainer"]

_log = logging.getLogger("art_nb")


class PeftTrainer:
    name = "peft"

    def __init__(self, model_path: Path, config: ModelConfig, plan: Plan | None = None) -> None:
        """Load the base and a fresh LoRA as `plan` says (None: `plan_for(config)`, this machine's)."""
        from transformers import AutoTokenizer

        self.plan = plan if plan is not None else plan_for(config)
        self.device = self.plan.device
        self.config = config
        dtype_reason = self.plan.reasons.get("dtype", self.plan.dtype)
        four_bit = f"; {self.plan.reasons.get('load_in_4bit', '4-bit base')}" if self.plan.load_in_4bit else ""
        _log.debug("trainer: %s on %s, %s%s", self.name, self.device, dtype_reason, four_bit)
        torch.manual_seed(config.seed)
        # The tokenizer the server and the engine use: tokens trained must be tokens served.
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = self._build_model(Path(model_path), self.plan.torch_dtype())
        self.model.train()
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending_optimizer_state: dict[str, Any] | None = None
        self._sft_optimizer: torch.optim.Optimizer | None = None  # SFT's own AdamW moments (sft_step)
        self._adapter_params: dict[str, torch.nn.Parameter] | None = None  # _adapter_tensors' key -> parameter
        self._scaler = _grad_scaler(self.model, self.plan.dtype, self.device)

    def _build_model(self, model_path: Path, dtype: torch.dtype) -> Any:
        """The base model wrapped with a fresh LoRA; subclasses (Unsloth) build it their way."""
        from peft import LoraConfig, get_peft_model

        base = self._load_base(model_path, dtype)
        base.config.use_cache = False
        lora = self.config.lora
        with quiet_checkpointing_alias():
            return get_peft_model(base, LoraConfig(
                r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                target_modules=list(lora.target_modules), task_type="CAUSAL_LM",
            ))

    def _load_base(self, model_path: Path, dtype: torch.dtype) -> Any:
        """The frozen base: in `dtype` on the plan's device, or NF4 on the one GPU (module docstring)."""
        from transformers import AutoModelForCausalLM

        if not self.plan.load_in_4bit:
            return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device)
        from transformers import BitsAndBytesConfig

        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True,
        )
        return AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, quantization_config=quantization,
            device_map={"": torch.cuda.current_device()},
        )

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

    def train_step(self, groups: list[TrajectoryGroup], config: TrainConfig,
                   should_stop: Callable[[], bool] | None = None,
                   on_progress: ProgressCallback | None = None,
                   before_update: Callable[[], bool] | None = None) -> dict[str, float]:
        """One GRPO update (see `Trainer.train_step`); on a GPU the step's memory is handed back after."""
        self._use_plan_threads()
        try:
            return self._train_step(groups, config, should_stop, on_progress, before_update)
        finally:
            if self.device != "cpu":
                # Blocks PyTorch's caching allocator keeps after the step (activations, logits) look
                # used to any allocator outside PyTorch's: hand them back for whoever uses the GPU next.
                gc.collect()
                torch.cuda.empty_cache()

    def _train_step(self, groups: list[TrajectoryGroup], config: TrainConfig,
                    should_stop: Callable[[], bool] | None,
                    on_progress: ProgressCallback | None,
                    before_update: Callable[[], bool] | None) -> dict[str, float]:
        batch = prepare_batch(groups, self.tokenizer, config, self.config.max_seq_len,
                              vocab_size=self.model.get_input_embeddings().num_embeddings)
        metrics = batch.metrics()
        if not batch.items:
            metrics["skipped_empty"] = 1.0
            return metrics
        if config.microbatch_tokens is None:
            config = config.model_copy(update={"microbatch_tokens": default_microbatch_tokens(self.device)})
        optimizer = self._optimizer_for(config)
        self.model.train()
        metrics.update(grpo_step(self.model, optimizer, batch, config, device=self.device,
                                 should_stop=should_stop, on_progress=on_progress,
                                 reference=self.model.disable_adapter, scaler=self._scaler,
                                 before_update=before_update))
        if metrics.get("stopped"):
            return metrics
        bad = self._nonfinite_weight()
        if bad is not None:
            _log.warning("the update left non-finite values in %s", bad)
            metrics["nonfinite_weights"] = 1.0
            metrics["skipped_nonfinite"] = 1.0
        return metrics

    def sft_step(self, trajectories: list[Trajectory], config: TrainSFTConfig,
                 should_stop: Callable[[], bool] | None = None,
                 on_progress: ProgressCallback | None = None) -> dict[str, float]:
        """Supervised fine-tuning (see `Trainer.sft_step`), on the same LoRA as the GRPO steps.

        SFT has its own AdamW: GRPO's moments (in the checkpoint) are neither fed SFT gradients nor
        reset, much as ART resets the optimizer when training switches between SFT and RL. SFT's
        moments live in memory for later `train_sft` calls and are not checkpointed.
        """
        from art_nb.grpo.sft import prepare_sft_batches, sft_step

        self._use_plan_threads()
        batches = prepare_sft_batches(trajectories, self.tokenizer, config, self.config.max_seq_len)
        if self._sft_optimizer is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            self._sft_optimizer = torch.optim.AdamW(params, lr=0.0, weight_decay=config.weight_decay)
        self.model.train()
        rows: list[dict[str, float]] = []
        try:
            for done, batch in enumerate(batches, start=1):
                row = sft_step(self.model, self._sft_optimizer, batch, config, device=self.device,
                               microbatch_tokens=default_microbatch_tokens(self.device),
                               logprob_chunk_tokens=TrainConfig().logprob_chunk_tokens, should_stop=should_stop)
                if row["stopped"]:
                    break
                rows.append(row)
                if on_progress is not None:
                    on_progress({"phase": "sft", "done": done, "total": len(batches), **row})
        finally:
            if self.device != "cpu":
                gc.collect()
                torch.cuda.empty_cache()
        metrics = _sft_summary(rows, batches)
        if metrics["stopped"] or metrics["skipped_nonfinite"]:
            return metrics
        bad = self._nonfinite_weight()
        if bad is not None:
            _log.warning("the SFT update left non-finite values in %s", bad)
            metrics.update(nonfinite_weights=1.0, skipped_nonfinite=1.0)
        return metrics

    def _use_plan_threads(self) -> None:
        """Run this step's torch ops on the plan's CPU thread count, in whichever thread calls the step.

        torch fixes an OS thread's count the first time that thread runs a parallel op (plan/threads.py):
        an `asyncio.to_thread` worker that built or loaded the trainer before the engine set the count
        keeps torch's default (all cores), so steps ran on 1 or 2 threads depending on which worker
        took them. A sum split over two threads rounds differently from one: on a CPU whose kernels
        split by thread count (MKL_ENABLE_INSTRUCTIONS=SSE4_2 on Intel, or an AMD EPYC's MKL), a
        resumed run drifted from one never stopped.
        """
        if self.plan.cpu_threads is not None and torch.get_num_threads() != self.plan.cpu_threads:
            torch.set_num_threads(self.plan.cpu_threads)

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
        tensors = packed_copies(self._adapter_tensors(), to_host=True, what="adapter weights")
        write_adapter(directory, tensors, self._adapter_config())

    def adapter_weights(self) -> AdapterWeights:
        """The adapter as `save_pretrained` would write it, copied on the trainer's device: what a step
        hands the engine.

        One buffer per dtype, on the device: nothing waits for a host transfer on the step's path
        (vLLM converts it to its LoRA dtype there and moves it to the host once; the HF engine on the
        same GPU takes it as it is), and the checkpoint's host copy is made in the background
        (`AdapterWeights.on_host`, one transfer, not ~200). Non-finite weights are refused here, so
        nothing non-finite is ever served or saved.
        """
        return AdapterWeights(tensors=packed_copies(self._adapter_tensors(), to_host=False, what="adapter weights"),
                              config=self._adapter_config())

    def _adapter_tensors(self) -> dict[str, torch.Tensor]:
        """peft's state dict of the adapter, read straight from the parameters it names.

        `get_peft_model_state_dict` walks every module each time (~40-130 ms for a 135M model on a
        CPU); which parameter each key is does not change (steps and `load` update them in place),
        so it is asked once.
        """
        if self._adapter_params is None:
            from peft import get_peft_model_state_dict

            state = get_peft_model_state_dict(self.model)
            by_storage = {param.data_ptr(): param for param in self.model.parameters()}
            params = {key: by_storage.get(tensor.data_ptr()) for key, tensor in state.items()}
            if any(param is None or param.shape != state[key].shape for key, param in params.items()):
                return state  # not every entry is a parameter as it is: ask peft every time
            self._adapter_params = params
        return {key: param.detach() for key, param in self._adapter_params.items()}

    def _adapter_config(self) -> dict[str, Any]:
        """adapter_config.json as peft's `save_pretrained` writes it (an adapter saved for inference)."""
        config = copy.deepcopy(self.model.peft_config["default"])
        if config.base_model_name_or_path is None:  # as save_pretrained fills it in
            config.base_model_name_or_path = self.model.base_model.model.__dict__.get("name_or_path") or None
        config.inference_mode = True
        return json.loads(json.dumps(config.to_dict(), default=_json_default))

    def snapshot_state(self) -> Callable[[Path], None]:
        """Copy the RNG and loss-scaler state now; the returned function writes them, with the optimizer
        state as it is when called.

        The RNG is copied now because the next rollouts may draw from it (the HF engine samples with
        torch's generator). The optimizer's state dict is taken now too, but it only refers to the
        moment tensors (its hyperparameters are copied): they change in place at the next optimizer
        step, and the backend has the checkpoint written before that (`before_update`, commit.py),
        so no copy of them is made on the step's path.
        """
        state: dict[str, Any] = {
            "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
            "grad_scaler": self._scaler.state_dict() if self._scaler is not None else None}
        optimizer = self._optimizer.state_dict() if self._optimizer is not None else self._pending_optimizer_state

        def write(directory: Path) -> None:
            torch.save({"optimizer": _optimizer_on_host(optimizer), **state}, directory / TRAINER_STATE)

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
        if result.unexpected_keys:
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
            if state.get("grad_scaler") and self._scaler is not None:
                self._scaler.load_state_dict(state["grad_scaler"])
            if state.get("torch_rng") is not None:
                torch.set_rng_state(state["torch_rng"].cpu())
            if state.get("python_rng") is not None:
                python_rng = state["python_rng"]
                random.setstate((python_rng[0], tuple(python_rng[1]), python_rng[2]))


def _grad_scaler(model: Any, dtype: str, device: str) -> torch.amp.GradScaler | None:
    """A loss scaler for float16 training (module docstring); None in float32 or bfloat16.

    It needs float32 trainable weights (it refuses to unscale float16 gradients): peft's adapters over
    a float16 base are float32. Anything else trains unscaled, with a warning.
    """
    if dtype != "float16":
        return None
    if any(p.dtype != torch.float32 for p in model.parameters() if p.requires_grad):
        _log.warning("float16 training without loss scaling: the trainable weights are not float32, so small "
                     "gradients may underflow to 0")
        return None
    return torch.amp.GradScaler(torch.device(device).type)


def _sft_summary(rows: list[dict[str, float]], batches: list[Any]) -> dict[str, float]:
    """One SFT call's metrics: per-batch means (loss, grad_norm, learning_rate) over the batches that
    stepped, sums of tokens and trajectories, and what was left out."""
    applied = [r for r in rows if r["tokens_trained"] > 0]
    mean = {key: sum(r[key] for r in applied) / len(applied) if applied else 0.0
            for key in ("loss", "grad_norm", "learning_rate")}
    with_labels = sum(1 for b in batches if b.items)
    broke = len(rows) < len(batches)  # should_stop ended the call
    return {
        **mean,
        "tokens_trained": sum(r["tokens_trained"] for r in rows),
        "trajectories": float(sum(len(b.items) for b in batches)),
        "sft_batches": float(len(applied)),
        "dropped_too_long": float(sum(b.dropped_too_long for b in batches)),
        "without_labels": float(sum(b.without_labels for b in batches)),
        "skipped_nonfinite_batches": float(sum(r["skipped_nonfinite"] for r in rows)),
        "skipped_nonfinite": float(with_labels > 0 and not applied and not broke),
        "stopped": float(broke and not applied),
        "stopped_early": float(broke and bool(applied)),
    }


def _json_default(value: Any) -> Any:
    """Sets (target_modules) as lists, as peft writes them; anything else JSON cannot hold is a bug here."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"adapter config value {value!r} is not JSON")


def _optimizer_on_host(optimizer: dict[str, Any] | None) -> dict[str, Any] | None:
    """The optimizer state dict with its tensors on CPU, copied in one transfer per dtype
    (`packed_copies`, which refuses NaN/inf); the ~3 tensors per LoRA parameter one by one would each
    wait for the device, and they are read while the next step may already be queueing work on it."""
    if optimizer is None:
        return None
    per_param = optimizer.get("state", {})
    tensors = {f"{param}/{key}": value for param, values in per_param.items() for key, value in values.items()
               if isinstance(value, torch.Tensor)}
    copied = packed_copies(tensors, to_host=True, what="optimizer state")
    state = {param: {key: copied.get(f"{param}/{key}", value) for key, value in values.items()}
             for param, values in per_param.items()}
    return {**optimizer, "state": state}
