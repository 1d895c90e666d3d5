"""`HFEngine`: the transformers engine (CPU or CUDA) with continuous batching and LoRA adapters.

Concurrent `generate` calls share forward passes. Each call becomes `n` rows in a FIFO queue; one
scheduler task, on the event loop, repeatedly hands the model thread a list of rows to admit and
advances every live row by one token. Admitted rows are prefilled (identical prompts once, then the
cache is copied per row), left-padded to the running batch's cache length and joined to it, so a
rollout's next turn starts decoding within a step instead of waiting for the batch to drain. Rows
that finish leave the batch at once and their request is answered as soon as its last row is done.

All model work (forwards, adapter loads and deletes, device moves) runs on one worker thread, so it
is serialized without locks and the event loop stays free for the server and the rollouts. A call
into that thread that does not return within `stall_timeout` seconds (a hung device, a deadlock)
marks the engine dead: every waiting request fails at once with `EngineDeadError` (HTTP 503 with the
reason) instead of hanging, and registering the model again starts a new engine.

A batch decodes under one adapter. Admission is FIFO: when the head of the queue wants another
adapter, nothing more is admitted until the running batch drains, so no adapter starves. A request
is served entirely by the weights its adapter name pointed to when it was submitted: loading a new
adapter under an existing name, or unloading one, retires the old weights only after the requests
that use them have finished.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import logging
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer

from art_nb._threads import choose_cpu_threads
from art_nb.config import ModelConfig
from art_nb.engines.base import (
    ContextTooLongError,
    EngineDeadError,
    EngineError,
    GenerationRequest,
    Sample,
    SamplingParams,
)

__all__ = ["EngineStats", "HFEngine"]

logger = logging.getLogger("art_nb")
T = TypeVar("T")

# Padded prompt tokens per prefill forward: bounds activation memory when many long prompts arrive at once.
_PREFILL_TOKENS = 8192
# Extra tokens decoded around a stop string's length when checking the tail (byte-level BPE splits characters).
_STOP_WINDOW_SLACK = 4


@dataclass
class EngineStats:
    """Counters that show whether requests were batched."""

    batches: int = 0  # admission rounds: rows prefilled together and joined to the decode batch
    steps: int = 0  # forwards that advanced every live row by one token
    max_batch_size: int = 0  # most rows advanced by a single forward
    tokens: int = 0  # tokens sampled


@dataclass(eq=False)
class _Job:
    """One `generate` call: its future and the samples collected so far."""

    future: asyncio.Future[list[Sample]]
    samples: list[Sample | None]
    adapter: str | None  # internal peft adapter name, fixed at submission
    abandoned: bool = False  # the caller stopped waiting (answered, failed or cancelled)


@dataclass(eq=False)
class _Row:
    """One sequence being sampled for a job."""

    job: _Job
    index: int
    prompt: tuple[int, ...]
    params: SamplingParams
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None


@dataclass
class _Batch:
    """Rows decoding together: a left-padded KV cache and, per row, the next input token and its position."""

    rows: list[_Row] = field(default_factory=list)
    adapter: str | None = None
    cache: DynamicCache | None = None
    mask: torch.Tensor | None = None  # [rows, cache length], 1 where the cache holds a real token
    next_tokens: torch.Tensor | None = None  # [rows], sampled but not yet fed to the model
    positions: torch.Tensor | None = None  # [rows], position id of next_tokens


class HFEngine:
    """The `Engine` protocol over a transformers causal LM, with peft adapters. Create with `await HFEngine.create(...)`."""

    # Seconds one call into the model thread (a forward, an adapter load) may take before the engine is
    # declared dead. Generous: a long prefill of a larger model on CPU stays well inside it.
    stall_timeout: float = 300.0

    def __init__(self, model: Any, tokenizer: Any, config: ModelConfig, device: torch.device, threads: int) -> None:
        self._model = model
        self.tokenizer = tokenizer
        self._device = device
        window = getattr(model.config, "max_position_embeddings", None) or config.max_seq_len
        self.max_context: int = min(config.max_seq_len, window)
        self._max_rows = config.max_batch_size
        self._vocab = model.get_input_embeddings().num_embeddings
        self._eos_ids = _eos_ids(tokenizer, model)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self._eos_ids, default=0)
        self._shared_generator = torch.Generator(device=device).manual_seed(config.seed)
        # transformers renamed `past_key_values` to `cache` (5.x); pass whichever this version takes.
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.stats = EngineStats()

        self._executor = ThreadPoolExecutor(1, "art_nb-hf", initializer=torch.set_num_threads, initargs=(threads,))
        self._pending: deque[_Row] = deque()
        self._batch = _Batch()
        self._wakeup = asyncio.Event()
        self._drained = asyncio.Event()
        self._paused = False
        self._dead: str | None = None
        self._adapters: dict[str, str] = {}  # public name -> internal peft name
        self._refs: Counter[str] = Counter()  # internal name -> jobs using it
        self._retired: set[str] = set()  # unloaded or replaced; delete when unused
        self._adapter_ids = itertools.count()
        self._scheduler = asyncio.get_running_loop().create_task(self._schedule(), name="art_nb-hf-scheduler")
        self._scheduler.add_done_callback(self._on_scheduler_exit)

    @classmethod
    async def create(cls, model_path: str | Path, config: ModelConfig, device: str | torch.device | None = None) -> HFEngine:
        """Load the model and tokenizer off the event loop and start the scheduler."""
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        threads = torch.get_num_threads()
        if dev.type == "cpu":
            threads, reason = choose_cpu_threads(config.cpu_threads)
            torch.set_num_threads(threads)
            logger.info("HF engine: %d torch thread(s): %s", threads, reason)
        dtype, reason = _choose_dtype(config.dtype, dev)
        logger.info("HF engine: %s on %s: %s", dtype, dev, reason)
        model, tokenizer = await asyncio.to_thread(_load, Path(model_path), dtype, dev)
        return cls(model, tokenizer, config, dev, threads)

    # ---- the Engine protocol -------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> list[Sample]:
        """`request.params.n` samples for one prompt, decoded in the shared batch."""
        self._check_alive()
        params, prompt = request.params, tuple(request.prompt_ids)
        if params.n < 1 or params.max_tokens < 1:
            raise EngineError(f"n and max_tokens must be at least 1 (got n={params.n}, max_tokens={params.max_tokens})")
        if not prompt:
            raise EngineError("the prompt has no tokens")
        if len(prompt) + params.max_tokens > self.max_context:
            raise ContextTooLongError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
                f"{self.max_context} tokens; shorten the conversation or lower max_tokens"
            )
        if not all(0 <= t < self._vocab for t in prompt):
            raise EngineError(f"prompt has token ids outside the vocabulary [0, {self._vocab})")
        adapter = self._adapter_for(request.adapter)

        job = _Job(asyncio.get_running_loop().create_future(), [None] * params.n, adapter)
        if adapter is not None:
            self._refs[adapter] += 1
        job.future.add_done_callback(functools.partial(self._on_job_done, job))
        for i in range(params.n):
            self._pending.append(_Row(job, i, prompt, params, self._row_generator(params.seed, i)))
        self._wakeup.set()
        return await job.future

    async def load_adapter(self, name: str, path: Path) -> None:
        """Load the PEFT adapter in `path` as `name`; requests already submitted keep their weights."""
        self._check_alive()
        path = Path(path)
        if not (path / "adapter_config.json").is_file():
            raise EngineError(f"{path} is not a PEFT adapter directory (no adapter_config.json)")
        internal = f"adapter_{next(self._adapter_ids)}"
        await self._in_worker(self._load_peft, internal, path)
        previous, self._adapters[name] = self._adapters.get(name), internal
        logger.info("HF engine: adapter %s loaded", name)
        logger.debug("HF engine: adapter %s read from %s", name, path)
        if previous is not None:
            self._retire(previous)

    async def unload_adapter(self, name: str) -> None:
        self._check_alive()
        internal = self._adapters.pop(name, None)
        if internal is None:
            raise EngineError(f"no adapter named {name!r}; loaded: {sorted(self._adapters) or 'none'}")
        self._retire(internal)
        doomed = self._take_doomed()
        if doomed:
            await self._in_worker(self._delete_adapters, doomed)

    async def sleep(self) -> None:
        """On CUDA: finish the running rows, hold new ones, move the weights to CPU. A no-op on CPU."""
        if self._device.type != "cuda" or self._paused:
            return
        self._check_alive()
        self._paused = True
        self._drained.clear()
        self._wakeup.set()
        await self._drained.wait()  # set by the scheduler once no row is live and no forward is in flight
        self._check_alive()
        await self._in_worker(self._move, torch.device("cpu"))

    async def wake(self) -> None:
        if not self._paused:
            return
        await self._in_worker(self._move, self._device)
        self._paused = False
        self._wakeup.set()

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving (closed, crashed, stalled), or None while it serves."""
        return self._dead

    async def close(self) -> None:
        """Stop the scheduler and fail every waiting request with `EngineDeadError`."""
        if self._dead is None:
            self._dead = "the engine was closed"
        self._scheduler.cancel()
        await asyncio.gather(self._scheduler, return_exceptions=True)
        self._fail_all(self._dead_error())
        self._drained.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._model = None  # the weights go once an in-flight forward returns, even if this object lingers

    # ---- scheduling (event loop) ------------------------------------------------------------------

    async def _schedule(self) -> None:
        while self._dead is None:
            doomed = self._take_doomed()
            if doomed:
                try:
                    await self._in_worker(self._delete_adapters, doomed)
                except Exception:  # a failed delete leaks an adapter's memory; serving goes on
                    logger.exception("HF engine: deleting adapters %s failed", doomed)
            if not self._batch.rows and (self._paused or not self._pending):
                self._drained.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                await asyncio.sleep(0)  # let requests submitted in the same tick join this admission
                continue
            admit = self._admissible()
            try:
                finished = await self._in_worker(self._advance, admit)
            except EngineDeadError:  # the worker stalled: every request has been failed already
                for row in admit:
                    _settle(row.job, exc=self._dead_error())
                return
            except Exception as exc:  # a failed forward fails its rows, not the engine
                logger.exception("HF engine: batch failed")
                failed = {row.job for row in [*self._batch.rows, *admit]}
                self._batch = _Batch()
                for job in failed:
                    _settle(job, exc=EngineError(f"generation failed: {type(exc).__name__}: {exc}"))
                continue
            for row in finished:
                self._deliver(row)

    def _admissible(self) -> list[_Row]:
        """Rows from the head of the queue that can join the running batch now (same adapter, free room)."""
        if self._paused:
            return []
        room = self._max_rows - len(self._batch.rows)
        adapter = self._batch.adapter if self._batch.rows else None
        taken: list[_Row] = []
        while self._pending and room > 0:
            row = self._pending[0]
            if row.job.abandoned:
                self._pending.popleft()
                continue
            if taken or self._batch.rows:
                if row.job.adapter != adapter:
                    break
            else:
                adapter = row.job.adapter
            taken.append(self._pending.popleft())
            room -= 1
        if taken:
            self.stats.batches += 1
        return taken

    def _deliver(self, row: _Row) -> None:
        job = row.job
        if job.abandoned:
            return
        job.samples[row.index] = Sample(list(row.tokens), list(row.logprobs), row.finish)  # type: ignore[arg-type]
        if all(s is not None for s in job.samples):
            _settle(job, result=job.samples)

    def _adapter_for(self, name: str | None) -> str | None:
        if name is None:
            return None
        if name not in self._adapters:
            raise EngineError(f"no adapter named {name!r}; loaded: {sorted(self._adapters) or 'none'}")
        return self._adapters[name]

    def _row_generator(self, seed: int | None, index: int) -> torch.Generator | None:
        """A private generator for seeded requests, so their samples do not depend on batch neighbours."""
        if seed is None:
            return None
        return torch.Generator(device=self._device).manual_seed((seed * 1_000_003 + index) % 2**63)

    def _on_job_done(self, job: _Job, _future: asyncio.Future[list[Sample]]) -> None:
        job.abandoned = True
        if job.adapter is not None:
            self._refs[job.adapter] -= 1
            if self._refs[job.adapter] <= 0 and job.adapter in self._retired:
                self._wakeup.set()  # the scheduler's next call deletes it

    def _retire(self, internal: str) -> None:
        self._retired.add(internal)
        self._wakeup.set()

    def _take_doomed(self) -> list[str]:
        """Retired adapters no submitted request uses any more; the caller deletes them in the worker."""
        doomed = [a for a in self._retired if self._refs[a] <= 0]
        for internal in doomed:
            self._retired.discard(internal)
            self._refs.pop(internal, None)
        return doomed

    def _on_scheduler_exit(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self._dead = f"the scheduler crashed: {task.exception()!r}"
        logger.error("HF engine: %s", self._dead)
        self._fail_all(self._dead_error())

    def _fail_all(self, exc: EngineError) -> None:
        for row in [*self._pending, *self._batch.rows]:
            _settle(row.job, exc=exc)
        self._pending.clear()
        self._batch = _Batch()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead_error()

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"{self._dead}; re-register the model to start a new engine")

    async def _in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        future = asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))
        try:
            return await asyncio.wait_for(future, self.stall_timeout)
        except TimeoutError:
            name = getattr(fn, "__name__", "model work").lstrip("_")
            self._stalled(f"the engine stopped answering: {name} ran for more than {self.stall_timeout:g} s")
            raise self._dead_error() from None

    def _stalled(self, reason: str) -> None:
        """The model thread is stuck: fail everything now; the thread cannot be stopped, only abandoned."""
        if self._dead is None:
            self._dead = reason
        logger.error("HF engine: %s", self._dead)
        self._fail_all(self._dead_error())
        self._drained.set()
        self._wakeup.set()

    # ---- model work (worker thread) ---------------------------------------------------------------

    @torch.inference_mode()
    def _advance(self, admit: list[_Row]) -> list[_Row]:
        """Admit `admit`, advance every live row by one token, return the rows that finished."""
        batch = self._batch
        batch_rows = [r for r in batch.rows if not r.job.abandoned]
        if len(batch_rows) != len(batch.rows):
            self._keep(batch_rows)
        if admit:
            if not batch.rows:
                batch.adapter = admit[0].job.adapter
            for chunk in _prefill_chunks(admit):
                self._prefill(chunk)
        if not batch.rows:
            return []
        done = [r for r in batch.rows if r.finish is not None]
        if done:  # finished during prefill (max_tokens=1, or a stop token first)
            self._keep([r for r in batch.rows if r.finish is None])
        if batch.rows:
            self._step()
        finished = [r for r in batch.rows if r.finish is not None]
        if finished:
            self._keep([r for r in batch.rows if r.finish is None])
        return done + finished

    def _prefill(self, rows: list[_Row]) -> None:
        """Run the distinct prompts of `rows`, copy each prompt's cache per row, sample, join the batch."""
        prompts = list(dict.fromkeys(r.prompt for r in rows))
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self._device), mask.to(self._device)
        cache = DynamicCache()
        logits = self._forward(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache)
        _check_full_attention(cache)

        which = torch.tensor([prompts.index(r.prompt) for r in rows], device=self._device)
        cache.batch_select_indices(which)
        mask, logits = mask[which], logits[which]
        tokens = self._sample_and_record(logits, rows)
        self._join(rows, cache, mask, tokens, positions=mask.sum(-1))

    def _step(self) -> None:
        batch = self._batch
        mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=1)
        logits = self._forward(batch.next_tokens[:, None], mask, batch.positions[:, None], batch.cache)
        batch.mask, batch.positions = mask, batch.positions + 1
        batch.next_tokens = self._sample_and_record(logits, batch.rows)
        self.stats.steps += 1

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Last-position logits in float32, under the batch's adapter (base weights when it has none)."""
        self.stats.max_batch_size = max(self.stats.max_batch_size, ids.shape[0])
        kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "use_cache": True, "logits_to_keep": 1}
        kwargs[self._cache_kwarg] = cache
        adapter = self._batch.adapter
        if adapter is None and _is_peft(self._model):
            with self._model.disable_adapter():
                out = self._model(**kwargs)
        else:
            if adapter is not None and self._model.active_adapter != adapter:
                self._model.set_adapter(adapter)
            out = self._model(**kwargs)
        return out.logits[:, -1].float()

    def _sample_and_record(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        tokens, logprobs = sample_tokens(logits, [r.params for r in rows], [r.generator for r in rows], self._shared_generator)
        for row, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist()):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.finish = self._finish_reason(row, token)
        self.stats.tokens += len(rows)
        return tokens

    def _finish_reason(self, row: _Row, token: int) -> str | None:
        params = row.params
        if token in params.stop_token_ids or (token in self._eos_ids and not params.ignore_eos):
            return "stop"
        if params.stop:
            window = max(len(s) for s in params.stop) + _STOP_WINDOW_SLACK
            tail = self.tokenizer.decode(row.tokens[-window:], skip_special_tokens=True)
            if any(s in tail for s in params.stop):
                return "stop"
        if len(row.tokens) >= params.max_tokens:
            return "length"
        return None

    def _join(self, rows: list[_Row], cache: DynamicCache, mask: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Append freshly prefilled rows to the batch, left-padding whichever cache is shorter."""
        batch = self._batch
        if not batch.rows:
            batch.rows, batch.cache, batch.mask, batch.next_tokens, batch.positions = list(rows), cache, mask, tokens, positions
            return
        width = max(batch.mask.shape[1], mask.shape[1])
        for old, new in zip(batch.cache.layers, cache.layers):
            old.keys = torch.cat([_left_pad(old.keys, width, 2), _left_pad(new.keys, width, 2)])
            old.values = torch.cat([_left_pad(old.values, width, 2), _left_pad(new.values, width, 2)])
        batch.mask = torch.cat([_left_pad(batch.mask, width, 1), _left_pad(mask, width, 1)])
        batch.next_tokens = torch.cat([batch.next_tokens, tokens])
        batch.positions = torch.cat([batch.positions, positions])
        batch.rows = [*batch.rows, *rows]

    def _keep(self, rows: list[_Row]) -> None:
        """Shrink the batch to `rows` (a subset, in order) and drop cache columns no row needs."""
        batch = self._batch
        if not rows:  # in place: `_advance` holds a reference to this batch
            batch.rows, batch.cache, batch.mask, batch.next_tokens, batch.positions = [], None, None, None, None
            return
        index = {id(r): i for i, r in enumerate(batch.rows)}
        keep = torch.tensor([index[id(r)] for r in rows], device=self._device)
        batch.cache.batch_select_indices(keep)
        batch.mask, batch.next_tokens, batch.positions = batch.mask[keep], batch.next_tokens[keep], batch.positions[keep]
        batch.rows = list(rows)
        unused = int((batch.mask.sum(0) == 0).long().cumprod(0).sum())  # leading all-padding columns
        if unused:
            batch.mask = batch.mask[:, unused:]
            for layer in batch.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, unused:], layer.values[:, :, unused:]

    def _load_peft(self, internal: str, path: Path) -> None:
        from peft import PeftModel

        with torch.no_grad():
            if _is_peft(self._model):
                self._model.load_adapter(str(path), adapter_name=internal, is_trainable=False)
            else:
                self._model = PeftModel.from_pretrained(self._model, str(path), adapter_name=internal, is_trainable=False)
            self._model.to(self._device).eval()

    def _delete_adapters(self, internals: list[str]) -> None:
        for internal in internals:
            remaining = [a for a in self._model.peft_config if a != internal]
            if not remaining:  # peft cannot run with zero adapters: take the LoRA layers out entirely
                self._model = self._model.unload()
                continue
            if self._model.active_adapter == internal:
                self._model.set_adapter(remaining[0])
            self._model.delete_adapter(internal)

    def _move(self, device: torch.device) -> None:
        self._model.to(device)
        if device.type == "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()


# ---- pure helpers ------------------------------------------------------------------------------------


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    shared: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row with that row's temperature (0 = greedy) and top_p, and its logprob under
    the unscaled (temperature 1) distribution. Sampling uses the exponential race
    (argmax p/E, E ~ Exp(1)), so each row draws its noise from its own generator if it has one."""
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    hot = [i for i, p in enumerate(params) if p.temperature > 0]
    if hot:
        index = torch.tensor(hot, device=logits.device)
        temperature = torch.tensor([params[i].temperature for i in hot], device=logits.device, dtype=logits.dtype)
        top_p = torch.tensor([params[i].top_p for i in hot], device=logits.device, dtype=logits.dtype)
        probs = _top_p(torch.softmax(logits[index] / temperature[:, None], dim=-1), top_p)
        noise = torch.empty_like(probs)
        for j, i in enumerate(hot):
            noise[j].exponential_(generator=generators[i] or shared)
        tokens[index] = (probs / noise).argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail outside each row's nucleus (the smallest set of tokens whose mass reaches top_p)."""
    if bool((top_p >= 1).all()):
        return probs
    ordered, order = probs.sort(dim=-1, descending=True)
    outside = (ordered.cumsum(dim=-1) - ordered) > top_p[:, None]
    outside &= (top_p < 1)[:, None]
    return probs.scatter(-1, order, ordered.masked_fill(outside, 0.0))


def _prefill_chunks(rows: list[_Row]) -> list[list[_Row]]:
    """Split rows so each prefill forward holds at most `_PREFILL_TOKENS` padded prompt tokens."""
    chunks: list[list[_Row]] = []
    current: list[_Row] = []
    prompts: set[tuple[int, ...]] = set()
    for row in rows:
        width = max([len(row.prompt), *(len(p) for p in prompts)])
        distinct = len(prompts | {row.prompt})
        if current and distinct * width > _PREFILL_TOKENS:
            chunks.append(current)
            current, prompts = [], set()
        current.append(row)
        prompts.add(row.prompt)
    if current:
        chunks.append(current)
    return chunks


def _left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _check_full_attention(cache: DynamicCache) -> None:
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        kinds = sorted({type(layer).__name__ for layer in cache.layers})
        raise EngineError(f"the HF engine batches full-attention KV caches only; this model uses {kinds}")


def _settle(job: _Job, *, result: list[Any] | None = None, exc: BaseException | None = None) -> None:
    if job.future.done():
        return
    if exc is not None:
        job.future.set_exception(exc)
    else:
        job.future.set_result(result)  # type: ignore[arg-type]


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def _eos_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return frozenset(ids)


def _choose_dtype(requested: str, device: torch.device) -> tuple[torch.dtype, str]:
    if requested != "auto":
        return getattr(torch, requested), f"dtype={requested} was requested"
    if device.type != "cuda":
        return torch.float32, "CPU: float32 (bf16 matmuls are slow on most CPUs, and logprobs must match the trainer's)"
    if torch.cuda.is_bf16_supported():
        return torch.bfloat16, f"{torch.cuda.get_device_name(device)} supports bf16"
    return torch.float16, f"{torch.cuda.get_device_name(device)} has no bf16"


def _load(path: Path, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tokenizer
