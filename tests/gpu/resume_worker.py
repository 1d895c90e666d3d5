"""Resume a GPU-trained model in a fresh process and print what it serves (for test_gpu_path.py).

Usage: python -m tests.gpu.resume_worker ART_PATH MODEL_DIR PROMPT_IDS_JSON; prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import art_nb as art
from art_nb.local.engines.base import GenerationRequest, SamplingParams

from .test_gpu_path import NAME, make_model


async def main(path: str, model_dir: str, prompt_ids: list[int]) -> dict:
    backend = art.LocalBackend(path=path)
    model = make_model(Path(model_dir))
    await model.register(backend)
    state = backend._state(model)
    request = GenerationRequest(prompt_ids, SamplingParams(max_tokens=16, temperature=0.0), adapter=f"{NAME}@1")
    [sample] = await backend.loop.run(state.engine.generate(request))
    result = {
        "step": await model.get_step(),
        "resume": backend.choices(model).get("resume", ""),
        "optimizer_restored": state.trainer._pending_optimizer_state is not None,
        "greedy": sample.token_ids,
    }
    await backend.close()
    return result


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))), flush=True)
