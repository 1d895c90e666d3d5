"""Shared by the agent-framework tests (tests/integration/test_openai_agents_real.py, test_langgraph_agent_real.py,
test_pydantic_ai_agent_real.py, test_smolagents_agent_real.py): the task, the few-shot turns, and the
check that a group of a framework's rollouts trained on exactly what the engine did (tests/qwen25.py
runs the same check on Qwen2.5's tokenizer, on CPU and on the GPU).

The task: one tool (`get_weather`), a question, then a follow-up question in the same conversation, so
every rollout makes two model calls at least, three or more when the model calls the tool. SmolLM2-135M
rarely calls a tool from the tools list alone, and examples written in the system prompt did not help
(0 calls in 16 samples, measured); earlier turns that show a question answered by a call, the tool's
result and a reply (written by the client, not sampled) make it call the tool in a share of samples
(10 of 16 first replies with a plain client; 4 or 5 of 16 rollouts in these tests).
Each test writes those turns in its framework's own message types. The assertions are about exactness,
not about the model's skill: a rollout where the model never called the tool must train exactly too.

Exactness is checked at the two ends, not on what the endpoint returned to the framework:
`EngineTap` wraps the engine's `generate` (every chat completion ends there): per call, the prompt ids
and each sample's ids and logprobs. `TrainTap` wraps the trainer's `prepare_batch`: the sequences the
step trains. `check_trained` says a trained sequence is the engine's own work: every run of trained ids
is one whole sample (ids and logprobs) of a call whose prompt was exactly every id before it, and the
sequence ends with a sample. `train_exactly` runs that over a group, with no capture refused, no
template fallback, and every trajectory trained (as one sequence, or one per part where its history parts).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

import art_nb as art
from art_nb.grpo.captured import CaptureRefused
from art_nb.grpo.tokens import training_sequences

__all__ = ["EXAMPLES", "FOLLOW_UP", "MAX_TOKENS", "QUESTION", "ROLLOUTS", "SYSTEM", "TINY", "EngineTap", "Served",
           "TrainTap", "called_tool", "check_trained", "example_reply", "rollouts_train_exactly", "served",
           "train_exactly", "weather"]

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"
SYSTEM = "You answer with a tool call when a tool can help."
EXAMPLES = [("Rome", "18 C"), ("Oslo", "9 C"), ("Cairo", "31 C")]  # (city, the tool's answer): few-shot turns
QUESTION, FOLLOW_UP = "Weather in Paris?", "Weather in Lima?"
ROLLOUTS = 16
MAX_TOKENS = 40


def weather(city: str) -> str:
    """The tool's body, the same in every framework."""
    return f"21 C and sunny in {city}"


def example_reply(city: str, answer: str) -> str:
    """The assistant's words after the tool's result, in the few-shot turns."""
    return f"It is {answer} in {city}."


@dataclass(frozen=True)
class EngineCall:
    """One `engine.generate`: the prompt ids it was given, and (ids, logprobs) per sample."""

    prompt_ids: tuple[int, ...]
    samples: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...]


class EngineTap:
    """Records every `generate` on `engine` until `monkeypatch` undoes it."""

    def __init__(self, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[EngineCall] = []
        inner = engine.generate

        async def generate(request: Any) -> Any:
            samples = await inner(request)
            self.calls.append(EngineCall(tuple(request.prompt_ids), tuple(
                (tuple(s.token_ids), tuple(s.logprobs)) for s in samples)))
            return samples

        monkeypatch.setattr(engine, "generate", generate)

    def by_prompt(self) -> dict[tuple[int, ...], list[EngineCall]]:
        index: dict[tuple[int, ...], list[EngineCall]] = {}
        for call in self.calls:
            index.setdefault(call.prompt_ids, []).append(call)
        return index


class TrainTap:
    """Records the batches the local trainer prepares (its `prepare_batch`, wrapped)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from art_nb.local.trainers import peft_trainer

        self.batches: list[Any] = []
        inner = peft_trainer.prepare_batch

        def prepare_batch(*args: Any, **kwargs: Any) -> Any:
            batch = inner(*args, **kwargs)
            self.batches.append(batch)
            return batch

        monkeypatch.setattr(peft_trainer, "prepare_batch", prepare_batch)


def check_trained(item: Any, engine_calls: dict[tuple[int, ...], list[EngineCall]]) -> int:
    """Assert that `item` (a TokenizedTrajectory the trainer trained) is the engine's own ids and
    logprobs, as the module docstring says; the number of samples in it."""
    ids, mask, logprobs = item.input_ids, item.assistant_mask, item.engine_logprobs
    assert not item.truncated and item.retokenized_choices == 0 and item.template_fallbacks == 0
    runs, at = 0, 0
    while at < len(ids):
        if not mask[at]:
            at += 1
            continue
        end = at
        while end < len(ids) and mask[end]:
            end += 1
        calls = engine_calls.get(tuple(ids[:at]))
        assert calls, f"the trained ids at {at}..{end} follow a prompt the engine was never given"
        trained = (tuple(ids[at:end]), tuple(logprobs[at:end]))
        assert any(trained in call.samples for call in calls), (
            f"the trained ids at {at}..{end} are not a sample (ids and logprobs) the engine drew for that prompt")
        runs, at = runs + 1, end
    assert runs and mask[-1], "a trained sequence ends with the last sample (nothing after it trains)"
    return runs


class Served:
    """A registered SmolLM2 with both taps on, for one test."""

    def __init__(self, backend: art.LocalBackend, model: art.TrainableModel, monkeypatch: pytest.MonkeyPatch) -> None:
        state = backend._runtime.state(model)
        self.backend, self.model, self.tokenizer = backend, model, state.trainer.tokenizer  # what training uses
        self.engine = EngineTap(state.engine, monkeypatch)
        self.trainer = TrainTap(monkeypatch)


async def served(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, name: str, max_seq_len: int = 2048) -> Served:
    backend = art.LocalBackend(path=tmp_path)
    model = art.TrainableModel(name=name, project="frameworks", base_model=TINY,
                               config=art.ModelConfig(max_seq_len=max_seq_len, lora=art.LoraConfig(rank=8, alpha=32)))
    await model.register(backend)
    return Served(backend, model, monkeypatch)


def called_tool(trajectory: art.Trajectory) -> bool:
    """Whether the model called get_weather in any of the trajectory's calls (parsed by the endpoint)."""
    return any(call.get("function", {}).get("name") == "get_weather"
               for exchange in trajectory.exchanges for choice in exchange.choices
               for call in choice.message.get("tool_calls") or [])


async def train_exactly(served: Served, group: art.TrajectoryGroup, framework: str, turns: int = 2,
                        parts: bool = False) -> dict[str, int]:
    """Assert what the module docstring says for `group` and train one step on it; the counts printed.
    Each trajectory holds `turns` model calls at least, unless its rollout logged that the agent stopped.
    With `parts`, a trajectory whose history parts trains as several sequences (grpo/captured.py), and
    every call's sample is trained exactly once over them; without, each trajectory is one sequence."""
    trajectories = group.trajectories
    refused: list[str] = []
    sequences: list[int] = []
    for t in trajectories:
        assert t.exchanges, f"the agent's calls were not recorded: {t.logs}"
        try:
            made = training_sequences(served.tokenizer, t, 10**6)
        except CaptureRefused as error:
            refused.append(str(error))
            continue
        assert parts or len(made) == 1, f"the history parted: {made[-1].parted}"
        assert all(seq.template_fallbacks == 0 and seq.retokenized_choices == 0 for seq in made)
        sequences.append(len(made))
    assert not refused, f"{len(refused)} of {len(trajectories)} refused; the first: {refused[0]}"
    for i, t in enumerate(trajectories):  # a reward for calling the tool; tied rewards train nothing
        t.reward = float(called_tool(t)) + 0.001 * i
    result = await served.model.train([group], config=art.TrainConfig(learning_rate=1e-4))
    assert result.step == await served.model.get_step()
    assert result.metrics["template_fallbacks"] == 0 and result.metrics["retokenized_choices"] == 0
    batch = served.trainer.batches[-1]
    assert len(batch.items) == sum(sequences), "every rollout is trained, each part of it a sequence"
    engine_calls = served.engine.by_prompt()
    trained = iter([check_trained(item, engine_calls) for item in batch.items])  # in the trajectories' order
    samples = [sum(next(trained) for _ in range(n)) for n in sequences]
    for t, calls in zip(trajectories, samples, strict=True):
        assert calls >= turns or any(line.startswith("agent stopped") for line in t.logs), (calls, t.logs)
        assert not parts or calls == len(t.exchanges), "every call's sample trains once"
    counts = {"rollouts": len(trajectories), "called the tool": sum(called_tool(t) for t in trajectories),
              "model calls": sum(samples), "fewest calls in a rollout": min(samples),
              "sequences": sum(sequences)}
    print(f"\n{framework}: {counts}")
    return counts


async def rollouts_train_exactly(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, framework: str,
                                 rollout: Callable[[art.TrainableModel], Awaitable[None]]) -> dict[str, int]:
    """A model served for `framework`, `ROLLOUTS` of its agent's `rollout` in one group, and `train_exactly`
    over them; the backend closed afterwards, whatever happened."""
    s = await served(tmp_path, monkeypatch, framework)
    try:
        group = await art.trajectory_group([art.trajectory(rollout(s.model)) for _ in range(ROLLOUTS)])
        assert len(group.trajectories) == ROLLOUTS
        return await train_exactly(s, group, framework)
    finally:
        await s.backend.close()
