"""Constrained decoding for the transformers engine: llguidance's matchers as a mask on the logits.

Each row of a request with a `SamplingParams.grammar` gets an `LLMatcher` over that Lark grammar.
Before the row's token is sampled, the matcher's bitmask of allowed tokens (computed on the CPU)
sets every other logit to -inf, on whatever device the logits are; after, the matcher consumes the
sampled token. A row whose grammar is complete can only sample EOS, so it ends with it, as "stop".

Why llguidance, of the three maintained grammar libraries on PyPI that run beside torch on a CPU and
a GPU (xgrammar, llguidance, outlines-core):
- the tool-call format needs text around schema-held JSON (`<tool_call>` blocks, one per tool):
  llguidance's Lark dialect embeds a JSON schema in a grammar rule (`%json {...}`), so every constraint
  the endpoint serves is one grammar; outlines-core has no grammars (regular expressions, JSON schemas
  turned into them, no recursive schemas), and xgrammar composes schemas into text through its
  structural-tag API, whose format changed between the versions vLLM 0.11 and 0.32 pin;
- nothing is compiled ahead: llguidance computes each mask lazily from the grammar (about 30 us a
  token on SmolLM2's 49k vocabulary; with numpy applying it and the matcher consuming the token,
  0.1-0.4 ms a row, 0.6% of a SmolLM2-135M decode step on a 2-core CPU, 1.01-1.02x its time per token:
  `bench/constrained_decoding_cpu.py`), and every agent request brings its own schema; outlines-core
  builds an index over the whole vocabulary per schema first, xgrammar compiles each schema too;
- it has no Python dependencies (xgrammar requires torch, transformers, triton and apache-tvm-ffi),
  and vLLM ships it as its "guidance" structured-output backend, which the vLLM engine is set to: both
  engines enforce the same grammar text with the same library, so a rollout is constrained the same
  way on a CPU and on the GPU.

The logprobs the engine reports for a constrained row are of the masked distribution, the one it
drew from, as vLLM's are (vLLM applies its bitmask before its sampler takes raw logprobs);
docs/losses.md says what training does with them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..base import EngineError

if TYPE_CHECKING:
    from .batch import Row

__all__ = ["Grammars"]

_log = logging.getLogger("art_nb")


class Grammars:
    """llguidance for one engine's tokenizer: matchers for requests (event loop), masks and token
    consumption for rows (the model thread)."""

    def __init__(self, tokenizer: Any, eos_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        # The one EOS a complete grammar allows (llguidance 1.3, which vLLM 0.11 pins, takes one id)
        self._eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(eos_ids, default=None)
        self._ll_tokenizer: Any = None
        self._templates: dict[str, Any] = {}  # grammar -> an unused matcher to copy (`matchers`)
        self._building: asyncio.Lock | None = None

    async def matchers(self, grammar: str, n: int) -> list[Any]:
        """`n` fresh matchers over `grammar`; EngineError when it does not compile (the server checks first).

        Copies of one kept per grammar (the last 32): a group's rollouts send the same grammar on every
        call, and building it took 2 ms (json_object) to 20 ms (20 tools) where a copy takes 0.15 ms.
        A new one is built in a worker thread (llguidance releases the GIL), off the event loop.
        """
        template = self._templates.pop(grammar, None)
        if template is None:
            template = await asyncio.to_thread(self._new_matcher, await self._ll(), grammar)
        self._templates[grammar] = template  # most recent last
        while len(self._templates) > 32:
            self._templates.pop(next(iter(self._templates)))
        return [template.deep_copy() for _ in range(n)]

    @staticmethod
    def _new_matcher(ll_tokenizer: Any, grammar: str) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise EngineError(f"the grammar does not compile: {matcher.get_error()}")
        return matcher

    def mask(self, logits: torch.Tensor, rows: list[Row]) -> None:
        """Set the logits of the tokens each constrained row's grammar forbids to -inf, in place.

        Bitmasks are unpacked and applied by numpy on a CPU: single-threaded C loops, where torch's
        parallel masked_fill_ on SmolLM2's 49k logits took 0.4 ms on one core and 24 ms on two cores
        that other work kept busy. On a GPU the bool mask is moved to the logits and applied there.
        """
        index = [i for i, row in enumerate(rows) if row.matcher is not None]
        if not index:
            return
        words = (self._ll_tokenizer.vocab_size + 31) // 32
        bits = np.zeros((len(index), words), dtype=np.int32)
        for j, i in enumerate(index):
            rows[i].matcher.unsafe_compute_mask_ptr(bits[j].ctypes.data, words * 4)
        # Inverted first, so bits past the tokenizer's vocabulary (never allowed) come out forbidden too
        forbidden = np.unpackbits(np.invert(bits).view(np.uint8), axis=-1, bitorder="little").view(np.bool_)
        width = logits.shape[-1]  # the model's head may be wider than the tokenizer's vocabulary
        if forbidden.shape[1] < width:
            forbidden = np.pad(forbidden, ((0, 0), (0, width - forbidden.shape[1])), constant_values=True)
        forbidden = forbidden[:, :width]
        if logits.device.type == "cpu":
            target = logits.numpy()  # the same memory
            for j, i in enumerate(index):
                np.copyto(target[i], -np.inf, where=forbidden[j])
            return
        mask = torch.from_numpy(np.ascontiguousarray(forbidden)).to(logits.device, non_blocking=True)
        for j, i in enumerate(index):
            logits[i].masked_fill_(mask[j], float("-inf"))

    def advance(self, rows: list[Row], tokens: list[int]) -> None:
        """Feed each constrained row the token it sampled. A complete grammar allows only EOS, so a row
        ends as unconstrained ones do, with the EOS it sampled (as vLLM's do): training sees it."""
        for row, token in zip(rows, tokens, strict=True):
            matcher = row.matcher
            if matcher is None:
                continue
            if not matcher.consume_token(token):  # only if every logit was -inf or NaN: end the row, not the batch
                _log.error("HF engine: the grammar refused the token sampled under it: %s", matcher.get_error())
                row.finish = row.finish or "stop"
            elif matcher.is_stopped() and token == self._eos:  # ended by EOS, even with ignore_eos
                row.finish = row.finish or "stop"

    async def _ll(self) -> Any:
        """llguidance's view of the tokenizer, built once off the event loop (0.4-1.5 s for SmolLM2's)."""
        if self._ll_tokenizer is None:
            self._building = self._building or asyncio.Lock()
            async with self._building:
                if self._ll_tokenizer is None:
                    self._ll_tokenizer = await asyncio.to_thread(self._build)
        return self._ll_tokenizer

    def _build(self) -> Any:
        import llguidance.hf

        try:
            return llguidance.hf.from_tokenizer(self._tokenizer, eos_token=self._eos)
        except ValueError as exc:  # a slow (Python) tokenizer
            raise EngineError(f"constrained decoding needs a fast tokenizer: {exc}") from exc
