"""How much of the GPU vLLM may take, when the trainer lives on the same GPU. Pure arithmetic.

The in-process backend keeps two things on one GPU: vLLM (weights + KV cache, serving) and the
trainer's model (weights + LoRA + optimizer, resident between steps so a step does not reload it).
Their peaks do not overlap: during a train step vLLM sleeps (level 1: the KV cache is freed and the
weights are copied to CPU), so only a small residue stays; while serving, the trainer's resident
model still holds its memory. Hence two budgets against the same free memory:

    serving:  vLLM(weights + overhead + KV)  +  trainer resident       <= free - safety
    training: vLLM asleep (residue)          +  trainer resident + activations <= free - safety

vLLM's `gpu_memory_utilization` is a fraction of *total* memory that vLLM may use; vLLM fills
whatever its share leaves after weights and activations with KV cache. We give it enough KV for
`batch_tokens` (many sequences at full length), no more: the rest stays free for the notebook.

Every number is an estimate; each choice comes with a reason string, and
`ModelConfig.gpu_memory_utilization` overrides the share. Nothing here touches a GPU: callers pass
`torch.cuda.mem_get_info()`, which is what makes this unit-testable.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from art_nb.config import default_microbatch_tokens

__all__ = ["GiB", "ModelShape", "MemoryPlan", "count_parameters", "headroom", "plan_gpu_memory", "read_model_shape"]

GiB = 1024**3

# NF4 stores 4 bits per weight plus one fp32 absmax per 64-weight block (~0.5 bit; double
# quantisation shrinks it, we do not count on that). Embeddings and the LM head stay unquantised.
_NF4_BYTES_PER_PARAM = 4.5 / 8
# A LoRA parameter in training: fp32 weight + fp32 gradient + AdamW's two fp32 moments.
_LORA_STATE_BYTES = 16
# vLLM inside its share beyond weights, KV and one step's activations: sampler, LoRA slots, profiling peak.
_VLLM_BASE_OVERHEAD = GiB
_VLLM_CUDA_GRAPHS = GiB // 2
# What vLLM's process grows by *beyond* its share while serving long rollouts: gpu_memory_utilization
# sizes the KV cache at start-up, but blocks the caching allocator takes later are not in it. Measured
# at 3B under a 15 GiB cap (bench/gpu_memory_fit.py), register to the end of 64 rollouts
# of ~3900 tokens: +1.96 GiB with NF4 weights (bitsandbytes dequantises into temporary buffers), +0.64
# GiB with bf16 weights and CUDA graphs, +2.0-2.4 GiB in earlier eager runs. Planned beside the share.
_VLLM_SERVING_GROWTH = int(2.4 * GiB)
_KV_FLOOR_SEQUENCES = 8
VLLM_STEP_TOKENS = 8192  # tokens of one scheduler step, what vLLM's profiling run uses
# What a sleeping vLLM (level 1) still holds: allocator cache, CUDA graph pool, LoRA slots.
_VLLM_ASLEEP = GiB // 2
# Without a config.json, assume overheads as for a ~7B model.
_UNKNOWN_SHAPE_ACTIVATIONS = 2 * GiB


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a decoder-only transformer that memory depends on (from config.json)."""

    layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool = True

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Keys and values for one token across all layers."""
        return 2 * self.layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def lora_params(self, rank: int) -> int:
        """LoRA parameters for all seven linear projections of every layer (an upper bound when fewer are targeted)."""
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        per_layer = (h + q_out) * 2 + (h + kv_out) * 2 + (h + i) * 3  # q,o + k,v + gate,up,down
        return rank * per_layer * self.layers

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    def activation_bytes_per_token(self, dtype_bytes: int, gradient_checkpointing: bool) -> int:
        """Training activations kept for backward, per token. One layer's worth is about
        16·hidden + 3·intermediate values (attention and MLP inputs/outputs, norms, SiLU);
        with checkpointing only each layer's input is kept, plus one layer being recomputed."""
        one_layer = (16 * self.hidden_size + 3 * self.intermediate_size) * dtype_bytes
        if gradient_checkpointing:
            return self.layers * self.hidden_size * dtype_bytes + one_layer
        return self.layers * one_layer


def read_model_shape(model_dir: str | Path) -> ModelShape | None:
    """The shape from `model_dir/config.json`, or None when it is missing or not a plain decoder config."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)  # multimodal wrappers keep the LM's numbers inside
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        return ModelShape(
            layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
    except (KeyError, TypeError, ValueError):
        return None


def count_parameters(model_dir: str | Path) -> int:
    """Parameters stored in the safetensors files of `model_dir`, read from their headers (no tensor is loaded)."""
    total = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with open(file, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_len))
        for name, entry in header.items():
            if name != "__metadata__":
                total += math.prod(entry["shape"])
    return total


@dataclass(frozen=True)
class MemoryPlan:
    """vLLM's share and the estimates behind it. `fits` is False when the serving budget cannot hold
    vLLM's minimum (weights + one full-length sequence of KV) next to the resident trainer."""

    gpu_memory_utilization: float
    reasons: list[str]
    fits: bool
    vllm_bytes: int
    kv_bytes: int
    kv_tokens: int  # tokens the KV cache should hold at this share
    trainer_resident_bytes: int
    trainer_peak_bytes: int
    warnings: list[str] = field(default_factory=list)
    train_awake: bool = False
    """Training fits beside vLLM's whole share, so vLLM need not sleep for a step (sleep + wake +
    the first-sleep weight copy cost 0.4-8 s a step at 3B on an H200)."""


def plan_gpu_memory(
    free_bytes: int,
    total_bytes: int,
    model_params: int,
    dtype_bytes: int,
    lora_rank: int,
    max_seq_len: int,
    batch_tokens: int,
    load_in_4bit: bool,
    *,
    shape: ModelShape | None = None,
    override: float | None = None,
    microbatch_tokens: int | None = None,
    gradient_checkpointing: bool = True,
    cuda_graphs: bool = True,
    engine_4bit: bool = False,
) -> MemoryPlan:
    """Choose vLLM's `gpu_memory_utilization` for a GPU with `free_bytes` of `total_bytes` free.

    `batch_tokens`: KV-cache tokens wanted while serving (e.g. concurrent sequences x max_seq_len).
    `microbatch_tokens`: tokens per forward/backward in training (TrainConfig.microbatch_tokens; None: the
    trainer's GPU default, `default_microbatch_tokens("cuda")`).
    `override`: the user's ModelConfig.gpu_memory_utilization, used as given (and checked).
    `engine_4bit`: vLLM holds its weights as NF4 (bitsandbytes), like a 4-bit trainer.
    """
    if total_bytes <= 0 or free_bytes <= 0 or model_params <= 0:
        raise ValueError("free_bytes, total_bytes and model_params must be positive")
    if microbatch_tokens is None:
        microbatch_tokens = default_microbatch_tokens("cuda")
    reasons: list[str] = []
    warnings: list[str] = []
    # Outside the plan: CUDA context and cuBLAS workspaces (outside torch's allocator), and blocks the
    # caching allocator holds but cannot reuse. Measured on the H200 under a 15 GiB cap (3B, 4-bit,
    # bench/gpu_memory_fit.py): 1.1 GiB outside torch, 1.5 GiB reserved beyond allocated; 1.5 GiB
    # kept back overshot the cap by 0.36 GiB.
    safety = max(3 * GiB, int(0.08 * total_bytes))
    usable = free_bytes - safety
    reasons.append(f"{_gib(free_bytes)} of {_gib(total_bytes)} free; {_gib(safety)} kept back for "
                   "fragmentation and the notebook")

    # The trainer: resident while serving, plus activations while training.
    embed = shape.embedding_params() if shape else int(0.05 * model_params)
    nf4_weights = int((model_params - embed) * _NF4_BYTES_PER_PARAM) + embed * dtype_bytes
    if load_in_4bit:
        trainer_weights = nf4_weights
        how = "4-bit NF4 (embeddings unquantised)"
    else:
        trainer_weights = model_params * dtype_bytes
        how = f"{dtype_bytes}-byte weights"
    lora = shape.lora_params(lora_rank) if shape else int(26 * lora_rank * math.sqrt(model_params))
    resident = trainer_weights + lora * _LORA_STATE_BYTES
    reasons.append(
        f"trainer resident: {_gib(resident)} ({how}, {lora / 1e6:.1f}M LoRA parameters with gradients and AdamW state)"
    )
    if shape:
        activations = microbatch_tokens * shape.activation_bytes_per_token(dtype_bytes, gradient_checkpointing)
        activations += 3 * 512 * shape.vocab_size * 4  # one fp32 logits chunk: logits, softmax, gradient
    else:
        activations = _UNKNOWN_SHAPE_ACTIVATIONS
    peak = resident + activations + _VLLM_ASLEEP
    reasons.append(f"training peak: {_gib(peak)} (activations for {microbatch_tokens} tokens; vLLM asleep)")
    if peak > usable:
        warnings.append(
            f"training may run out of memory ({_gib(peak)} needed, {_gib(usable)} usable): lower "
            "TrainConfig.microbatch_tokens, set ModelConfig.load_in_4bit=True, or use a smaller model"
        )

    # vLLM while serving: weights + overhead + KV, in the room the resident trainer and vLLM's own
    # growth beyond its share leave.
    weights = nf4_weights if engine_4bit else model_params * dtype_bytes
    overhead = _VLLM_BASE_OVERHEAD + (_VLLM_CUDA_GRAPHS if cuda_graphs else 0)
    if shape:
        overhead += VLLM_STEP_TOKENS * (4 * shape.hidden_size + 2 * shape.intermediate_size) * dtype_bytes
        kv_per_token = shape.kv_bytes_per_token(dtype_bytes)
    else:
        overhead += _UNKNOWN_SHAPE_ACTIVATIONS
        kv_per_token = max(1, int(0.5 * model_params * dtype_bytes / 4096))  # ~half the weights per 4k tokens
    minimum = weights + overhead + kv_per_token * max_seq_len
    wanted = weights + overhead + kv_per_token * batch_tokens
    # Keep room for the growth beside the share, unless that would leave KV for fewer than
    # _KV_FLOOR_SEQUENCES full-length sequences (rollouts then crawl): the room gives way down to that.
    floor = weights + overhead + kv_per_token * min(batch_tokens, _KV_FLOOR_SEQUENCES * max_seq_len)
    slack = total_bytes // 500  # the share is rounded to 0.001 of the total
    growth = max(0, min(_VLLM_SERVING_GROWTH, usable - resident - max(minimum, floor) - slack))
    room = usable - resident - growth
    if growth < _VLLM_SERVING_GROWTH:
        warnings.append(
            f"serving may use up to {_gib(_VLLM_SERVING_GROWTH - growth)} more than planned (vLLM grows beyond "
            "its share while serving long rollouts): serve 4-bit weights (ModelConfig.vllm_4bit), lower max_seq_len, or use "
            "a smaller model for headroom"
        )

    if override is not None:
        share = override
        reasons.append(f"gpu_memory_utilization {override}: set in ModelConfig.gpu_memory_utilization")
        if override * total_bytes > room:
            warnings.append(
                f"the override gives vLLM {_gib(override * total_bytes)} but only {_gib(room)} is left next to "
                "the resident trainer: expect an out-of-memory error while serving or training"
            )
    else:
        # Shares are rounded to 0.001: up for what vLLM wants, down for what there is room for
        # (vLLM refuses to start when its share of the total exceeds the free memory).
        share = min(_round(wanted / total_bytes, math.ceil), _round(room / total_bytes, math.floor), 0.95)
        what = f"{_gib(weights)} {'NF4 ' if engine_4bit else ''}weights"
        if wanted <= room:
            reasons.append(f"vLLM: {what} + {_gib(overhead)} overhead + KV for {batch_tokens} tokens")
        else:
            reasons.append(f"vLLM: all {_gib(room)} left next to the resident trainer ({what}) and "
                           f"{_gib(growth)} for vLLM's growth while serving; KV for fewer than the "
                           f"{batch_tokens} tokens wanted, so fewer sequences run at once")
    vllm_bytes = int(share * total_bytes)
    fits = vllm_bytes >= minimum
    if not fits:
        warnings.append(
            f"vLLM needs at least {_gib(minimum)} (weights {_gib(weights)} + overhead + KV for one "
            f"{max_seq_len}-token sequence) but gets {_gib(vllm_bytes)}: set ModelConfig.load_in_4bit=True "
            "(trainer), lower max_seq_len, or use a smaller model"
        )
    kv_bytes = max(vllm_bytes - weights - overhead, 0)
    awake_peak = resident + int(1.25 * activations)  # a quarter more: the estimate must err towards sleeping
    train_awake = fits and vllm_bytes + growth + awake_peak <= usable
    both = f"its {_gib(vllm_bytes + growth)} + training {_gib(awake_peak)}"
    reasons.append(f"vLLM stays awake while training: {both} fit in {_gib(usable)}" if train_awake else
                   f"vLLM sleeps while training: {both} exceed {_gib(usable)}" if fits else
                   "vLLM sleeps while training: it does not fit as planned")
    reasons.append(f"gpu_memory_utilization={share} ({_gib(vllm_bytes)}; KV for ~{kv_bytes // kv_per_token} tokens)")
    return MemoryPlan(
        gpu_memory_utilization=share,
        reasons=reasons,
        fits=fits,
        vllm_bytes=vllm_bytes,
        kv_bytes=kv_bytes,
        kv_tokens=kv_bytes // kv_per_token,
        trainer_resident_bytes=resident,
        trainer_peak_bytes=peak,
        warnings=warnings,
        train_awake=train_awake,
    )


def headroom(used: int, total: int, capped: bool, vllm: bool) -> str:
    """What register reports about the GPU once engine and trainer are loaded: used, left, and what is still to come."""
    where = "this process's cap" if capped else "the GPU"
    line = f"{_gib(used)} used of {_gib(total)} ({where}) after register: {_gib(max(total - used, 0))} headroom"
    if vllm:
        line += (f"; serving long rollouts takes up to ~{_gib(_VLLM_SERVING_GROWTH)} more (planned), and a "
                 "train step its training peak (the memory reasons above)")
    return line


def _round(fraction: float, how: Callable[[float], int]) -> float:
    return max(how(fraction * 1000), 1) / 1000


def _gib(n: int | float) -> str:
    return f"{n / GiB:.1f} GiB"
