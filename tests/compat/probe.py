"""The ART calls real ART examples make, each checked against art_nb: `python tests/compat/probe.py`.

The list comes from the examples in tests/compat/ and the ones they were chosen from
(OpenPipe/art-notebooks: tic-tac-toe, 2048, art-e, mcp-rl, langgraph, temporal-clue, auto_rl;
OpenPipe/ART examples/: 2048, art_e, tic_tac_toe; ART 0.5.18's own signatures). Each entry is one
call an ART user writes; its check runs it the cheap way (no model is loaded: calls that need a
backend use `StubBackend`, or check that the real LocalBackend method accepts the arguments), so the
whole probe takes a second. A check passes when it returns without raising. tests/compat/test_probe.py
asserts every entry passes; the real runs are the examples next to this file.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

import art_nb as art

CHECKS: list[tuple[str, Callable[[], Any]]] = []


def check(name: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    def add(func: Callable[[], Any]) -> Callable[[], Any]:
        CHECKS.append((name, func))
        return func

    return add


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def accepts(func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """`func` can be called with these arguments (its signature binds them)."""
    inspect.signature(func).bind(*args, **kwargs)


class StubBackend:
    """A backend that serves nothing: enough for what the model handle does with one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.logged: list[tuple[Any, ...]] = []
        self.step = 0

    async def register(self, model: Any) -> None: ...

    def __call__(self) -> StubBackend:  # as art_nb's backends: ART code reaches one as `model.backend()`
        return self

    def choices(self, model: Any) -> dict[str, str]:
        return {}

    def in_process_http_client(self, model: Any) -> None:  # the protocol's: no in-process endpoint here
        return None

    def inference_endpoint(self, model: Any) -> Any:
        from art_nb.types import InferenceEndpoint

        return InferenceEndpoint(base_url="http://127.0.0.1:9/v1", api_key="stub-key")

    def inference_model_name(self, model: Any, step: int | None = None) -> str:
        return f"{model.name}@{self.step if step is None else step}"

    async def get_step(self, model: Any) -> int:
        return self.step

    async def train(self, model: Any, groups: Any, config: Any = None, *, on_progress: Any = None,
                    **kwargs: Any) -> Any:
        from art_nb.types import TrainResult

        self.step += 1
        return TrainResult(step=self.step, metrics={"loss": 0.0})

    async def train_sft(self, model: Any, trajectories: Any, config: Any = None, _config: Any = None,
                        verbose: bool = False, *, on_progress: Any = None) -> Any:
        from art_nb.types import TrainResult

        self.step += 1
        return TrainResult(step=self.step, metrics={"loss": 0.0})

    async def log(self, model: Any, trajectories: Any, split: str = "val", step: int | None = None,
                  metrics: Any = None) -> dict[str, float]:
        self.logged.append((split, step, metrics, list(trajectories)))
        return {}

    async def wait_for_checkpoint(self, model: Any) -> int:
        return self.step

    def model_dir(self, model: Any) -> Path:
        return self.path / model.project / "models" / model.name

    async def delete_checkpoints(self, model: Any, steps: Any = None, keep_last: int = 1) -> list[int]:
        return []

    async def close(self) -> None: ...


STUB = StubBackend(Path("/tmp/art_nb_probe"))


class UserConfig(BaseModel):
    requires_reasoning: bool = False


def trainable(**kwargs: Any) -> Any:
    return art.TrainableModel(name="agent-001", project="probe", base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
                              **kwargs)


async def rollout(reward: float = 1.0) -> Any:
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=reward)


async def broken() -> Any:
    raise ValueError("the environment broke")


# ---- imports ART code writes ------------------------------------------------------------------

for module in ["art_nb.local", "art_nb.local.backend", "art_nb.serverless", "art_nb.serverless.backend",
               "art_nb.utils", "art_nb.utils.strip_logprobs", "art_nb.utils.iterate_dataset",
               "art_nb.utils.limit_concurrency", "art_nb.utils.retry", "art_nb.rewards", "art_nb.mcp",
               "art_nb.langgraph", "art_nb.dev", "art_nb.types", "art_nb.trajectories", "art_nb.gather"]:
    check(f"import {module.replace('art_nb', 'art')}")(lambda module=module: importlib.import_module(module))

for name in ["LocalBackend"]:
    check(f"from art.local import {name}")(lambda name=name: importlib.import_module("art_nb.local").__dict__[name])
check("from art.local.backend import LocalBackend")(
    lambda: importlib.import_module("art_nb.local.backend").LocalBackend)
check("from art.serverless.backend import ServerlessBackend")(
    lambda: importlib.import_module("art_nb.serverless.backend").ServerlessBackend)
check("from art.utils import iterate_dataset")(lambda: importlib.import_module("art_nb.utils").iterate_dataset)
check("from art.utils import limit_concurrency")(lambda: importlib.import_module("art_nb.utils").limit_concurrency)
check("from art.utils.strip_logprobs import strip_logprobs")(
    lambda: importlib.import_module("art_nb.utils.strip_logprobs").strip_logprobs)
check("from art.rewards import ruler_score_group")(lambda: importlib.import_module("art_nb.rewards").ruler_score_group)
check("from art.langgraph import init_chat_model, wrap_rollout")(
    lambda: (importlib.import_module("art_nb.langgraph").init_chat_model,
             importlib.import_module("art_nb.langgraph").wrap_rollout))
check("from art.mcp import MCPTool, MCPResource, generate_scenarios")(
    lambda: [importlib.import_module("art_nb.mcp").__dict__[n] for n in ("MCPTool", "MCPResource", "generate_scenarios")])
for name in ["Trajectory", "TrajectoryGroup", "TrainableModel", "Model", "TrainConfig", "TrainResult", "Backend",
             "Messages", "MessagesAndChoices", "Tools", "gather_trajectory_groups", "gather_trajectories", "retry",
             "dev", "LocalBackend", "ServerlessBackend", "TrainSFTConfig", "LocalTrainResult", "utils", "LoRAConfig",
             "trajectory_group_batches", "auto_trajectory", "capture_auto_trajectory", "yield_trajectory",
             "capture_yielded_trajectory", "ServerlessTrainResult"]:
    check(f"art.{name}")(lambda name=name: getattr(art, name))
for name in ["InternalModelConfig", "InitArgs", "EngineArgs", "PeftArgs", "TrainerArgs", "LoRAConfig",
             "TrainConfig", "OpenAIServerConfig", "ServerArgs"]:
    check(f"art.dev.{name}")(lambda name=name: getattr(art.dev, name))


# ---- Trajectory ---------------------------------------------------------------------------------

@check("art.Trajectory(messages_and_choices=, reward=0, metadata={...})")
def _() -> None:
    art.Trajectory(messages_and_choices=[{"role": "system", "content": "x"}], reward=0,
                   metadata={"notebook-id": "2048", "step": 0})


@check("trajectory.messages_and_choices.append(...); trajectory.messages()")
def _() -> None:
    t = art.Trajectory(messages_and_choices=[], reward=0)
    t.messages_and_choices.append({"role": "user", "content": "board"})
    assert t.messages() == [{"role": "user", "content": "board"}]


@check("trajectory.metrics['win'] = 0.5; trajectory.reward = 1")
def _() -> None:
    t = art.Trajectory(reward=0)
    t.metrics["win"] = 0.5
    t.reward = 1


@check("trajectory.tools = [...]")
def _() -> None:
    t = art.Trajectory()
    t.tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]


@check("trajectory.logs.append(...); trajectory.log(...)")
def _() -> None:
    t = art.Trajectory()
    t.logs.append("a")
    t.log("b")
    assert t.logs == ["a", "b"]


@check("trajectory.finish()")
def _() -> None:
    t = art.Trajectory()
    assert t.finish() is t and "duration" in t.metrics


@check("async with trajectory.track_duration('llm')")
def _() -> None:
    async def go() -> None:
        t = art.Trajectory()
        async with t.track_duration("llm"):
            pass
        assert "llm_duration" in t.metrics

    run(go())


@check("trajectory.for_logging()")
def _() -> None:
    assert "messages" in art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}]).for_logging()


@check("Trajectory(additional_histories=[History(...)])")
def _() -> None:
    from art_nb.trajectories import History

    art.Trajectory(additional_histories=[History(messages_and_choices=[{"role": "user", "content": "x"}])])


@check("class ProjectTrajectory(art.Trajectory): final_answer: ... = None")
def _() -> None:
    class ProjectTrajectory(art.Trajectory):
        final_answer: str | None = None

    t = ProjectTrajectory(reward=0.0, messages_and_choices=[])
    t.final_answer = "42"


@check("Trajectory(initial_policy_version=, final_policy_version=)")
def _() -> None:
    art.Trajectory(initial_policy_version=0, final_policy_version=1)


# ---- TrajectoryGroup -----------------------------------------------------------------------------

@check("art.TrajectoryGroup(generator of rollouts)")
def _() -> None:
    art.TrajectoryGroup(rollout() for _ in range(2))


@check("art.TrajectoryGroup(trajectories=[...])")
def _() -> None:
    art.TrajectoryGroup(trajectories=[art.Trajectory()])


@check("await art.TrajectoryGroup(rollouts)")
def _() -> None:
    async def go() -> None:
        group = await art.TrajectoryGroup(rollout(r) for r in (0, 1))
        assert group.rewards() == [0, 1]

    run(go())


@check("TrajectoryGroup(exceptions=[ValueError(...)])")
def _() -> None:
    group = art.TrajectoryGroup([art.Trajectory()], exceptions=[ValueError("x")])
    assert group.exceptions[0].message == "x"


@check("TrajectoryGroup([trajectory, exception])")
def _() -> None:
    group = art.TrajectoryGroup([art.Trajectory(), ValueError("x")])
    assert len(group) == 1 and len(group.exceptions) == 1


@check("TrajectoryGroup(metrics=, logs=); group.log(...)")
def _() -> None:
    group = art.TrajectoryGroup([art.Trajectory()], metrics={"m": 1.0}, logs=["a"])
    group.log("b")
    assert group.logs == ["a", "b"] and group.metrics == {"m": 1.0}


@check("group.trajectories; len(group); for t in group")
def _() -> None:
    group = art.TrajectoryGroup([art.Trajectory(reward=1)])
    assert len(group.trajectories) == len(group) == len(list(group)) == 1


# ---- gather ----------------------------------------------------------------------------------------

@check("await art.gather_trajectory_groups((TrajectoryGroup(...) for ...), pbar_desc=, max_exceptions=)")
def _() -> None:
    groups = run(art.gather_trajectory_groups((art.TrajectoryGroup(rollout() for _ in range(2)) for _ in range(2)),
                                              pbar_desc=None, max_exceptions=1))
    assert len(groups) == 2


@check("gather_trajectory_groups(after_each=async returning a list)")
def _() -> None:
    async def split(group: Any) -> list[Any]:
        return [group, group]

    groups = run(art.gather_trajectory_groups([art.TrajectoryGroup([rollout()])], pbar_desc=None, after_each=split))
    assert len(groups) == 2


@check("gather_trajectory_groups(max_metrics=)")
def _() -> None:
    run(art.gather_trajectory_groups([art.TrajectoryGroup([rollout()])], pbar_desc=None, max_metrics=1))


@check("gather_trajectory_groups of coroutines returning groups")
def _() -> None:
    async def make() -> Any:
        return art.TrajectoryGroup([await rollout()])

    assert len(run(art.gather_trajectory_groups([make(), make()], pbar_desc=None))) == 2


@check("max_exceptions=0 re-raises the rollout's own error")
def _() -> None:
    try:
        run(art.gather_trajectory_groups([art.TrajectoryGroup([broken()])], pbar_desc=None))
    except ValueError:
        return
    raise AssertionError("expected the rollout's ValueError")


@check("a tool result with tool_call_id 'n/a' when no call was made (ART's rock-paper-scissors notebook)")
def _() -> None:
    async def played() -> Any:
        t = art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=0)
        t.messages_and_choices.extend(({"role": "tool", "tool_call_id": "n/a", "content": "r"},
                                       {"role": "tool", "content": "no id at all"}))
        t.reward += 1
        return t

    groups = run(art.gather_trajectory_groups([art.TrajectoryGroup([rollout(), played()])], pbar_desc=None))
    assert len(groups[0]) == 2 and not groups[0].exceptions


@check("await art.gather_trajectories(...) returns failures in place")
def _() -> None:
    result = run(art.gather_trajectories([rollout(), broken()], pbar_desc=None, max_exceptions=1))
    assert isinstance(result[0], art.Trajectory) and isinstance(result[1], ValueError)


@check("@art.retry(exceptions=(SomeError,)) on an async rollout")
def _() -> None:
    calls = []

    @art.retry(exceptions=(KeyError,), delay=0)
    async def flaky() -> int:
        calls.append(1)
        if len(calls) < 2:
            raise KeyError
        return 1

    assert run(flaky()) == 1


@check("@art.retry(exceptions=SomeError) (one class, not a tuple)")
def _() -> None:
    @art.retry(exceptions=(KeyError), delay=0)
    async def fine() -> int:
        return 1

    assert run(fine()) == 1


@check("art.retry(on_retry=, backoff_factor=) keeps a sync function sync")
def _() -> None:
    seen = []

    @art.retry(max_attempts=2, delay=0, backoff_factor=1.0, on_retry=lambda e, n: seen.append(n))
    def flaky() -> int:
        if not seen:
            raise RuntimeError
        return 1

    assert flaky() == 1 and seen == [1]


@check("art.utils.limit_concurrency(n, derive_key=)")
def _() -> None:
    from art_nb.utils import limit_concurrency

    @limit_concurrency(1, derive_key=lambda x: str(x))
    async def f(x: int) -> int:
        return x

    run(f(1))


@check("art.utils.iterate_dataset(items, groups_per_step=, num_epochs=, initial_step=)")
def _() -> None:
    from art_nb.utils import iterate_dataset

    batches = list(iterate_dataset(list(range(5)), groups_per_step=2, num_epochs=1, initial_step=0, use_tqdm=False))
    assert [b.step for b in batches] == [0, 1, 2] and batches[0].epoch == 0 and batches[0].epoch_step == 0


@check("strip_logprobs(obj)")
def _() -> None:
    from art_nb.utils.strip_logprobs import strip_logprobs

    assert strip_logprobs({"logprobs": 1, "a": [{"logprobs": 2}]}) == {"a": [{}]}


# ---- models ---------------------------------------------------------------------------------------

@check("art.TrainableModel(name=, project=, base_model=)")
def _() -> None:
    trainable()


@check("art.TrainableModel(config=<the user's own pydantic config>)")
def _() -> None:
    assert trainable(config=UserConfig(requires_reasoning=True)).config.requires_reasoning


@check("art.TrainableModel(_internal_config=art.dev.InternalModelConfig(...))")
def _() -> None:
    trainable(_internal_config=art.dev.InternalModelConfig(init_args=art.dev.InitArgs(max_seq_length=4096)))


@check("model._internal_config = art.dev.InternalModelConfig(...) after construction")
def _() -> None:
    model = trainable()
    model._internal_config = art.dev.InternalModelConfig(engine_args=art.dev.EngineArgs(gpu_memory_utilization=0.8))


@check("art.TrainableModel(lora_config=art.dev.LoRAConfig(rank=, alpha=))")
def _() -> None:
    trainable(lora_config=art.dev.LoRAConfig(rank=4, alpha=8))


@check("art.TrainableModel(run_name=, entity=, report_metrics=, base_path=)")
def _() -> None:
    trainable(run_name="r", entity="e", report_metrics=[], base_path=".art")


@check("art.Model(name=, project=, inference_model_name=, inference_api_key=, inference_base_url=)")
def _() -> None:
    art.Model(name="gpt-4o-mini", project="probe", inference_model_name="gpt-4o-mini", inference_api_key="k",
              inference_base_url="https://api.openai.com/v1")


@check("art.Model(config=<the user's own config>)")
def _() -> None:
    art.Model(name="o4-mini", project="probe", config=UserConfig(requires_reasoning=True))


@check("model.trainable / model.name / model.project / model.base_model")
def _() -> None:
    model = trainable()
    assert model.trainable and model.name and model.project and model.base_model


@check("await model.register(backend) sets inference_base_url/api_key/model_name")
def _() -> None:
    model = trainable()
    run(model.register(STUB))
    assert model.inference_base_url and model.inference_api_key and model.inference_model_name


@check("AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)")
def _() -> None:
    from openai import AsyncOpenAI

    model = trainable()
    run(model.register(STUB))
    AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)


@check("model.get_inference_name() names the step (name@N)")
def _() -> None:
    model = trainable()
    run(model.register(STUB))
    assert model.get_inference_name() == f"agent-001@{STUB.step}"


@check("model.get_inference_name(step=3)")
def _() -> None:
    model = trainable()
    run(model.register(STUB))
    assert model.get_inference_name(step=3) == "agent-001@3"


@check("await art.Model(...).register(backend) (a baseline, for logging)")
def _() -> None:
    run(art.Model(name="baseline", project="probe", inference_base_url="http://x/v1").register(STUB))


@check("model.openai_client()")
def _() -> None:
    model = trainable()
    run(model.register(STUB))
    model.openai_client()


@check("model.backend() (a method in ART)")
def _() -> None:
    model = trainable()
    run(model.register(STUB))
    assert model.backend() is STUB


@check("model.openai_client() before register raises ART's ValueError")
def _() -> None:
    try:
        trainable().openai_client()
    except ValueError as error:
        assert str(error).startswith("OpenAI client not yet available on this trainable model.")
        return
    raise AssertionError("expected a ValueError")


@check("art.Model(name='gpt-4.1', ...).litellm_completion_params() without an endpoint")
def _() -> None:
    params = art.Model(name="gpt-4.1", project="probe").litellm_completion_params()
    assert params == {"model": "gpt-4.1", "base_url": None, "api_key": None, "temperature": 1}


@check("async for batch in art.trajectory_group_batches(groups, batch_size=)")
def _() -> None:
    async def batches() -> list[list[Any]]:
        return [b async for b in art.trajectory_group_batches(
            (art.TrajectoryGroup([rollout()]) for _ in range(3)), batch_size=2, pbar_desc=None)]

    assert [len(b) for b in run(batches())] == [2, 1]


@check("await art.capture_auto_trajectory(coro); art.auto_trajectory(required=True)")
def _() -> None:
    async def agent() -> None:
        art.auto_trajectory(required=True).reward = 1.0

    assert run(art.capture_auto_trajectory(agent())).reward == 1.0


@check("await art.capture_yielded_trajectory(coro); art.yield_trajectory(t)")
def _() -> None:
    async def agent() -> None:
        art.yield_trajectory(art.Trajectory(reward=2.0))

    assert run(art.capture_yielded_trajectory(agent())).reward == 2.0


@check("model.litellm_completion_params()")
def _() -> None:
    model = trainable()
    run(model.register(STUB))
    assert model.litellm_completion_params()["model"] == "hosted_vllm/agent-001@" + str(STUB.step)


@check("await model.get_step()")
def _() -> None:
    model = trainable()
    run(model.register(STUB))
    run(model.get_step())


@check("await art.Model(...).get_step() (0 for a model that is not trained)")
def _() -> None:
    assert run(art.Model(name="baseline", project="probe").get_step()) == 0


@check("await model.log(groups, split='train', step=, metrics=)")
def _() -> None:
    model = trainable()
    run(model.register(STUB))
    run(model.log([art.TrajectoryGroup([art.Trajectory()])], split="train", step=1, metrics={"loss": 0.1}))


@check("await model.log(metrics=..., step=...) without trajectories")
def _() -> None:
    model = trainable()
    run(model.register(STUB))
    run(model.log(metrics={"loss": 0.5}, step=1))


@check("await model.log(trajectories=None, split='train', metrics=...)")
def _() -> None:
    model = trainable()
    run(model.register(STUB))
    run(model.log(trajectories=None, split="train", metrics={"loss": 0.5}))


@check("await model.log([trajectory, ...], split='val')")
def _() -> None:
    model = trainable()
    run(model.register(STUB))
    run(model.log([art.Trajectory()], split="val"))


@check("await model.delete_checkpoints()")
def _() -> None:
    accepts(art.TrainableModel.delete_checkpoints, trainable())


@check("await model.delete_checkpoints('val/correct')")
def _() -> None:
    accepts(art.TrainableModel.delete_checkpoints, trainable(), "val/correct")


@check("await model.delete_checkpoints(best_checkpoint_metric='train/reward')")
def _() -> None:
    accepts(art.TrainableModel.delete_checkpoints, trainable(), best_checkpoint_metric="train/reward")


@check("await model.train(groups, config=art.TrainConfig(learning_rate=))")
def _() -> None:
    model = trainable()
    run(model.register(STUB))
    run(model.train([art.TrajectoryGroup([art.Trajectory()])], config=art.TrainConfig(learning_rate=1e-5)))


@check("await model.train(groups, config=..., _config={'logprob_calculation_chunk_size': 8}, verbose=True)")
def _() -> None:
    model = trainable()
    run(model.register(STUB))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(model.train([art.TrajectoryGroup([art.Trajectory()])], config=art.TrainConfig(learning_rate=1e-5),
                        _config={"logprob_calculation_chunk_size": 8}, verbose=True))


@check("model.train_sft(trajectories, art.TrainSFTConfig(learning_rate=, batch_size=, assistant_turns=))")
def _() -> None:
    model = trainable()
    run(model.register(STUB))
    demo = art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "hello"}])
    config = art.TrainSFTConfig(learning_rate=[1e-4], batch_size=2, assistant_turns="last")
    run(model.train_sft([demo], config, _config=art.dev.TrainSFTConfig(metric_logging={"enabled": True})))


# ---- TrainConfig -------------------------------------------------------------------------------------

@check("art.TrainConfig(learning_rate=, kl_penalty_coef=, grad_accumulation_sequences=)")
def _() -> None:
    art.TrainConfig(learning_rate=1e-5, kl_penalty_coef=0.1, grad_accumulation_sequences=4)


@check("art.TrainConfig() has ART's defaults (lr 5e-6, CISPO, no KL)")
def _() -> None:
    config = art.TrainConfig()
    assert config.learning_rate == 5e-6 and config.loss == "cispo" and config.kl_penalty_coef == 0.0


@check("TrainResult.step / .metrics")
def _() -> None:
    result = art.TrainResult(step=1, metrics={"loss": 0.0})
    assert result.step == 1 and result.metrics == {"loss": 0.0}


# ---- LocalBackend ------------------------------------------------------------------------------------

@check("LocalBackend() / LocalBackend(path=) / LocalBackend(in_process=True, path=)")
def _() -> None:
    accepts(art.LocalBackend)
    accepts(art.LocalBackend, path="./.art")
    accepts(art.LocalBackend, in_process=True, path="./.art")


@check("with LocalBackend() as backend / async with")
def _() -> None:
    for name in ("__enter__", "__exit__", "__aenter__", "__aexit__"):
        assert name in vars(art.LocalBackend), name


@check("await backend.train(model, groups, learning_rate=...)")
def _() -> None:
    accepts(art.LocalBackend.train, object(), trainable(), [], learning_rate=1e-5)


@check("backend.train(..., loss_fn=, epsilon=, kl_penalty_coef=, scale_rewards=, ...)")
def _() -> None:
    accepts(art.LocalBackend.train, object(), trainable(), [], learning_rate=1e-5, loss_fn="ppo", epsilon=0.2,
            epsilon_high=0.3, kl_penalty_coef=0.1, scale_rewards=False, normalize_advantages=True,
            logprob_calculation_chunk_size=512, save_checkpoint=True, verbose=False)


@check("await backend._experimental_pull_from_s3(model, verbose=True)")
def _() -> None:
    accepts(art.LocalBackend._experimental_pull_from_s3, object(), trainable(), verbose=True)


@check("await backend._experimental_push_to_s3(model)")
def _() -> None:
    accepts(art.LocalBackend._experimental_push_to_s3, object(), trainable())


@check("await backend.close()")
def _() -> None:
    accepts(art.LocalBackend.close, object())


# ---- RULER, LangGraph, MCP -----------------------------------------------------------------

@check("ruler_score_group(group, judge_model, ...) with ART's signature")
def _() -> None:
    from art_nb.rewards import DEFAULT_RUBRIC, ruler, ruler_score_group

    accepts(ruler, [], "openai/o3", None, DEFAULT_RUBRIC, None, debug=False)
    accepts(ruler_score_group, art.TrajectoryGroup([]), "openai/o4-mini", {}, None, swallow_exceptions=True,
            debug=True)
    assert len(run(ruler_score_group(art.TrajectoryGroup([]), "openai/o4-mini"))) == 0


@check("wrap_rollout(model, rollout)(...) and init_chat_model(model.get_inference_name(), temperature=1.0) inside it")
def _() -> None:
    from art_nb.langgraph import init_chat_model, wrap_rollout

    model = art.Model(name="agent", inference_base_url="http://127.0.0.1:9/v1", inference_api_key="k")

    async def rollout(model: art.Model, scenario: str) -> art.Trajectory:
        chat_model = init_chat_model(model.get_inference_name(), temperature=1.0)
        return art.Trajectory(messages_and_choices=[], reward=0.0, metadata={"model": chat_model.model_name,
                                                                             "url": chat_model.openai_api_base})

    traj = run(wrap_rollout(model, rollout)(model, "s"))
    assert traj.metadata == {"model": "agent", "url": "http://127.0.0.1:9/v1"}
    accepts(init_chat_model, None, model_provider=None, configurable_fields=None, config_prefix=None,
            chat_model=None, timeout_seconds=60.0, temperature=1.0)


@check("generate_scenarios(tools, resources, num_scenarios=, show_preview=, custom_instructions=, generator_*=)")
def _() -> None:
    from art_nb.mcp import MCPTool, generate_scenarios

    accepts(generate_scenarios, [MCPTool("t", "d", {})], [], num_scenarios=24, show_preview=True,
            custom_instructions="x", generator_model="openai/gpt-4.1-mini", generator_api_key="k",
            generator_base_url="https://openrouter.ai/api/v1")


def main() -> int:
    failures = []
    for name, func in CHECKS:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                func()
        except BaseException as error:  # noqa: BLE001 - a probe reports every failure, whatever it is
            failures.append((name, f"{type(error).__name__}: {str(error)[:120]}"))
    for name, why in failures:
        print(f"FAIL  {name}\n      {why}")
    print(f"{len(CHECKS) - len(failures)}/{len(CHECKS)} ART calls work")
    return len(failures)


if __name__ == "__main__":
    raise SystemExit(1 if main() else 0)
