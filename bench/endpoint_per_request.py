"""What one request costs the notebook's process at the OpenAI endpoint, with the engine taken away.

    .venv/bin/python bench/endpoint_per_request.py [--concurrency 8 64 256] [--requests 512]
        [--repeats 3] [--model DIR] [--label after] [--baseline OTHER.json] [--profile KIND:CONC]
        [--art-nb-root TREE] [--transport inprocess|http] [--out bench/results/endpoint_per_request.json]

On the GPU the endpoint shares one process (one GIL) with vLLM's engine thread, so every
microsecond it spends per request on rendering, validation, tokenising, building the response and
JSON is taken from the engine. Here the engine answers at once with a fixed 128-token sample, so
what is left is exactly that per-request cost. The server is the one LocalBackend runs:
`create_app` over an async registry with a bearer key, `start_server` (uvicorn on 127.0.0.1), on a
`BackgroundLoop` thread as in a notebook; the client is the one `model.openai_client()` makes (the SDK's
`AsyncOpenAI`, its chat requests lightened by art_nb/chat_client.py) on the main thread, calling the app
without a socket (`--transport inprocess`, the default) or over loopback HTTP (`--transport http`). Three calls: what a rollout makes (`create(model, messages, max_tokens)`), the same with
`logprobs=True`, and `stream=True` (consumed to the end).

Each run sends `--requests` requests, `CONC` at a time, with tic-tac-toe prompts (first and third
turns, every one different: no cache sees a repeat) through the SmolLM2 tokenizer. Per request:
wall seconds, CPU seconds of the server thread and of the client thread (per-thread CPU clocks),
and of the whole process. `--profile KIND:CONC` runs that case once under cProfile on both threads
and prints the top functions instead.

Before/after: run the old code from a worktree with `--art-nb-root /tmp/b_before --label before
--out /tmp/before.json`, then this tree with `--baseline /tmp/before.json`: its JSON keeps both and
the table shows both.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, Results, loadavg, rollout_prompts, stats, tokenizer_dir  # noqa: E402

KINDS = ("plain", "logprobs", "stream")
TOKENS = 128
REPLY = ("I will take the centre first, since it touches the most lines. <move>B2</move> "
         "If the opponent answers in a corner, I block the diagonal and keep two threats open. ")


class InstantEngine:
    """The Engine protocol answered at once: every sample is the same 128 tokens (finish "length"),
    so the bench measures the endpoint and nothing else."""

    def __init__(self, tokenizer: Any, max_context: int = 8192) -> None:
        self.tokenizer, self.max_context = tokenizer, max_context
        ids: list[int] = []
        while len(ids) < TOKENS:
            ids += tokenizer.encode(REPLY, add_special_tokens=False)
        self.ids = ids[:TOKENS]
        self.logprobs = [-0.05 - (k % 7) * 0.11 for k in range(TOKENS)]
        self.dead_reason = None

    async def generate(self, request: Any) -> list[Any]:
        from art_nb.local.engines.base import Sample

        n = min(request.params.max_tokens, TOKENS)
        return [Sample(self.ids[:n], self.logprobs[:n], "length") for _ in range(request.params.n)]

    async def train_with(self, step: Any) -> Any:
        return await step()

    async def load_adapter(self, name: str, path: Path, weights: Any = None) -> None: ...
    async def unload_adapter(self, name: str) -> None: ...
    async def sleep(self) -> None: ...
    async def wake(self) -> None: ...
    async def close(self) -> None: ...


class Registry:
    """Resolves like LocalBackend's runtime (async): "agent" serves adapter "agent@1"."""

    def __init__(self, engine: InstantEngine) -> None:
        self.engine = engine

    async def resolve(self, model_name: str) -> Any:
        from art_nb.local.server import ServedModel

        if model_name != "agent":
            raise KeyError(model_name)
        return ServedModel(self.engine, "agent@1", "agent")

    def list_models(self) -> list[str]:
        return ["agent"]


def conversations(count: int, seed: int) -> list[list[dict[str, str]]]:
    """`count` different tic-tac-toe conversations: odd ones a first turn, even ones a third turn."""
    out = []
    for i, messages in enumerate(rollout_prompts(count, seed)):
        messages = [dict(m) for m in messages]
        messages[-1]["content"] += f"\nGame {seed}-{i}."  # every prompt differs, as boards do in training
        if i % 2 == 0:
            reply = {"role": "assistant", "content": "<move>B2</move>"}
            turn = {"role": "user", "content": messages[-1]["content"].replace(".", "_", 1)}
            messages = [*messages, reply, turn, reply, turn]
        out.append(messages)
    return out


def thread_cpu(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


async def call(client: Any, kind: str, messages: list[dict[str, str]]) -> int:
    """One request as a rollout makes it; returns the completion tokens seen (a check)."""
    if kind == "stream":
        tokens = 0
        stream = await client.chat.completions.create(model="agent", messages=messages, max_tokens=TOKENS,
                                                      stream=True)
        async for chunk in stream:
            for choice in chunk.choices:
                tokens += len((choice.model_extra or {}).get("token_ids") or [])
        return tokens
    extra = {"logprobs": True} if kind == "logprobs" else {}
    response = await client.chat.completions.create(model="agent", messages=messages, max_tokens=TOKENS, **extra)
    choice = response.choices[0]
    if kind == "logprobs":
        assert choice.logprobs is not None and len(choice.logprobs.content) == TOKENS
    return len((choice.model_extra or {})["token_ids"])


async def one_run(client: Any, kind: str, concurrency: int, prompts: list[list[dict[str, str]]],
                  server_ident: int) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(messages: list[dict[str, str]]) -> int:
        async with gate:
            start = time.perf_counter()
            tokens = await call(client, kind, messages)
            latencies.append(time.perf_counter() - start)
            return tokens

    me = threading.get_ident()
    load = loadavg()
    s0, c0, p0, w0 = thread_cpu(server_ident), thread_cpu(me), time.process_time(), time.perf_counter()
    tokens = await asyncio.gather(*(one(m) for m in prompts))
    wall = time.perf_counter() - w0
    server, client_s, process = thread_cpu(server_ident) - s0, thread_cpu(me) - c0, time.process_time() - p0
    assert all(t == TOKENS for t in tokens), f"a response did not carry {TOKENS} token ids: {set(tokens)}"
    n = len(prompts)
    return {"wall_us": wall / n * 1e6, "server_cpu_us": server / n * 1e6, "client_cpu_us": client_s / n * 1e6,
            "process_cpu_us": process / n * 1e6, "latency_p50_ms": statistics.median(latencies) * 1e3,
            "requests": n, "loadavg_before": load}


class Bench:
    """The server on its own loop thread, the client on this thread's loop."""

    def __init__(self, model: Path, transport: str = "inprocess",
                 make_engine: Callable[[Any], Any] = InstantEngine) -> None:
        """`make_engine(tokenizer)`: the engine the endpoint serves (one that answers at once by default)."""
        from transformers import AutoTokenizer

        self.transport = transport
        from art_nb.local.loop import BackgroundLoop
        from art_nb.local.server import InferenceGate, create_app, start_server

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.engine = make_engine(self.tokenizer)
        self.loop = BackgroundLoop("bench-server")
        self.key = "bench-key-0123456789"

        async def serve() -> Any:
            app = create_app(Registry(self.engine), InferenceGate(), api_key=self.key)
            return await start_server(app)

        self.server = self.loop.run_sync(serve(), timeout=30)
        self.server_ident = self.loop.run_sync(_ident(), timeout=5)

    def client(self) -> Any:
        # "inprocess": what model.openai_client() hands a rollout for a LocalBackend in this process
        extra = {"http_client": self.server.in_process_http_client()} if self.transport == "inprocess" else {}
        return client_class()(base_url=self.server.base_url, api_key=self.key, max_retries=0, timeout=120, **extra)

    def close(self) -> None:
        self.loop.run_sync(self.server.stop(), timeout=30)


def client_class() -> type:
    """The class `model.openai_client()` builds: art_nb's chat client (art_nb/chat_client.py), or the SDK's
    `AsyncOpenAI` in a tree from before it (`--art-nb-root`)."""
    import art_nb

    if not (Path(art_nb.__file__).parent / "chat_client.py").exists():  # an editable install would still import ours
        import openai

        return openai.AsyncOpenAI
    from art_nb.chat_client import chat_client_class

    return chat_client_class()


async def _ident() -> int:
    return threading.get_ident()


async def measure(bench: Bench, kinds: list[str], concurrencies: list[int], requests: int,
                  repeats: int) -> dict[str, Any]:
    client = bench.client()
    out: dict[str, Any] = {}
    for kind in kinds:  # warm-up: connections, template compilation, per-token caches
        await asyncio.gather(*(call(client, kind, m) for m in conversations(64, seed=999)))
    for concurrency in concurrencies:
        for kind in kinds:
            runs = []
            for repeat in range(repeats):
                prompts = conversations(requests, seed=1000 * concurrency + 10 * repeat + KINDS.index(kind))
                runs.append(await one_run(client, kind, concurrency, prompts, bench.server_ident))
            out[f"{kind}@{concurrency}"] = {
                "kind": kind, "concurrency": concurrency, "runs": runs,
                **{f"median_{key}": round(statistics.median(r[key] for r in runs), 1)
                   for key in ("wall_us", "server_cpu_us", "client_cpu_us", "process_cpu_us", "latency_p50_ms")},
                "wall_us_stats": stats([r["wall_us"] for r in runs]),
            }
            row = out[f"{kind}@{concurrency}"]
            print(f"  {kind:9s} c={concurrency:4d}  wall {row['median_wall_us']:8.0f} us  server "
                  f"{row['median_server_cpu_us']:7.0f}  client {row['median_client_cpu_us']:7.0f}  "
                  f"process {row['median_process_cpu_us']:7.0f}", flush=True)
    await client.close()
    return out


async def client_alone(requests: int, repeats: int, concurrency: int, cls: type) -> dict[str, Any]:
    """The openai client's own CPU per request, with no server behind it: a transport that answers every
    request at once with a completion of the endpoint's shape (128 token ids, the prompt's ids). What is
    left of `client_cpu_us` above is the hop to the app and back. `cls`: the SDK's `AsyncOpenAI` or
    art_nb's chat client."""
    import openai

    from art_nb.local.server.inprocess import _httpx_of_openai

    httpx = _httpx_of_openai()
    body = json.dumps({"id": "c", "object": "chat.completion", "created": 1, "model": "agent",
                       "choices": [{"index": 0, "finish_reason": "length", "token_ids": list(range(TOKENS)),
                                    "message": {"role": "assistant", "content": REPLY * 2}}],
                       "usage": {"prompt_tokens": 300, "completion_tokens": TOKENS, "total_tokens": 300 + TOKENS},
                       "prompt_token_ids": list(range(300))}).encode()

    class AtOnce(httpx.AsyncBaseTransport):  # type: ignore[misc,name-defined]
        async def handle_async_request(self, request: Any) -> Any:
            await request.aread()
            return httpx.Response(200, headers=[(b"content-type", b"application/json")], content=body, request=request)

    client = cls(base_url="http://127.0.0.1:9/v1", api_key="k", max_retries=0,
                                http_client=openai.DefaultAsyncHttpxClient(transport=AtOnce()))
    await asyncio.gather(*(call(client, "plain", m) for m in conversations(64, seed=999)))
    runs = []
    for repeat in range(repeats):
        prompts, gate = conversations(requests, seed=77 + repeat), asyncio.Semaphore(concurrency)

        async def one(messages: list[dict[str, str]]) -> int:
            async with gate:
                return await call(client, "plain", messages)

        start = thread_cpu(threading.get_ident())
        await asyncio.gather(*(one(m) for m in prompts))
        runs.append((thread_cpu(threading.get_ident()) - start) / requests * 1e6)
    await client.close()
    return {"kind": "plain", "concurrency": concurrency, "client_cpu_us_runs": [round(r, 1) for r in runs],
            "median_client_cpu_us": round(statistics.median(runs), 1)}


async def profile(bench: Bench, kind: str, concurrency: int, requests: int) -> str:
    client = bench.client()
    await asyncio.gather(*(call(client, kind, m) for m in conversations(64, seed=999)))
    prompts = conversations(requests, seed=7)
    text = io.StringIO()
    if sys.version_info >= (3, 12):  # cProfile runs on sys.monitoring there: one profiler, every thread
        both = cProfile.Profile()
        both.enable()
        await one_run(client, kind, concurrency, prompts, bench.server_ident)
        both.disable()
        profiles = [("SERVER and CLIENT threads", both)]
    else:  # cProfile hooks the thread that enables it
        server_prof, client_prof = cProfile.Profile(time.thread_time), cProfile.Profile(time.thread_time)
        bench.loop.loop.call_soon_threadsafe(server_prof.enable)
        await asyncio.sleep(0.05)
        client_prof.enable()
        await one_run(client, kind, concurrency, prompts, bench.server_ident)
        client_prof.disable()
        bench.loop.loop.call_soon_threadsafe(server_prof.disable)
        await asyncio.sleep(0.05)
        profiles = [("SERVER thread", server_prof), ("CLIENT thread", client_prof)]
    await client.close()
    for name, prof in profiles:
        text.write(f"==== {name}: {kind} at {concurrency} concurrent, {requests} requests ====\n")
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def table(label: str, sections: dict[str, Any]) -> str:
    lines = [f"{label}: microseconds per request (medians)",
             f"{'call':10s} {'conc':>5s} {'wall':>8s} {'server':>8s} {'client':>8s} {'process':>8s}"]
    for row in sections.values():
        if not isinstance(row, dict):
            continue  # the section's status, summary and time
        lines.append(f"{row['kind']:10s} {row['concurrency']:5d} {row['median_wall_us']:8.0f} "
                     f"{row['median_server_cpu_us']:8.0f} {row['median_client_cpu_us']:8.0f} "
                     f"{row['median_process_cpu_us']:8.0f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--requests", type=int, default=512, help="requests per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", type=Path, default=None, help="a folder with the tokenizer (default: SmolLM2)")
    parser.add_argument("--label", default="after")
    parser.add_argument("--baseline", type=Path, default=None, help="an earlier run's JSON, kept and compared")
    parser.add_argument("--profile", default=None, metavar="KIND:CONC")
    parser.add_argument("--transport", choices=("inprocess", "http"), default="inprocess",
                        help="inprocess: the client model.openai_client() makes (no socket); http: over loopback, "
                             "as any other HTTP client (and every client before the in-process transport)")
    parser.add_argument("--art-nb-root", type=Path, default=None, help="import art_nb from this tree instead")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "endpoint_per_request.json")
    args = parser.parse_args()
    if args.art_nb_root is not None:
        sys.path.insert(0, str(args.art_nb_root.resolve()))
    import art_nb

    model = args.model or tokenizer_dir()
    bench = Bench(model, args.transport)
    try:
        if args.profile:
            kind, concurrency = args.profile.split(":")
            print(asyncio.run(profile(bench, kind, int(concurrency), args.requests)))
            return
        results = Results(args.out, benchmark="endpoint_per_request", label=args.label,
                          art_nb_imported_from=str(Path(art_nb.__file__).parent), tokenizer=str(model),
                          engine=f"InstantEngine: {TOKENS} fixed tokens per sample, no model",
                          requests_per_run=args.requests, repeats=args.repeats, transport=args.transport)
        if args.art_nb_root is not None:
            import subprocess

            results.data["art_nb_commit"] = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=args.art_nb_root, capture_output=True, text=True).stdout.strip()
        with results.section(args.label) as entry:
            entry.update(asyncio.run(measure(bench, args.kinds, args.concurrency, args.requests, args.repeats)))
            entry["summary"] = "see the table"
        import openai

        for name, cls in (("openai_client_alone", openai.AsyncOpenAI), ("art_nb_client_alone", client_class())):
            if name == "art_nb_client_alone" and cls is openai.AsyncOpenAI:
                continue  # a tree from before art_nb's chat client
            with results.section(name) as entry:
                entry.update(asyncio.run(client_alone(args.requests, args.repeats, max(args.concurrency), cls)))
                entry["summary"] = f"{entry['median_client_cpu_us']:.0f} us of client CPU per request with no server"
        if args.baseline is not None:
            before = json.loads(args.baseline.read_text())
            results.data["baseline"] = before
            results.save()
            print(table(before.get("label", "before"), before["sections"][before.get("label", "before")]))
        print(table(args.label, results.data["sections"][args.label]))
    finally:
        bench.close()


if __name__ == "__main__":
    main()
