"""`HFEngine`: the transformers engine (CPU or CUDA) with continuous batching and LoRA adapters.

Concurrent `generate` calls share forward passes. Each call becomes `n` rows in a FIFO queue; one
scheduler task, on the event loop, repeatedly hands the model thread a list of rows to admit and
advances every live row by one token. Admitted rows are prefilled (identical prompts once, then the
cache is copied per row), left-padded to the running batch's cache length and joined to it, so a
rollout's next turn starts decoding within a step instead of waiting for the batch to drain. Rows
that finish leave the batch at once and their request is answered as soon as its last row is done.

A prompt that starts like a sequence computed before under the same adapter (the conversation's
previous turn, another game of the group) is prefilled from a copy of that sequence's KV: only the
new tokens run (`prefix.py`). `stats` counts the prefilled and reused tokens.

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
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from transformers import DynamicCache

from ..base import AdapterWeights, ContextTooLongError, EngineDeadError, EngineError, GenerationRequest, Sample
from . import model as hf_model
from .batch import (
    AdapterTable,
    Batch,
    EngineStats,
    Job,
    Row,
    check_full_attention,
    finish_reason,
    prefill_chunks,
    sample_tokens,
    settle,
    top_alternatives,
)
from .grammar import Grammars
from .prefix import Entry, PrefixCache, chunk_inputs, default_budget

if TYPE_CHECKING:
    from art_nb.config import ModelConfig
    from art_nb.local.plan.choices import Plan

__all__ = ["EngineStats", "HFEngine"]

logger = logging.getLogger("art_nb")
T = TypeVar("T")


def _config_key(weights: AdapterWeights) -> str:
    """Adapters whose configs give the same key fit the same peft slot."""
    return json.dumps(weights.config, sort_keys=True, default=str)


class HFEngine:
    """The `Engine` protocol over a transformers causal LM, with peft adapters. Create with `await HFEngine.create(...)`."""

    # Seconds one call into the model thread (a forward, an adapter load) may take before the engine is
    # declared dead. Generous: a long prefill of a larger model on CPU stays well inside it.
    stall_timeout: float = 300.0

    def __init__(self, model: Any, tokenizer: Any, config: ModelConfig, device: torch.device, threads: int,
                 prefix_cache_bytes: int | None = None) -> None:
        self._model = model
        self.tokenizer = tokenizer
        self._device = device
        self.max_context: int = hf_model.context_window(model, config.max_seq_len)
        self._max_rows = config.max_batch_size
        self._vocab = model.get_input_embeddings().num_embeddings
        self._eos_ids = hf_model.eos_ids(tokenizer, model)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self._eos_ids, default=0)
        self._shared_generator = torch.Generator(device=device).manual_seed(config.seed)
        self._cache_kwarg = hf_model.cache_keyword(model)
        self.stats = EngineStats()
        # Bytes of KV kept for reuse across turns; 0 turns it off, None takes a share of the device's memory.
        self.prefix_cache = PrefixCache(default_budget(device) if prefix_cache_bytes is None else prefix_cache_bytes)
        self._grammars = Grammars(tokenizer, self._eos_ids)  # constrained decoding (grammar.py)
        self.serves_while_training = device.type != "cuda"  # on CUDA the weights leave for a step (train_with)

        self._executor = ThreadPoolExecutor(1, "art_nb-hf", initializer=torch.set_num_threads, initargs=(threads,))
        self._pending: deque[Row] = deque()
        self._batch = Batch()
        self._wakeup = asyncio.Event()
        self._drained = asyncio.Event()
        self._paused = False
        self._dead: str | None = None
        self._adapters = AdapterTable()
        self._scheduler = asyncio.get_running_loop().create_task(self._schedule(), name="art_nb-hf-scheduler")
        self._scheduler.add_done_callback(self._on_scheduler_exit)

    @classmethod
    async def create(cls, model_path: str | Path, config: ModelConfig, plan: Plan | None = None,
                     device: str | torch.device | None = None, prefix_cache_bytes: int | None = None) -> HFEngine:
        """Load the model and tokenizer off the event loop and start the scheduler.

        `plan` (`plan_for(config)` when None) gives the device, the dtype the trainer shares and the
        CPU thread count; `device` overrides the plan's device (tests), not its dtype.
        `prefix_cache_bytes`: the prefix cache's budget (0: off; None: `ModelConfig.prefix_cache_gib`, whose
        None is `prefix.default_budget`).
        """
        from art_nb.local.plan.choices import plan_for

        plan = plan or plan_for(config)
        dev = torch.device(device or plan.device)
        threads = torch.get_num_threads()
        if dev.type == "cpu" and plan.cpu_threads is not None:
            threads = plan.cpu_threads
            torch.set_num_threads(threads)
        logger.debug("HF engine: %s on %s, %d torch thread(s)", plan.dtype, dev, threads)
        model, tokenizer = await asyncio.to_thread(hf_model.load, Path(model_path), plan.torch_dtype(), dev)
        if prefix_cache_bytes is None and config.prefix_cache_gib is not None:
            prefix_cache_bytes = int(config.prefix_cache_gib * 2**30)
        return cls(model, tokenizer, config, dev, threads, prefix_cache_bytes)

    # ---- the Engine protocol -------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> list[Sample]:
        """`request.params.n` samples for one prompt, decoded in the shared batch."""
        params, prompt = request.params, tuple(request.prompt_ids)
        matchers = await self._grammars.matchers(params.grammar, params.n) if params.grammar else [None] * params.n
        self._check_alive()
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
        adapter = self._adapters.lookup(request.adapter)

        job = Job(asyncio.get_running_loop().create_future(), [None] * params.n, adapter)
        self._adapters.acquire(adapter)
        job.future.add_done_callback(functools.partial(self._on_job_done, job))
        for i in range(params.n):
            self._pending.append(Row(job, i, prompt, params, self._row_generator(params.seed, i), matcher=matchers[i]))
        self._wakeup.set()
        return await job.future

    async def load_adapter(self, name: str, path: Path, weights: AdapterWeights | None = None) -> None:
        """Load the PEFT adapter in `path`, or built from `weights` (then `path` is not read), as `name`;
        requests already submitted keep their weights."""
        self._check_alive()
        path = Path(path)
        if weights is None and not (path / "adapter_config.json").is_file():
            raise EngineError(f"{path} is not a PEFT adapter directory (no adapter_config.json)")
        internal, refill = self._adapters.new_internal(None if weights is None else _config_key(weights))
        try:
            await self._in_worker(self._load_peft, internal, path, weights, refill)
        except BaseException:
            self._adapters.abandon(internal)  # never bound: the scheduler deletes it, whatever state it is in
            self._wakeup.set()
            raise
        self._adapters.bind(name, internal)
        self._wakeup.set()  # the scheduler deletes the adapter it replaced once unused
        logger.info("HF engine: adapter %s loaded", name)
        logger.debug("HF engine: adapter %s %s", name, "handed over in memory" if weights else f"read from {path}")

    async def unload_adapter(self, name: str) -> None:
        self._check_alive()
        self._adapters.unbind(name)
        doomed = self._adapters.take_unused()
        if doomed:
            await self._in_worker(self._delete_adapters, doomed)

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving (closed, crashed, stalled), or None while it serves."""
        return self._dead

    async def train_with(self, step: Callable[[], Awaitable[T]], hold: Callable[[], Awaitable[None]] | None = None) -> T:
        """Run `step()` with the weights on CPU (on CUDA; on CPU nothing moves), awake again after.

        Training's activations and optimizer state need the accelerator memory the served copy
        holds; new rows wait meanwhile (`sleep` holds them; `hold` is not needed), so nothing is lost.
        """
        try:
            await self.sleep()
            return await step()
        finally:
            await self.wake()

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
            doomed = self._adapters.take_unused()
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
                    settle(row.job, exc=self._dead_error())
                return
            except Exception as exc:  # a failed forward fails its rows, not the engine
                logger.exception("HF engine: batch failed")
                failed = {row.job for row in [*self._batch.rows, *admit]}
                self._batch = Batch()
                for job in failed:
                    settle(job, exc=EngineError(f"generation failed: {type(exc).__name__}: {exc}"))
                continue
            for row in finished:
                self._deliver(row)

    def _admissible(self) -> list[Row]:
        """Rows from the head of the queue that can join the running batch now (same adapter, free room)."""
        if self._paused:
            return []
        room = self._max_rows - len(self._batch.rows)
        adapter = self._batch.adapter if self._batch.rows else None
        taken: list[Row] = []
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

    def _deliver(self, row: Row) -> None:
        job = row.job
        if job.abandoned:
            return
        job.samples[row.index] = Sample(list(row.tokens), list(row.logprobs), row.finish,  # type: ignore[arg-type]
                                        top_logprobs=list(row.top) if row.params.top_logprobs else None)
        if all(s is not None for s in job.samples):
            settle(job, result=job.samples)

    def _row_generator(self, seed: int | None, index: int) -> torch.Generator | None:
        """A private generator for seeded requests, so their samples do not depend on batch neighbours."""
        if seed is None:
            return None
        return torch.Generator(device=self._device).manual_seed((seed * 1_000_003 + index) % 2**63)

    def _on_job_done(self, job: Job, _future: asyncio.Future[list[Sample]]) -> None:
        job.abandoned = True
        if self._adapters.release(job.adapter):
            self._wakeup.set()  # the scheduler's next round deletes it

    def _on_scheduler_exit(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self._dead = f"the scheduler crashed: {task.exception()!r}"
        logger.error("HF engine: %s", self._dead)
        self._fail_all(self._dead_error())

    def _fail_all(self, exc: EngineError) -> None:
        for row in [*self._pending, *self._batch.rows]:
            settle(row.job, exc=exc)
        self._pending.clear()
        self._batch = Batch()

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
            name = fn.__name__.lstrip("_")
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
    def _advance(self, admit: list[Row]) -> list[Row]:
        """Admit `admit`, advance every live row by one token, return the rows that finished."""
        batch = self._batch
        batch_rows = [r for r in batch.rows if not r.job.abandoned]
        if len(batch_rows) != len(batch.rows):
            batch.keep(batch_rows)
        if admit:
            if not batch.rows:
                batch.adapter = admit[0].job.adapter
            matches = {p: self.prefix_cache.match(batch.adapter, p) for p in dict.fromkeys(r.prompt for r in admit)}
            for chunk in prefill_chunks(admit, lambda p: len(p) - matches[p][1]):
                self._prefill(chunk, matches)
        if not batch.rows:
            return []
        done = [r for r in batch.rows if r.finish is not None]
        if done:  # finished during prefill (max_tokens=1, or a stop token first)
            batch.keep([r for r in batch.rows if r.finish is None])
        if batch.rows:
            self._step()
        finished = [r for r in batch.rows if r.finish is not None]
        if finished:
            self._remember(finished)
            batch.keep([r for r in batch.rows if r.finish is None])
        return done + finished

    def _prefill(self, rows: list[Row], matches: dict[tuple[int, ...], tuple[Entry | None, int]]) -> None:
        """Run the distinct prompts of `rows` from their cached prefixes, copy each prompt's cache per
        row, sample, join the batch. A prompt that reused nothing is remembered for later ones."""
        prompts = list(dict.fromkeys(r.prompt for r in rows))
        inputs = chunk_inputs(prompts, [matches[p] for p in prompts], self._pad_id, self._device)
        mask, cache = inputs.mask, inputs.cache
        logits = self._forward(inputs.ids, mask, inputs.positions, cache)
        check_full_attention(cache)
        for i, prompt in enumerate(prompts):
            if matches[prompt][1] == 0:
                self.prefix_cache.store(self._batch.adapter, prompt, cache, i)
        self.stats.prefills += len(prompts)
        self.stats.prefix_hits += sum(1 for r in inputs.reused if r)
        self.stats.reused_tokens += sum(inputs.reused)
        self.stats.prefilled_tokens += sum(len(p) for p in prompts) - sum(inputs.reused)

        which = torch.tensor([prompts.index(r.prompt) for r in rows], device=self._device)
        cache.batch_select_indices(which)
        mask, logits = mask[which], logits[which]
        tokens = self._sample_and_record(logits, rows)
        self._batch.join(rows, cache, mask, tokens, positions=mask.sum(-1))

    def _remember(self, rows: list[Row]) -> None:
        """Keep the KV of finished rows (prompt and reply, less the last token, never fed) for their next turn."""
        batch = self._batch
        index = {id(r): i for i, r in enumerate(batch.rows)}
        for row in rows:
            if not row.job.abandoned and len(row.tokens) > 1:
                self.prefix_cache.store(batch.adapter, row.prompt + tuple(row.tokens[:-1]), batch.cache, index[id(row)])

    def _step(self) -> None:
        batch = self._batch
        mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=1)
        logits = self._forward(batch.next_tokens[:, None], mask, batch.positions[:, None], batch.cache)
        batch.mask, batch.positions = mask, batch.positions + 1
        batch.next_tokens = self._sample_and_record(logits, batch.rows)
        self.stats.steps += 1

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        self.stats.max_batch_size = max(self.stats.max_batch_size, ids.shape[0])
        return hf_model.last_logits(self._model, self._cache_kwarg, self._batch.adapter, ids, mask, positions, cache)

    def _sample_and_record(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        self._grammars.mask(logits, rows)  # before sampling: logprobs are of the masked distribution
        tokens, logprobs = sample_tokens(logits, [r.params for r in rows], [r.generator for r in rows], self._shared_generator)
        counts = [r.params.top_logprobs for r in rows]
        tops = top_alternatives(logits, counts) if any(counts) else None
        for i, (row, token, logprob) in enumerate(zip(rows, tokens.tolist(), logprobs.tolist(), strict=True)):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            if tops is not None and counts[i]:
                row.top.append(tops[i])
            row.finish = finish_reason(row, token, self._eos_ids, self.tokenizer)
        self._grammars.advance(rows, tokens.tolist())
        self.stats.tokens += len(rows)
        return tokens

    def _load_peft(self, internal: str, path: Path, weights: AdapterWeights | None, refill: bool) -> None:
        if refill:  # a retired slot of the same config (AdapterTable): its cached prefixes hold the old weights' KV
            assert weights is not None
            self.prefix_cache.drop_adapters([internal])
            hf_model.refill(self._model, internal, weights)
            return
        self._model = hf_model.with_adapter(self._model, internal, path if weights is None else weights, self._device)

    def _delete_adapters(self, internals: list[str]) -> None:
        self.prefix_cache.drop_adapters(internals)
        self._model = hf_model.without_adapters(self._model, internals)

    def _move(self, device: torch.device) -> None:
        self.prefix_cache.clear()  # training needs the memory; entries would be on the wrong device anyway
        hf_model.move(self._model, device)
