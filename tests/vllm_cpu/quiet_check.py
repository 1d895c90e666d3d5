"""A quiet register with vLLM's CPU build behind the real LocalBackend. Runs under .venv-vllm/bin/python,
not pytest:

    .venv-vllm/bin/python tests/vllm_cpu/quiet_check.py MODEL_DIR WORK_DIR RESULT.json

Registers a model (vLLM imported, configured and started during register, as in a fresh notebook
kernel), prints the choices as the notebooks do, sends the first rollout's request and closes. What
this process printed is the cell's output (test_vllm_quiet_cpu.py reads it); RESULT.json holds the
model's logs/register.log.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path


async def main(model_dir: Path, work: Path, result_path: Path) -> None:
    import art_nb as art

    backend = art.LocalBackend(path=work)
    config = art.ModelConfig(engine="vllm", trainer="peft", max_seq_len=512, max_batch_size=8,
                             lora=art.LoraConfig(rank=8, alpha=16))
    model = art.TrainableModel(name="quiet", project="vllm-cpu", base_model=str(model_dir), config=config)
    try:
        await model.register(backend)
        for what, why in backend.choices(model).items():
            print(f"{what}: {why}")
        reply = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": "Hi"}], max_tokens=4, logprobs=True)
        print("first rollout:", reply.choices[0].finish_reason)
    finally:
        await backend.close()
    log = backend.model_dir(model) / "logs" / "register.log"
    result_path.write_text(json.dumps({"log": log.read_text()}))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])))
