"""Register's start-up time per vLLM start-up mode on a GPU: art_nb's phases and vLLM's own log timings.

Each mode runs `model.register(LocalBackend(...))` in a fresh process (a warm process would reuse
imports and vLLM's in-memory caches), on SmolLM2-135M-Instruct as tests/gpu resolves it
($ART_NB_GPU_MODEL, the staged GGUF converted once, else art_nb's offline copy). Per mode the JSON
holds `choices["startup"]` (each phase's seconds, the overlap, the wall total), the wall seconds of
`register`, the vLLM start-up reasons, and the timing lines vLLM logged (compile, graph capture, init).
Note: vLLM's compile cache on disk survives between processes; "compiled" after a first run is warm.

    python bench/gpu_startup.py                      # fast, compiled, eager -> $OUT/gpu_startup.json
    python bench/gpu_startup.py --modes fast eager
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    ROOT,
    STARTUP_MODES,
    Results,
    default_out_dir,
    measure_part,
    run_part,
    startup_env,
    tokenizer_dir,
)

# vLLM's log lines that say where its start went (vLLM 0.25 wording; others are simply not matched).
_VLLM_TIMINGS = re.compile(r"(torch\.compile takes|Compil\w+ .*took|Dynamo bytecode transform time|"
                           r"Graph capturing finished|init engine .* took|Loading weights took|"
                           r"Model loading took|Available KV cache memory|start-up|register: )[^\n]*")


class _Timings(logging.Handler):
    """Keeps the lines of vLLM's and art_nb's loggers that say where the start went."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = _VLLM_TIMINGS.search(record.getMessage())
        if found:
            self.lines.append(f"{time.strftime('%H:%M:%S')} {found.group(0)[:300]}")


def measure(model_dir: Path, mode: str) -> dict[str, Any]:
    import art_nb
    from art_nb.config import ModelConfig

    timings = _Timings()
    for name in ("vllm", "art_nb"):
        logging.getLogger(name).addHandler(timings)
        logging.getLogger(name).setLevel(logging.INFO)

    async def register() -> dict[str, Any]:
        backend = art_nb.LocalBackend(path=tempfile.mkdtemp(prefix="art_nb_startup_"))
        model = art_nb.TrainableModel(name=f"startup-{mode}", project="bench", base_model=str(model_dir),
                                      config=ModelConfig(vllm_startup=mode))
        began = time.perf_counter()
        await model.register(backend)
        wall = time.perf_counter() - began
        choices = backend.choices(model)
        await backend.close()
        return {"register_s": round(wall, 1), "startup": choices.get("startup"), "engine": choices.get("engine"),
                "trainer": choices.get("trainer"), "log": timings.lines}

    return asyncio.run(register())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=STARTUP_MODES, default=list(STARTUP_MODES))
    parser.add_argument("--part", help=argparse.SUPPRESS)  # a child process: measure one mode
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per mode")
    parser.add_argument("--out", type=Path, default=None, help="folder for gpu_startup.json (default $OUT)")
    args = parser.parse_args()
    out_dir = args.out or default_out_dir()
    if args.part:
        measure_part(out_dir, args.part, lambda write: measure(args.model, args.part))
        return
    model_dir = tokenizer_dir()  # the real SmolLM2 weights (the GGUF is converted here, once, not per mode)
    results = Results(out_dir / "gpu_startup.json", command=" ".join(sys.argv), model=str(model_dir))
    for mode in args.modes:
        with results.section(mode) as entry:
            data = run_part(Path(__file__), mode, ["--model", str(model_dir), "--out", str(out_dir)], out_dir, args.timeout,
                            env=startup_env(mode))
            entry.update(data)
            if "error" in data:
                raise RuntimeError(data["error"])
            entry["summary"] = f"register {data['register_s']} s: {data['startup']}"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "bench"))
    main()
