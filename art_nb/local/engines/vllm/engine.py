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
- that thread (`thread.VLLMThread`) loops `step()` itself while requests are unfinished and
  runs what was submitted between two steps: requests that arrive mid-batch join the running batch
  (continuous batching, as in vLLM's own server), with no thread hop per step; finished outputs go
  back to each waiter's event loop in one hop per step.

Sampling returns the sampled token ids and their raw logprobs (`logprobs_mode="raw_logprobs"`:
the model's distribution before temperature/top-p, which is what the trainer recomputes). Each
`load_adapter` gets a fresh LoRA integer id and a vLLM-side name made unique with it, because vLLM
caches adapters by id and prefix-cache blocks by LoRA name (0.25; name and path in 0.32): reusing
either for new weights would serve KV computed with the old ones. A train step hands its
adapter over in memory (`load_adapter(..., weights=)`): vLLM builds it from those tensors
(`lora.py`) and never reads the directory, where the checkpoint lands later in the background.

Around a train step the engine arranges its own memory (`train_with`): it sleeps (level 1: KV
cache freed, weights to CPU) unless the memory plan (`args.engine_args`) says training fits
beside it awake, and falls back to sleeping for good after the first out-of-memory error there.
The backend never sees a sleep call or a CUDA error type.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import logging
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from art_nb.config import ModelConfig
from art_nb.utils.progress import library_bars

from ..base import (
    AdapterWeights,
    ContextTooLongError,
    EngineDeadError,
    EngineError,
    GenerationRequest,
    Sample,
    SamplingParams,
)
from .args import VLLMSetup, capped_memory, engine_args
from .grammar import structured_outputs, with_config_objects
from .lora import install, spill
from .thread import VLLMThread

if TYPE_CHECKING:
    from art_nb.local.plan.choices import Plan

__all__ = ["VLLMEngine", "VLLMSetup", "capped_memory", "engine_args"]

_log = logging.getLogger("art_nb")
_T = TypeVar("_T")
_MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


class VLLMEngine:
    """vLLM serving base weights and LoRA adapters, in this process. Build with `await VLLMEngine.create(...)`."""

    _live = 0  # engines built and not closed, in this process

    def __init__(self, engine: Any, thread: VLLMThread, tokenizer: Any, max_context: int,
                 on_cuda: bool, reasons: list[str], train_awake: bool = False) -> None:
        self._engine = engine
        # The memory plan's answer: training fits beside the awake engine. Turned off for good by
        # the first out-of-memory error while training beside it (`train_with`).
        self._train_awake = train_awake
        self._thread = thread
        # Looked up on every step, not bound once: a benchmark may wrap `engine.step` to time it.
        thread.attach(lambda: engine.step(), dead=self._error_if_dead, died=self._died)
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.reasons = reasons
        self._on_cuda = on_cuda
        self._request_ids = itertools.count()
        self._lora_ids = itertools.count(1)  # vLLM reserves 0 for "no adapter"
        self._adapters: dict[str, Any] = {}  # name -> LoRARequest
        self._held: dict[int, AdapterWeights] = {}  # LoRA id -> weights vLLM builds it from (lora.py)
        self._spilled: dict[int, Path] = {}  # LoRA id -> temporary directory, where memory cannot be used
        self._from_memory: bool | None = None  # whether vLLM takes adapters from memory; None: not tried yet
        self._asleep = False
        self._dead: BaseException | None = None
        self._closed = False

    @classmethod
    async def create(cls, model_path: Path, config: ModelConfig, plan: Plan | None = None, *,
                     enforce_eager: bool | None = None) -> VLLMEngine:
        """Start vLLM for the model in `model_path` (a local directory). Takes ~1 min on a GPU.

        `plan` (`plan_for(config)` when None) gives the device and the dtype, which the trainer
        shares. `enforce_eager=True` forces the "eager" start-up; otherwise the mode
        comes from ART_NB_VLLM_STARTUP, ART_NB_VLLM_ENFORCE_EAGER or `config.vllm_startup`, by default
        "fast" (CUDA graphs for decoding, no torch.compile: engines/startup.py says why).
        """
        from transformers import AutoTokenizer

        from art_nb.local.plan.choices import plan_for
        from art_nb.local.plan.versions import check_versions

        plan = plan or plan_for(config)
        for warning in check_versions("vllm"):
            _log.warning("%s", warning)
        on_cuda = plan.device == "cuda"
        if on_cuda:  # memory a closed engine or trainer left in PyTorch's cache counts as free
            import torch

            gc.collect()
            torch.cuda.empty_cache()
        setup = engine_args(Path(model_path), config, on_cuda, enforce_eager, dtype=plan.dtype)
        reasons = list(setup.reasons)
        for reason in reasons:
            _log.info("vLLM: %s", reason)
        thread = VLLMThread()
        reasons.extend(thread.reasons())
        try:
            # vLLM's load and CUDA-graph bars: notebook widgets, which a quiet register cannot send to its log
            engine = await thread.call(_build_engine, {**setup.kwargs, "use_tqdm_on_load": library_bars()})
        except Exception as exc:
            thread.stop()
            raise EngineError(f"vLLM could not start for {model_path}: {type(exc).__name__}: {exc}") from exc
        VLLMEngine._live += 1
        # third-party: vLLM releases moved the scheduler config around
        scheduler = getattr(getattr(engine, "vllm_config", None), "scheduler_config", None)
        if scheduler is not None:
            reasons.append(f"scheduler: up to {scheduler.max_num_seqs} sequences and {scheduler.max_num_batched_tokens} "
                           "tokens a step (vLLM's defaults for an in-process engine on this device)")
            _log.info("vLLM: %s", reasons[-1])
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(model_path))
        return cls(engine, thread, tokenizer, setup.kwargs["max_model_len"], on_cuda, reasons, setup.train_awake)

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving, or None while it serves."""
        if self._dead is not None:
            return f"vLLM stopped ({type(self._dead).__name__}: {self._dead})"
        if self._closed:
            return "the engine was closed"
        return None

    @property
    def serves_while_training(self) -> bool:  # awake as the memory plan said, until an out-of-memory error there
        return not self._on_cuda or self._train_awake

    async def train_with(self, step: Callable[[], Awaitable[_T]], hold: Callable[[], Awaitable[None]] | None = None) -> _T:
        """Sleep unless the memory plan keeps vLLM awake for training, run `step()`, wake.

        Out of GPU memory beside the awake engine, the plan was wrong for this batch: sleep, run
        `step()` again (exact: the trainer raised before its optimizer stepped, and emptied the
        allocator's cache on the way out) and sleep for every later step. Each sleep `hold()`s first.
        """
        import torch  # loaded with vLLM already; here for its out-of-memory error

        awake = self._train_awake
        try:
            if not awake:
                await self.sleep(hold)
            try:
                return await step()
            except torch.OutOfMemoryError as error:
                if not awake:
                    raise
                _log.warning("training ran out of GPU memory beside an awake vLLM (%s); vLLM sleeps for "
                             "training from now on", str(error).splitlines()[0][:200])
                self._train_awake = False
                await self.sleep(hold)
                return await step()
        finally:
            await self.wake()

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

        engine = self._engine
        request_id = f"art_nb-{next(self._request_ids)}"
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
        sampling = _vllm_sampling_params(params)
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._thread.add(request_id, lambda: engine.add_request(request_id, prompt, sampling, lora_request=lora), done)
        try:
            output = await done
        except asyncio.CancelledError:  # the client went away: free the batch slot
            self._thread.abort(request_id, engine.abort_request)
            raise
        except Exception as exc:
            raise self._failed(exc, "vLLM rejected the request") from exc
        return [_to_sample(completion, params.top_logprobs) for completion in sorted(output.outputs, key=lambda c: c.index)]

    # ---- adapters --------------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: Path, weights: AdapterWeights | None = None) -> None:
        from vllm.lora.request import LoRARequest

        self._check_alive()
        lora_id = next(self._lora_ids)
        source = str(path)
        if weights is None:
            if not (Path(path) / "adapter_config.json").is_file():
                raise EngineError(f"{path} holds no PEFT adapter (adapter_config.json is missing)")
        elif await self._takes_memory():
            self._held[lora_id] = weights  # before add_lora: the worker's loader looks it up by id
            source = f"memory (for {path})"
        else:
            self._spilled[lora_id] = await asyncio.to_thread(spill, weights)
        # From memory the path is never read (the loader finds the id in `_held`); the name carries the id (docstring)
        lora = LoRARequest(lora_name=f"{name}#{lora_id}", lora_int_id=lora_id,
                           lora_path=str(self._spilled.get(lora_id, path)))
        try:
            added = await self._call(self._engine.add_lora, lora)
        except Exception as exc:
            self._forget(lora_id)
            raise self._failed(exc, f"vLLM could not load the adapter from {source}") from exc
        if added is False:
            self._forget(lora_id)
            raise EngineError(f"vLLM refused the adapter from {source}")
        previous = self._adapters.get(name)
        self._adapters[name] = lora
        if previous is not None:
            await self._remove(previous.lora_int_id)

    async def unload_adapter(self, name: str) -> None:
        lora = self._adapters.pop(name, None)
        if lora is not None:
            await self._remove(lora.lora_int_id)

    async def _remove(self, lora_id: int) -> None:
        """Drop the LoRA from vLLM, then its in-memory copy (vLLM may re-load it by id until it is removed)."""
        try:
            if self.dead_reason is None:
                await self._call(self._engine.remove_lora, lora_id)
        finally:
            self._forget(lora_id)

    def _forget(self, lora_id: int) -> None:
        self._held.pop(lora_id, None)
        spilled = self._spilled.pop(lora_id, None)
        if spilled is not None:
            shutil.rmtree(spilled, ignore_errors=True)

    async def _takes_memory(self) -> bool:
        """Install the in-memory loader on vLLM's worker the first time; False (and why, logged) where it cannot be."""
        if self._from_memory is None:
            try:
                await self._call(install, self._engine, self._held, _vllm_version())
                self._from_memory = True
            except EngineError as error:
                _log.warning("%s", error)
                self._from_memory = False
        return self._from_memory

    # ---- memory ----------------------------------------------------------------------------------

    async def sleep(self, hold: Callable[[], Awaitable[None]] | None = None) -> None:
        """Free the KV cache and move the weights to CPU (vLLM sleep level 1). A no-op off CUDA.

        Runs once every accepted request has finished (the backend's gate admits no new ones: `hold()`)."""
        self._check_alive()
        if not self._on_cuda or self._asleep:
            return
        if hold is not None:  # requests beside a step (a pipeline's) finish; later ones wait at the gate
            await hold()
        self._asleep = True  # refuse new requests now: one queued behind the sleep would run on a sleeping engine
        try:
            await self._call(self._engine.sleep, 1, when_idle=True)
        except BaseException:
            self._asleep = False
            raise

    async def wake(self) -> None:
        """Undo `sleep`; safe to call when awake (the backend calls it again in `finally`)."""
        if not self._asleep or self.dead_reason is not None:
            return
        await self._call(self._engine.wake_up)
        self._asleep = False

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True  # from here the vLLM thread fails every waiter and steps no more
        VLLMEngine._live -= 1
        try:
            await self._call(_shut_down, self._engine, VLLMEngine._live == 0)
        finally:
            self._engine = None
            self._thread.stop()
            await asyncio.to_thread(self._thread.join)
            for lora_id in list(self._spilled):
                self._forget(lora_id)
            self._held.clear()

    # ---- helpers ---------------------------------------------------------------------------------

    async def _call(self, fn: Callable[..., _T], *args: Any, when_idle: bool = False) -> _T:
        """Run `fn` on the vLLM thread (after everything submitted before it; `when_idle`: once no request is open)."""
        return await self._thread.call(fn, *args, when_idle=when_idle)

    def _died(self, exc: BaseException) -> None:
        """vLLM failed in a way that leaves it in an unknown state: serve no more (the vLLM thread fails its waiters)."""
        if self._dead is None:
            self._dead = exc
            _log.error("vLLM stopped: %s: %s", type(exc).__name__, exc)

    def _error_if_dead(self) -> EngineDeadError | None:
        return self._dead_error() if self.dead_reason is not None else None

    def _failed(self, exc: Exception, what: str) -> EngineError:
        """`exc` from a vLLM call as our error. vLLM's own dead-engine error makes this engine dead too."""
        if isinstance(exc, EngineError):
            return exc
        if _vllm_says_dead(exc):
            self._died(exc)
            return self._dead_error()
        return EngineError(f"{what}: {type(exc).__name__}: {exc}")

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise self._dead_error()

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"{self.dead_reason}; re-register the model to start a new engine")


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
        # step, which halves throughput at 256 concurrent requests (bench/gpu_throughput.py measures it).
        known_kwargs = with_config_objects({k: v for k, v in kwargs.items() if k in known})
        return LLMEngine.from_engine_args(EngineArgs(**known_kwargs),
                                          usage_context=UsageContext.LLM_CLASS)
    finally:
        if previous is None:
            os.environ.pop(_MP_ENV, None)
        else:
            os.environ[_MP_ENV] = previous


def _shut_down(engine: Any, last: bool) -> None:
    """Stop vLLM's in-process core (on the vLLM thread); the last engine of the process also drops vLLM's
    process-wide distributed state, so a later engine can start. Never raises: closing a dead engine must work."""
    # third-party: not every vLLM release's in-process core has shutdown()
    shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
    for what, step in (("shutdown", shutdown), ("cleanup", _release_distributed_state if last else None)):
        if step is None:
            continue
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - closing must work on an engine that already died
            _log.warning("vLLM %s: %s: %s", what, type(exc).__name__, exc)


def _vllm_version() -> str:
    from art_nb.local.plan.versions import installed_version

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
        logprobs=params.top_logprobs,  # 0: the sampled token's own logprob, nothing more; k: the top k beside it
        output_kind=RequestOutputKind.FINAL_ONLY,
        detokenize=bool(params.stop),  # text is only needed to match stop strings; the server decodes
        structured_outputs=structured_outputs(params.grammar),  # JSON formats, forced tool calls (grammar.py)
    )


def _to_sample(completion: Any, top_logprobs: int = 0) -> Sample:
    token_ids = [int(t) for t in completion.token_ids]
    if completion.finish_reason not in ("stop", "length"):
        raise EngineError(f"vLLM ended the sequence with finish_reason={completion.finish_reason!r}")
    if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
        raise EngineError("vLLM returned no logprob for some sampled tokens")
    logprobs = [float(position[token].logprob) for position, token in zip(completion.logprobs, token_ids, strict=True)]
    top = None
    if top_logprobs:  # each position holds the top k (rank 1..k) and the sampled token, whatever its rank
        top = [[(int(token), float(entry.logprob)) for token, entry in sorted(position.items(), key=lambda kv: kv[1].rank)
                if entry.rank <= top_logprobs][:top_logprobs] for position in completion.logprobs]
    return Sample(token_ids=token_ids, logprobs=logprobs, finish_reason=completion.finish_reason, top_logprobs=top)


def _vllm_says_dead(exc: Exception) -> bool:
    try:
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDeadError
    except ImportError:  # pragma: no cover - every supported vLLM has it
        return False
    return isinstance(exc, VllmDeadError)
