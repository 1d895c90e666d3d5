"""A vLLM engine dies behind the real LocalBackend; registering the model again starts a new one.
Runs under .venv-vllm/bin/python, not pytest:

    .venv-vllm/bin/python tests/vllm_cpu/backend_check.py MODEL_DIR WORK_DIR RESULT.json

The engine is made to really die: vLLM's in-process engine core is shut down and its distributed
state torn down (as 0.32's shutdown does; 0.11.2's leaves it), on the engine's own vLLM thread (as a
crash inside it would leave it) while three requests are decoding, so the next step() raises, all
three fail with EngineDeadError, and `dead_reason` turns non-None. What vLLM's error tells the user,
"re-register the model", must then work: `register` on the same backend replaces the engine and a
chat completion through the model's OpenAI client succeeds. Before the kill and once the new engine
serves, a two-turn conversation checks that the second prompt vLLM is given begins with the first
prompt + the ids it sampled (server/turns.py). Last, an SFT step: the new engine then serves the
adapter the trainer holds (the same greedy reply). Each stage appends to RESULT.json; test_vllm_engine_cpu.py asserts.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

PROMPT = [{"role": "user", "content": "Name three colours, separated by commas."}]
SFT_REPLY = "Banana, mango, kiwi."


def trainer_greedy(state: Any, max_new_tokens: int) -> str:
    """The trainer's own greedy reply to PROMPT (transformers' generate on its LoRA model)."""
    import torch

    tokenizer, peft_model = state.engine.tokenizer, state.trainer.model
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = peft_model.generate(**ids.to(peft_model.device), max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


async def main(model_dir: Path, work: Path, result_path: Path) -> None:
    import openai

    import art_nb as art

    result: dict[str, Any] = {}

    def save(key: str, value: Any) -> None:
        result[key] = value
        result_path.write_text(json.dumps(result, indent=1, default=str))

    async def chat() -> Any:
        return await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=PROMPT, max_tokens=8, temperature=0.0)

    async def two_turns() -> dict[str, Any]:
        """Whether the second prompt vLLM is given begins with the first prompt + the ids it sampled."""
        client = model.openai_client()
        first = await client.chat.completions.create(model=model.get_inference_name(), messages=PROMPT, max_tokens=8)
        reply = first.choices[0]
        messages = [*PROMPT, {"role": "assistant", "content": reply.message.content}, {"role": "user", "content": "More."}]
        second = await client.chat.completions.create(model=model.get_inference_name(), messages=messages, max_tokens=4)
        head = first.model_extra["prompt_token_ids"] + reply.model_extra["token_ids"]
        return {"extends": second.model_extra["prompt_token_ids"][: len(head)] == head, "sampled": len(head)}

    backend = art.LocalBackend(path=work)
    config = art.ModelConfig(engine="vllm", trainer="peft", max_seq_len=512, max_batch_size=8,
                             lora=art.LoraConfig(rank=8, alpha=16))
    model = art.TrainableModel(name="revive", project="vllm-cpu", base_model=str(model_dir), config=config)
    try:
        await model.register(backend)
        first = backend._state(model).engine
        save("engine", type(first).__name__)
        before = await chat()
        save("served_before", {"model": before.model, "text": before.choices[0].message.content})
        save("two_turns_before", await two_turns())

        # Requests in flight when vLLM dies: the step that raises fails every one of them.
        from art_nb.local.engines.base import EngineDeadError, GenerationRequest, SamplingParams

        prompt = first.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
        params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
        flying = [asyncio.create_task(first.generate(GenerationRequest(list(prompt), params))) for _ in range(3)]
        await asyncio.sleep(0.5)  # they are decoding now
        core = first._engine.engine_core

        def kill() -> None:  # what 0.32's EngineCore.shutdown does; 0.11.2's leaves the model able to step
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            core.shutdown()
            cleanup_dist_env_and_memory()

        await first._thread.call(kill)  # between two steps, as a crash inside vLLM would land
        outcomes = await asyncio.gather(*flying, return_exceptions=True)
        save("in_flight", [type(o).__name__ for o in outcomes])
        save("in_flight_dead", all(isinstance(o, EngineDeadError) for o in outcomes))
        try:
            await chat()
            save("request_after_kill", {"failed": False})
        except openai.APIStatusError as error:
            save("request_after_kill", {"failed": True, "status": error.status_code, "message": str(error)})
        save("dead_reason", first.dead_reason)

        await model.register(backend)  # what re-running the register cell does
        second = backend._state(model).engine
        save("replaced", second is not first)
        save("new_engine", {"type": type(second).__name__, "dead_reason": second.dead_reason})
        save("choices", backend.choices(model))
        after = await chat()
        save("served_after", {"model": after.model, "text": after.choices[0].message.content,
                              "finish_reason": after.choices[0].finish_reason})
        save("two_turns_after", await two_turns())  # the new engine's tokenizer keeps sampled turns too

        # A warm start: the adapter an SFT step hands the (new) engine is the one the trainer holds
        demo = [*PROMPT, {"role": "assistant", "content": SFT_REPLY}]
        await model.train_sft([art.Trajectory(messages_and_choices=demo) for _ in range(6)],
                              art.TrainSFTConfig(learning_rate=2e-3, batch_size=1))
        save("sft_served", {"model": (reply := await chat()).model, "text": reply.choices[0].message.content})
        save("sft_trainer", trainer_greedy(backend._state(model), max_new_tokens=8))
    finally:
        await backend.close()
    save("closed", True)


if __name__ == "__main__":  # vLLM may spawn processes: keep the entry point guarded
    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])))
