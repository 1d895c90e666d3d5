"""ART's knobs on art_nb's configs (art_nb.porting) and ART's model handle, without a model loaded."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import art_nb as art
from art_nb.porting import model_config, train_config
from art_nb.records import UnknownMetricError
from art_nb.types import InferenceEndpoint, TrainResult

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_train_config_has_arts_defaults():
    config = art.TrainConfig()
    assert (config.learning_rate, config.loss, config.kl_penalty_coef) == (5e-6, "cispo", 0.0)
    assert (config.epsilon, config.epsilon_high) == (1.0, 4.0)  # ART's CISPO clip range
    ppo = art.TrainConfig(loss="ppo")
    assert (ppo.epsilon, ppo.epsilon_high) == (0.2, None)  # PPO: symmetric 0.2, as in ART


def test_backend_train_arguments_map_onto_train_config():
    config = train_config(None, {"learning_rate": 1e-5, "loss_fn": "ppo", "kl_penalty_coef": 0.1,
                                 "normalize_advantages": False, "logprob_calculation_chunk_size": 8,
                                 "packed_sequence_length": 4096, "epsilon_high": 0.3}, "test")
    assert (config.learning_rate, config.loss, config.kl_penalty_coef, config.scale_rewards) == (1e-5, "ppo", 0.1, False)
    assert (config.logprob_chunk_tokens, config.microbatch_tokens, config.epsilon, config.epsilon_high) == (8, 4096, 0.2, 0.3)


def test_arguments_apply_over_a_config_and_the_loss_default_follows_the_loss():
    base = art.TrainConfig(learning_rate=3e-5, weight_decay=0.1)  # CISPO, epsilon 1.0 by default
    config = train_config(base, {"ppo": True}, "test")  # the older _config={"ppo": True}
    assert (config.learning_rate, config.weight_decay, config.loss, config.epsilon) == (3e-5, 0.1, "ppo", 0.2)
    assert train_config(art.TrainConfig(epsilon=0.5), {"loss_fn": "ppo"}, "test").epsilon == 0.5  # the user's stays


def test_an_unknown_loss_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="'cispo'.*'ppo'"):
        train_config(None, {"loss_fn": "dro"}, "test")


def test_internal_config_and_lora_config_map_onto_model_config():
    internal = art.dev.InternalModelConfig(
        init_args=art.dev.InitArgs(max_seq_length=4096, load_in_4bit=True, dtype="bfloat16"),
        engine_args=art.dev.EngineArgs(gpu_memory_utilization=0.8, enforce_eager=True, max_num_seqs=32),
        peft_args=art.dev.PeftArgs(r=16, lora_alpha=32),
        trainer_gpu_ids=[0],
    )
    with pytest.warns(UserWarning) as caught:
        config = model_config(art.ModelConfig(engine="hf"), internal, art.dev.LoRAConfig(dropout=0.05))
    assert (config.engine, config.max_seq_len, config.load_in_4bit, config.dtype) == ("hf", 4096, True, "bfloat16")
    assert (config.gpu_memory_utilization, config.max_batch_size) == (0.8, 32)
    assert (config.lora.rank, config.lora.alpha, config.lora.dropout) == (16, 32, 0.05)
    reported = " ".join(str(w.message) for w in caught)
    assert config.vllm_startup == "eager"  # enforce_eager maps; trainer_gpu_ids has no equivalent
    assert "engine_args.enforce_eager" not in reported and "_internal_config.trainer_gpu_ids" in reported


def test_sleep_mode_off_and_max_model_len():
    config = model_config(art.ModelConfig(), {"engine_args": {"enable_sleep_mode": False, "max_model_len": 1024}}, None)
    assert config.sleep_during_training is False and config.max_seq_len == 1024


class UserConfig(BaseModel):
    requires_reasoning: bool = False


def test_the_users_own_config_stays_theirs():
    model = art.TrainableModel(name="m", project="p", base_model=BASE, config=UserConfig(requires_reasoning=True))
    assert model.config.requires_reasoning and model.backend_config == art.ModelConfig()
    mine = art.TrainableModel(name="m", base_model=BASE, config=art.ModelConfig(max_seq_len=512))
    assert mine.backend_config.max_seq_len == 512


def test_internal_config_set_after_construction_reaches_the_backend_config():
    model = art.TrainableModel(name="m", base_model=BASE, config=art.ModelConfig(max_seq_len=512),
                               lora_config=art.dev.LoRAConfig(rank=4, alpha=8))
    model._internal_config = art.dev.InternalModelConfig(init_args=art.dev.InitArgs(max_seq_length=8192))
    assert (model.backend_config.max_seq_len, model.backend_config.lora.rank) == (8192, 4)
    assert model.config.max_seq_len == 512  # the model's own config object is not changed


class StubBackend:
    """What a backend gives the handle: an endpoint, served names, and the calls it records."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.step = 2

    async def register(self, model: Any) -> None:
        self.calls.append(("register", model.name))

    def in_process_http_client(self, model: Any) -> None:  # the protocol's: no in-process endpoint here
        return None

    def inference_endpoint(self, model: Any) -> InferenceEndpoint:
        return InferenceEndpoint(base_url="http://127.0.0.1:9/v1", api_key="sk-local-secret")

    def inference_model_name(self, model: Any, step: int | None = None) -> str:
        return f"{model.name}@{self.step if step is None else step}"

    async def get_step(self, model: Any) -> int:
        return self.step

    async def train(self, model: Any, groups: Any, config: Any = None, *, on_progress: Any = None) -> TrainResult:
        self.calls.append(("train", config))
        return TrainResult(step=self.step + 1)

    async def train_sft(self, model: Any, trajectories: Any, config: Any = None, _config: Any = None,
                        verbose: bool = False, *, on_progress: Any = None) -> TrainResult:
        self.calls.append(("train_sft", (len(trajectories), config)))
        return TrainResult(step=self.step + 1)

    async def log(self, model: Any, trajectories: Any, split: str = "val", step: Any = None, metrics: Any = None) -> dict:
        self.calls.append(("log", (split, step, metrics, [len(g) for g in trajectories])))
        return {}

    async def delete_checkpoints(self, model: Any, steps: Any = None, keep_last: int = 1, *,
                                 best_metric: str | None = None) -> list[int]:
        self.calls.append(("delete", (steps, keep_last, best_metric)))
        return []

    def model_dir(self, model: Any) -> Path:
        return Path("/nonexistent")


async def test_register_fills_the_inference_fields_and_keeps_the_key_out_of_repr():
    backend = StubBackend()
    model = art.TrainableModel(name="agent", project="p", base_model=BASE)
    await model.register(backend)
    assert (model.inference_base_url, model.inference_api_key, model.inference_model_name) == (
        "http://127.0.0.1:9/v1", "sk-local-secret", "agent@2")
    assert model.get_inference_name() == "agent@2" and model.get_inference_name(0) == "agent@0"
    assert "sk-local-secret" not in repr(model) and "sk-local-secret" not in model.model_dump_json()
    params = model.litellm_completion_params()
    assert (params["model"], params["base_url"], params["temperature"]) == ("hosted_vllm/agent@2", model.inference_base_url, 1)


async def test_a_baseline_model_uses_its_own_endpoint_and_name():
    backend = StubBackend()
    baseline = art.Model(name="base", project="p", inference_base_url="http://other/v1", inference_api_key="k",
                         inference_model_name=BASE)
    await baseline.register(backend)
    assert baseline.get_inference_name() == BASE and await baseline.get_step() == 0
    assert str(baseline.openai_client().base_url) == "http://other/v1/"
    await baseline.log([art.Trajectory(), art.Trajectory(), ValueError("x")])
    assert backend.calls[-1] == ("log", ("val", None, None, [2]))  # loose items: one group, as in ART


async def test_log_metrics_alone_and_the_older_train_call():
    backend = StubBackend()
    model = art.TrainableModel(name="agent", base_model=BASE)
    await model.register(backend)
    await model.log(trajectories=None, split="train", metrics={"loss": 0.5}, step=3)
    assert backend.calls[-1] == ("log", ("train", 3, {"loss": 0.5}, []))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        await model.train(trajectory_groups=[], config=art.TrainConfig(learning_rate=3e-5),
                          _config={"logprob_calculation_chunk_size": 8, "ppo": True}, verbose=True)
    sent = backend.calls[-1][1]
    assert (sent.learning_rate, sent.logprob_chunk_tokens, sent.loss) == (3e-5, 8, "ppo")
    await model.train_sft([art.Trajectory()], art.TrainSFTConfig(learning_rate=1e-4))
    assert backend.calls[-1] == ("train_sft", (1, art.TrainSFTConfig(learning_rate=1e-4)))


async def test_delete_checkpoints_forms():
    backend = StubBackend()
    model = art.TrainableModel(name="agent", base_model=BASE)
    await model.register(backend)
    await model.delete_checkpoints()
    await model.delete_checkpoints("train/reward")
    await model.delete_checkpoints(steps=[1, 2])
    await model.delete_checkpoints([3])
    await model.delete_checkpoints(keep_last=2)
    assert [c[1] for c in backend.calls if c[0] == "delete"] == [
        (None, 1, "val/reward"), (None, 1, "train/reward"), ([1, 2], 1, None), ([3], 1, None), (None, 2, None)]


async def test_a_metric_nobody_logged_is_refused_but_arts_default_falls_back_with_a_warning(caplog):
    """ART's `delete_checkpoints()` prints that val/reward is missing and keeps only the latest; a metric
    named by the caller that no step has is a typo and deletes nothing (`UnknownMetricError`)."""

    class NoValBackend(StubBackend):
        async def delete_checkpoints(self, model: Any, steps: Any = None, keep_last: int = 1, *,
                                     best_metric: str | None = None) -> list[int]:
            if best_metric is not None:
                raise UnknownMetricError(f"best_metric {best_metric!r}: no logged step has a value of it, so no "
                                         "checkpoint would be kept as the best; nothing was deleted. Metrics in "
                                         "the history: 'train/reward'")
            return await super().delete_checkpoints(model, steps, keep_last)

    backend = NoValBackend()
    model = art.TrainableModel(name="agent", base_model=BASE)
    await model.register(backend)
    with pytest.raises(UnknownMetricError, match="val/rewrad"):
        await model.delete_checkpoints("val/rewrad")
    with pytest.raises(UnknownMetricError):
        await model.delete_checkpoints("val/reward")  # named: the caller meant it
    assert not [c for c in backend.calls if c[0] == "delete"]
    with caplog.at_level("WARNING", logger="art_nb"):
        await model.delete_checkpoints()
    assert [c[1] for c in backend.calls if c[0] == "delete"] == [(None, 1, None)]
    assert "ART's default metric" in caplog.text and "'train/reward'" in caplog.text
    assert "every checkpoint but the served one is deleted" in caplog.text and "nothing was deleted" not in caplog.text


def test_rewards_mcp_langgraph_import_with_arts_names_and_load_nothing_heavy():
    import asyncio
    import subprocess
    import sys

    from art_nb import langgraph, mcp, rewards

    # Each is built and tested in its own file (test_ruler.py, test_mcp.py, test_langgraph.py).
    assert len(asyncio.run(rewards.ruler_score_group(art.TrajectoryGroup([]), "openai/o4-mini"))) == 0
    assert {"init_chat_model", "wrap_rollout"} <= set(langgraph.__all__)
    assert {"MCPTool", "MCPResource", "GeneratedScenario", "GeneratedScenarioCollection", "complete_task_tool",
            "generate_scenarios"} <= set(mcp.__all__)
    loaded = subprocess.run([sys.executable, "-c", "import sys, art_nb.langgraph, art_nb.mcp; print(sorted("
                             "m for m in ('langchain_openai', 'langgraph', 'mcp') if m in sys.modules))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"  # the packages load when a helper first needs them


def test_local_backend_takes_arts_arguments_and_closes_as_a_context_manager(tmp_path, recwarn):
    with art.LocalBackend(in_process=False, path=str(tmp_path), gpu_cost_per_hour_usd=3.0) as backend:
        loop = backend.loop
        assert art.LocalBackend(path=tmp_path).loop is loop  # one runtime per path while open
    assert art.LocalBackend(path=tmp_path).loop is not loop  # closed on exit: the next one starts fresh
    assert any("gpu_cost_per_hour_usd" in str(w.message) for w in recwarn)

    async def use() -> None:
        async with art.LocalBackend(path=tmp_path / "b") as inner:
            assert inner.path == (tmp_path / "b").resolve()

    import asyncio

    asyncio.run(use())


def test_art_enforce_eager_starts_vllm_eager_and_false_keeps_the_default() -> None:
    eager = model_config(art.ModelConfig(), {"engine_args": {"enforce_eager": True}}, None)
    default = model_config(art.ModelConfig(), {"engine_args": {"enforce_eager": False}}, None)
    assert eager.vllm_startup == "eager"
    assert default.vllm_startup is None
