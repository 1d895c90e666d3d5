"""What constrained decoding costs the transformers engine per token on a CPU: the same requests with
and without a grammar, in one run.

SmolLM2-135M-Instruct in art_nb's `HFEngine` (the engine a CPU user gets), sampling at temperature 1
with a seed. The constrained side holds every reply to a JSON schema that cannot close early (an
object whose "notes" array needs at least 40 strings), so both sides decode up to `--tokens` tokens;
the unconstrained side answers the same prompt freely with `ignore_eos`, so it decodes as many. Each
batch size (1 and 8 concurrent rows by default) runs free and constrained alternately (free,
constrained, then constrained, free, ...), `--repeats` times. Recorded per run: wall seconds, tokens
decoded, seconds per token, the load average; and the time spent inside the grammar's two calls per
step (`Grammars.mask`: llguidance's bitmask and numpy applying it; `Grammars.advance`: the matcher
consuming the sampled token), per row and token, and as a share of the constrained run's time. The
headline is the ratio of seconds per token, constrained / free, median over repeats; on a shared
machine the load moves both sides by more than the grammar costs, so the share is the steadier number. First use builds llguidance's view of the tokenizer once per
engine; that is timed apart (`tokenizer_build_s`), after a warm-up, and is not in the ratio.

    .venv/bin/python bench/constrained_decoding_cpu.py [--repeats 3] [--tokens 64] [--batch 1 8]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, Results, loadavg, peak_rss_mib, stats

SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 40}},
          "required": ["notes"]}
PROMPT = "List forty short notes about the weather, as JSON."


class GrammarTimer:
    """Wraps an engine's `Grammars.mask` and `advance`, summing their seconds and the rows they served."""

    def __init__(self, grammars: Any) -> None:
        self.seconds = 0.0
        self.row_steps = 0
        for name in ("mask", "advance"):
            setattr(grammars, name, self._timed(getattr(grammars, name)))

    def _timed(self, call: Any) -> Any:
        @functools.wraps(call)
        def timed(logits_or_rows: Any, rows_or_tokens: Any) -> None:
            started = time.perf_counter()
            call(logits_or_rows, rows_or_tokens)
            self.seconds += time.perf_counter() - started
            if call.__name__ == "mask":
                self.row_steps += sum(1 for row in rows_or_tokens if row.matcher is not None)
        return timed


async def run_once(engine: Any, prompt: list[int], batch: int, tokens: int, grammar: str | None, seed: int,
                   timer: GrammarTimer) -> dict[str, Any]:
    from art_nb.local.engines.base import GenerationRequest, SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed, grammar=grammar, ignore_eos=grammar is None)
    timer.seconds, timer.row_steps = 0.0, 0
    load = loadavg()
    started = time.perf_counter()
    samples = await asyncio.gather(*(engine.generate(GenerationRequest(prompt, params)) for _ in range(batch)))
    seconds = time.perf_counter() - started
    decoded = sum(len(s.token_ids) for [s] in samples)
    return {"constrained": grammar is not None, "seconds": round(seconds, 4), "tokens": decoded,
            "s_per_token": seconds / decoded, "loadavg_before": load, "loadavg_after": loadavg(),
            "grammar_us_per_row_token": round(1e6 * timer.seconds / timer.row_steps, 1) if timer.row_steps else None,
            "grammar_share": round(timer.seconds / seconds, 5),
            "text": engine.tokenizer.decode(samples[0][0].token_ids, skip_special_tokens=True)[:160]}


async def run(args: argparse.Namespace, results: Results) -> None:
    import torch

    from art_nb.config import ModelConfig
    from art_nb.local.engines.base import GenerationRequest, SamplingParams
    from art_nb.local.engines.hf.engine import HFEngine
    from art_nb.local.plan.base_models import TINY_MODEL, resolve_base_model
    from art_nb.local.server.constrain import grammar_for
    from art_nb.local.server.schema import ChatCompletionRequest

    engine = await HFEngine.create(resolve_base_model(TINY_MODEL).path,
                                   ModelConfig(max_seq_len=1024, max_batch_size=max(args.batch)), prefix_cache_bytes=0)
    timer = GrammarTimer(engine._grammars)
    request = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": PROMPT}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "notes", "schema": SCHEMA}}})
    grammar = grammar_for(request)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                  return_dict=True)["input_ids"]
    await engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=4)))  # warm-up
    started = time.perf_counter()
    await engine._grammars.matchers(grammar, 1)  # the first: llguidance's view of the tokenizer is built here
    results.data.update(tokenizer_build_s=round(time.perf_counter() - started, 3), grammar=grammar,
                        torch_threads=torch.get_num_threads())

    for batch in args.batch:
        with results.section(f"batch_{batch}") as entry:
            runs = []
            for repeat in range(args.repeats):
                for constrained in ((False, True) if repeat % 2 == 0 else (True, False)):
                    outcome = await run_once(engine, prompt, batch, args.tokens, grammar if constrained else None,
                                             seed=repeat, timer=timer)
                    outcome["repeat"] = repeat
                    runs.append(outcome)
                    print(f"  batch {batch} repeat {repeat} {'grammar' if constrained else 'free   '}: "
                          f"{1000 * outcome['s_per_token']:.2f} ms/token ({outcome['tokens']} tokens)", flush=True)
            free = [r for r in runs if not r["constrained"]]
            held = [r for r in runs if r["constrained"]]
            ratios = [round(h["s_per_token"] / f["s_per_token"], 3) for f, h in zip(free, held, strict=True)]
            ratio = statistics.median(ratios)
            grammar_us = statistics.median(r["grammar_us_per_row_token"] for r in held)
            share = statistics.median(r["grammar_share"] for r in held)
            ms = {k: 1000 * statistics.median(r["s_per_token"] for r in v) for k, v in (("free", free), ("held", held))}
            entry.update(runs=runs, ratio=ratio, ratio_per_repeat=ratios, grammar_us_per_row_token=grammar_us,
                         grammar_share=share,
                         ms_per_token={"free": stats([1000 * r["s_per_token"] for r in free]),
                                       "constrained": stats([1000 * r["s_per_token"] for r in held])},
                         summary=f"batch {batch}: {ms['free']:.1f} ms/token free, {ms['held']:.1f} constrained -> "
                                 f"{ratio:.3f}x (per repeat {ratios}); the grammar's own calls "
                                 f"{grammar_us:.0f} us per row and token, {100 * share:.1f}% of the constrained time")
    sections = results.data["sections"]
    with results.section("comparison") as entry:
        entry["summary"] = "; ".join(sections[f"batch_{b}"]["summary"] for b in args.batch
                                     if sections[f"batch_{b}"].get("status") == "ok")
    results.data["peak_rss_mib"] = peak_rss_mib()
    await engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "constrained_decoding_cpu.json")
    args = parser.parse_args()
    results = Results(args.out, benchmark="constrained_decoding_cpu", repeats=args.repeats, tokens=args.tokens,
                      batch=args.batch, schema=SCHEMA, prompt=PROMPT)
    asyncio.run(run(args, results))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
