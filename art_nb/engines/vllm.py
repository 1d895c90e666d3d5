"""`VLLMEngine`: vLLM's v1 engine, running in this process, behind the `Engine` protocol.

In-process on purpose: the trainer lives in this process too, so one CUDA context holds both,
and the memory vLLM frees when it sleeps is memory the trainer can use a moment later. vLLM's
`AsyncLLM` cannot do that: it always runs its engine core in a child process (vLLM 0.25:
`AsyncLLM` builds an `AsyncMPClient`, and `EngineCoreClient.make_client` refuses asyncio without
multiprocessing). So we build the synchronous `LLMEngine` with its core in-process (the
environment variable VLLM_ENABLE_V1_MULTIPROCESSING=0, set in `create` for the duration of the
build and restored after, which is what `vllm.LLM` runs on) and drive it from asyncio ourselves:

- every vLLM call (build, add_request, step, LoRA, sleep/wake) runs on ONE dedicated thread, in
  submission order, so vLLM only ever sees a single caller and the event loop never blocks;
- while requests are pending, a driver task keeps submitting `step()`; requests that arrive
  between two steps join the running batch (continuous batching, as in vLLM's own server).

Sampling returns the sampled token ids and their raw logprobs (`logprobs_mode="raw_logprobs"`:
the model's distribution before temperature/top-p, which is what the trainer recomputes). Each
`load_adapter` gets a fresh LoRA integer id, because vLLM caches adapters (and prefix-cache
blocks) by id: reusing an id for new weights would serve the old ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import json
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from ..config import ModelConfig
from .base import ContextTooLongError, EngineDeadError, EngineError, GenerationRequest, Sample, SamplingParams

__all__ = ["VLLMEngine", "engine_args"]

_log = logging.getLogger("art_nb")
_T = TypeVar("_T")
_MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
_EAGER_ENV = "ART_NB_VLLM_ENFORCE_EAGER"
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM accepts for max_lora_rank
# Adapters resident on the accelerator at once: the newest step, plus an older one a rollout may
# still ask for by "{name}@{step}" while the swap happens.
_MAX_LORAS = 2
_MAX_CPU_LORAS = 4


def engine_args(model_path: Path, config: ModelConfig, on_cuda: bool, enforce_eager: bool | None = None,
                memory: tuple[int, int] | None = None) -> tuple[dict[str, Any], list[str]]:
    """vLLM `EngineArgs` keywords for `config`, with the reason for each automatic choice.

    `memory` is (free, total) accelerator bytes, for the memory plan (CUDA only).
    """
    kwargs, reasons, _ = _plan_engine(model_path, config, on_cuda, enforce_eager, memory)
    return kwargs, reasons


def _plan_engine(model_path: Path, config: ModelConfig, on_cuda: bool, enforce_eager: bool | None,
                 memory: tuple[int, int] | None) -> tuple[dict[str, Any], list[str], bool]:
    """`engine_args`, plus whether vLLM may stay awake while a step trains."""
    import torch

    from ..memory import VLLM_STEP_TOKENS, count_parameters, plan_gpu_memory, read_model_shape
    from ..trainers.peft import pick_dtype  # the trainer's dtype: engine and trainer logprobs must agree

    reasons: list[str] = []
    dtype, why = pick_dtype(config, "cuda" if on_cuda else "cpu")
    reasons.append(f"dtype {why}")
    max_len = config.max_seq_len
    model_limit = _max_positions(model_path)
    if model_limit is not None and model_limit < max_len:
        reasons.append(f"max_model_len {model_limit}: the model's positions limit (max_seq_len={max_len} asked)")
        max_len = model_limit
    rank = next((r for r in _LORA_RANKS if r >= config.lora.rank), _LORA_RANKS[-1])
    if enforce_eager is None:
        enforce_eager = os.environ.get(_EAGER_ENV, "").strip().lower() in {"1", "true", "yes"}
        if enforce_eager:
            reasons.append(f"enforce_eager: {_EAGER_ENV} is set (faster start, slower decoding)")
    kwargs: dict[str, Any] = dict(
        model=str(model_path),
        tokenizer=str(model_path),
        dtype=str(dtype).removeprefix("torch."),
        seed=config.seed,
        max_model_len=max_len,
        enable_lora=True,
        max_lora_rank=rank,
        max_loras=_MAX_LORAS,
        max_cpu_loras=_MAX_CPU_LORAS,
        enforce_eager=enforce_eager,
        enable_prefix_caching=True,
        logprobs_mode="raw_logprobs",
        disable_log_stats=True,
    )
    shape = read_model_shape(model_path)
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    batch_tokens = config.max_batch_size * max_len
    train_awake = False
    if on_cuda:
        kwargs["enable_sleep_mode"] = True
        # The memory plan budgets vLLM's activations for this many tokens a step (vLLM's default
        # for an offline engine on an H200 is 16384, which overran a T4-sized cap).
        kwargs["max_num_batched_tokens"] = max(VLLM_STEP_TOKENS, max_len)
        free, device_total = memory if memory is not None else torch.cuda.mem_get_info()
        fraction = 1.0  # a cap set with torch.cuda.set_per_process_memory_fraction (torch >= 2.6 reads it back)
        if memory is None and hasattr(torch.cuda, "get_per_process_memory_fraction"):
            fraction = float(torch.cuda.get_per_process_memory_fraction())
        free, total = capped_memory(free, device_total, fraction, torch.cuda.memory_reserved() if fraction < 1 else 0)
        if total < device_total:
            reasons.append(f"memory: planned within this process's cap of {total / 2**30:.1f} GiB "
                           f"(torch.cuda.set_per_process_memory_fraction({fraction:g}))")
        # vLLM's gpu_memory_utilization is a share of the whole device; the plan works within `total`.
        to_plan = total / device_total
        override = config.gpu_memory_utilization
        plan = plan_gpu_memory(
            free, total, count_parameters(model_path), dtype_bytes, config.lora.rank, max_len, batch_tokens,
            config.load_in_4bit, shape=shape, override=None if override is None else override / to_plan,
            cuda_graphs=not enforce_eager,
        )
        for warning in plan.warnings:
            _log.warning("memory: %s", warning)
        if not plan.fits and config.gpu_memory_utilization is None:
            raise EngineError("the model does not fit next to the trainer: " + "; ".join(plan.warnings))
        kwargs["gpu_memory_utilization"] = override if override is not None else round(
            plan.gpu_memory_utilization * to_plan, 4)
        reasons.extend(f"memory: {r}" for r in plan.reasons)
        train_awake = plan.train_awake
        if config.sleep_during_training is not None:
            train_awake = not config.sleep_during_training
            reasons.append(f"vLLM {'sleeps' if config.sleep_during_training else 'stays awake'} while training: "
                           f"set in ModelConfig.sleep_during_training")
    else:
        # vLLM's CPU build sizes its KV cache in bytes; a modest slice of RAM is plenty for tests.
        per_token = shape.kv_bytes_per_token(dtype_bytes) if shape else 64 * 1024
        kv = min(per_token * batch_tokens, max(per_token * max_len * 4, 1 << 30))
        kwargs["kv_cache_memory_bytes"] = kv
        reasons.append(f"KV cache {kv / 2**30:.2f} GiB of RAM (CPU build: sized in bytes)")
    return kwargs, reasons, train_awake


def capped_memory(free: int, total: int, fraction: float, reserved: int) -> tuple[int, int]:
    """(free, total) bytes as this process may use them, under `torch.cuda.set_per_process_memory_fraction`.

    A capped process (a shared GPU, or a bigger GPU standing in for a smaller one) must plan within
    its cap, not within the device: `total` becomes the cap and `free` what is left of it after what
    torch has already reserved.
    """
    if not 0 < fraction < 1:
        return free, total
    cap = int(fraction * total)
    return max(0, min(free, cap - reserved)), cap


class VLLMEngine:
    """vLLM serving base weights and LoRA adapters, in this process. Build with `await VLLMEngine.create(...)`."""

    _live = 0  # engines built and not closed, in this process

    def __init__(self, engine: Any, worker: ThreadPoolExecutor, tokenizer: Any, max_context: int,
                 on_cuda: bool, reasons: list[str], train_awake: bool = False) -> None:
        self._engine = engine
        self.train_awake = train_awake  # the backend skips sleep/wake around a step when True
        self._worker = worker
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.reasons = reasons
        self._on_cuda = on_cuda
        self._pending: dict[str, asyncio.Future[Any]] = {}
        self._driver: asyncio.Task[None] | None = None
        self._request_ids = itertools.count()
        self._lora_ids = itertools.count(1)  # vLLM reserves 0 for "no adapter"
        self._adapters: dict[str, Any] = {}  # name -> LoRARequest
        self._asleep = False
        self._dead: BaseException | None = None
        self._closed = False

    @classmethod
    async def create(cls, model_path: Path, config: ModelConfig, *, enforce_eager: bool | None = None) -> VLLMEngine:
        """Start vLLM for the model in `model_path` (a local directory). Takes ~1 min on a GPU.

        `enforce_eager=None` reads ART_NB_VLLM_ENFORCE_EAGER (no CUDA graphs / compile: starts
        ~40-60 s faster, decodes slower); the default is vLLM's compiled, graph-captured path.
        """
        import torch
        from transformers import AutoTokenizer

        from ..versions import check_versions

        for warning in check_versions("vllm"):
            _log.warning("%s", warning)
        on_cuda = torch.cuda.is_available()
        if on_cuda:  # memory a closed engine or trainer left in PyTorch's cache counts as free
            gc.collect()
            torch.cuda.empty_cache()
        kwargs, reasons, train_awake = _plan_engine(Path(model_path), config, on_cuda, enforce_eager, None)
        for reason in reasons:
            _log.info("vLLM: %s", reason)
        worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="art_nb-vllm")
        loop = asyncio.get_running_loop()
        try:
            engine = await loop.run_in_executor(worker, _build_engine, kwargs)
        except Exception as exc:
            worker.shutdown(wait=False)
            raise EngineError(f"vLLM could not start for {model_path}: {type(exc).__name__}: {exc}") from exc
        VLLMEngine._live += 1
        scheduler = getattr(getattr(engine, "vllm_config", None), "scheduler_config", None)
        if scheduler is not None:
            reasons.append(f"scheduler: up to {scheduler.max_num_seqs} sequences and {scheduler.max_num_batched_tokens} "
                           "tokens a step (vLLM's defaults for an in-process engine on this device)")
            _log.info("vLLM: %s", reasons[-1])
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(model_path))
        return cls(engine, worker, tokenizer, kwargs["max_model_len"], on_cuda, reasons, train_awake)

    # ---- generation ----------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> list[Sample]:
        self._check_alive()
        if self._asleep:  # the server's gate holds requests while a step trains; this is a caller bug
            raise EngineError("the engine is asleep (a train step holds the GPU); wake it before generating")
        params = request.params
        if not request.prompt_ids:
            raise EngineError("the prompt is empty")
        if len(request.prompt_ids) + params.max_tokens > self.max_context:
            raise ContextTooLongError(
                f"the prompt has {len(request.prompt_ids)} tokens and {params.max_tokens} more were asked, "
                f"but the engine holds {self.max_context} (ModelConfig.max_seq_len)"
            )
        lora = None
        if request.adapter is not None:
            lora = self._adapters.get(request.adapter)
            if lora is None:
                raise EngineError(f"adapter {request.adapter!r} is not loaded")
        from vllm.inputs import TokensPrompt

        request_id = f"art_nb-{next(self._request_ids)}"
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = done
        try:
            await self._call(
                self._engine.add_request, request_id, TokensPrompt(prompt_token_ids=list(request.prompt_ids)),
                _vllm_sampling_params(params), lora_request=lora,
            )
        except Exception as exc:
            self._pending.pop(request_id, None)
            raise _as_engine_error(exc, "vLLM rejected the request") from exc
        self._ensure_driver()
        try:
            output = await done
        except asyncio.CancelledError:  # the client went away: free the batch slot
            if self._pending.pop(request_id, None) is not None and self._dead is None:
                await self._call(self._engine.abort_request, [request_id])
            raise
        return [_to_sample(completion) for completion in sorted(output.outputs, key=lambda c: c.index)]

    def _ensure_driver(self) -> None:
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive(), name="art_nb-vllm-driver")

    async def _drive(self) -> None:
        """Step the engine while anything is pending, handing finished outputs to their waiters."""
        try:
            while self._pending:
                for output in await self._call(self._engine.step):
                    if output.finished:
                        waiter = self._pending.pop(output.request_id, None)
                        if waiter is not None and not waiter.done():
                            waiter.set_result(output)
        except Exception as exc:  # an exception out of step() leaves vLLM in an unknown state
            self._dead = exc
            _log.error("vLLM stopped: %s: %s", type(exc).__name__, exc)
            for waiter in self._pending.values():
                if not waiter.done():
                    waiter.set_exception(self._dead_error())
            self._pending.clear()

    async def _idle(self) -> None:
        """Wait until every accepted request has finished (the backend's gate admits no new ones)."""
        while self._driver is not None and not self._driver.done():
            await asyncio.shield(self._driver)

    # ---- adapters --------------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: Path) -> None:
        from vllm.lora.request import LoRARequest

        self._check_alive()
        if not (Path(path) / "adapter_config.json").is_file():
            raise EngineError(f"{path} holds no PEFT adapter (adapter_config.json is missing)")
        lora = LoRARequest(lora_name=name, lora_int_id=next(self._lora_ids), lora_path=str(path))
        try:
            added = await self._call(self._engine.add_lora, lora)
        except Exception as exc:
            raise _as_engine_error(exc, f"vLLM could not load the adapter in {path}") from exc
        if added is False:
            raise EngineError(f"vLLM refused the adapter in {path}")
        previous = self._adapters.get(name)
        self._adapters[name] = lora
        if previous is not None:
            await self._call(self._engine.remove_lora, previous.lora_int_id)

    async def unload_adapter(self, name: str) -> None:
        lora = self._adapters.pop(name, None)
        if lora is not None and self._dead is None:
            await self._call(self._engine.remove_lora, lora.lora_int_id)

    # ---- memory ----------------------------------------------------------------------------------

    async def sleep(self) -> None:
        """Free the KV cache and move the weights to CPU (vLLM sleep level 1). A no-op off CUDA."""
        self._check_alive()
        if not self._on_cuda or self._asleep:
            return
        await self._idle()
        await self._call(self._engine.sleep, 1)
        self._asleep = True

    async def wake(self) -> None:
        """Undo `sleep`; safe to call when awake (the backend calls it again in `finally`)."""
        if not self._asleep or self._dead is not None:
            return
        await self._call(self._engine.wake_up)
        self._asleep = False

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for waiter in self._pending.values():
            if not waiter.done():
                waiter.set_exception(EngineDeadError("the engine was closed"))
        self._pending.clear()
        if self._driver is not None:
            await asyncio.gather(self._driver, return_exceptions=True)
        shutdown = getattr(getattr(self._engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            try:
                await self._call(shutdown)
            except Exception as exc:  # closing must not fail on an engine that already died
                _log.warning("vLLM shutdown: %s: %s", type(exc).__name__, exc)
        self._engine = None
        VLLMEngine._live -= 1
        if VLLMEngine._live == 0:  # vLLM's distributed state is per process: only the last engine may drop it
            try:
                await self._call(_release_distributed_state)
            except Exception as exc:
                _log.warning("vLLM cleanup: %s: %s", type(exc).__name__, exc)
        self._worker.shutdown(wait=True)

    # ---- helpers ---------------------------------------------------------------------------------

    async def _call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run `fn` on the vLLM thread (after everything submitted before it)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, lambda: fn(*args, **kwargs))

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine was closed; register the model again to start a new one")
        if self._dead is not None:
            raise self._dead_error()

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(
            f"vLLM stopped ({type(self._dead).__name__}: {self._dead}); restart the kernel or register the model again"
        )


def _build_engine(kwargs: dict[str, Any]) -> Any:
    """Build the in-process LLMEngine (on the vLLM thread). The env var is read only while building."""
    previous = os.environ.get(_MP_ENV)
    os.environ[_MP_ENV] = "0"
    try:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        known = {f.name for f in dataclasses.fields(EngineArgs)}
        dropped = sorted(set(kwargs) - known)
        if dropped:  # an older vLLM without some knob: run with its default, and say so
            _log.warning("vLLM %s has no %s; using its defaults", _vllm_version(), ", ".join(dropped))
        from vllm.usage.usage_lib import UsageContext

        # LLM_CLASS, as `vllm.LLM` builds it: the scheduler defaults for an offline, in-process engine.
        # The from_engine_args default (ENGINE_CONTEXT) falls back to 128 sequences and 2048 tokens a
        # step: on an H200 that halved throughput at 256 concurrent requests and split every batched
        # prefill into 2048-token chunks (bench/results/h200/gpu_throughput.json, 2026-11-30).
        return LLMEngine.from_engine_args(EngineArgs(**{k: v for k, v in kwargs.items() if k in known}),
                                          usage_context=UsageContext.LLM_CLASS)
    finally:
        if previous is None:
            os.environ.pop(_MP_ENV, None)
        else:
            os.environ[_MP_ENV] = previous


def _vllm_version() -> str:
    from ..versions import installed_version

    return installed_version("vllm") or "?"


def _release_distributed_state() -> None:
    """Tear down vLLM's process-wide state (torch.distributed group, caches) so a later engine can start."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def _vllm_sampling_params(params: SamplingParams) -> Any:
    from vllm.sampling_params import RequestOutputKind
    from vllm.sampling_params import SamplingParams as VllmSamplingParams

    return VllmSamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        max_tokens=params.max_tokens,
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        seed=params.seed,
        ignore_eos=params.ignore_eos,
        logprobs=0,  # the sampled token's own logprob, nothing more
        output_kind=RequestOutputKind.FINAL_ONLY,
        detokenize=bool(params.stop),  # text is only needed to match stop strings; the server decodes
    )


def _to_sample(completion: Any) -> Sample:
    token_ids = [int(t) for t in completion.token_ids]
    if completion.finish_reason not in ("stop", "length"):
        raise EngineError(f"vLLM ended the sequence with finish_reason={completion.finish_reason!r}")
    if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
        raise EngineError("vLLM returned no logprob for some sampled tokens")
    logprobs = [float(position[token].logprob) for position, token in zip(completion.logprobs, token_ids, strict=True)]
    return Sample(token_ids=token_ids, logprobs=logprobs, finish_reason=completion.finish_reason)


def _as_engine_error(exc: Exception, what: str) -> EngineError:
    if isinstance(exc, EngineError):
        return exc
    try:
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDeadError
    except ImportError:  # pragma: no cover - every supported vLLM has it
        VllmDeadError = ()  # type: ignore[assignment]  # noqa: N806
    if isinstance(exc, VllmDeadError):
        return EngineDeadError(f"{what}: the vLLM engine died")
    return EngineError(f"{what}: {type(exc).__name__}: {exc}")


def _max_positions(model_path: Path) -> int | None:
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("text_config", config).get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None
