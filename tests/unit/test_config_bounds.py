"""Every number a client may set is bounded in the config models, so a local user and `art-nb serve`
refuse the same values, naming the field and the limit (20,000 CPU threads killed the server:
"libgomp: Thread creation failed"; a seed of 2**70 was answered 409 "conflict")."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from art_nb.config import LoraConfig, ModelConfig, TrainConfig
from art_nb.store import MAX_STEP, ModelStore
from art_nb.wire import DeleteBody, LogBody


@pytest.mark.parametrize(("make", "field", "value", "limit"), [
    (ModelConfig, "cpu_threads", 20_000, "1024"),
    (ModelConfig, "max_batch_size", 10**9, "4096"),
    (ModelConfig, "max_seq_len", 10**9, "1048576"),
    (ModelConfig, "prefix_cache_gib", 1e9, "1024"),
    (ModelConfig, "seed", 2**70, "4294967296"),
    (ModelConfig, "seed", -1, "0"),
    (ModelConfig, "max_loaded_adapters", 10**6, "256"),
    (LoraConfig, "rank", 10**6, "512"),
    (LoraConfig, "alpha", 1e30, "65536"),
    (TrainConfig, "microbatch_tokens", 10**12, "1048576"),
    (TrainConfig, "logprob_chunk_tokens", 10**12, "1048576"),
    (TrainConfig, "max_completion_length", 10**12, "1048576"),
    (TrainConfig, "max_nonfinite_steps", 10**12, "1000000"),
])
def test_each_bound_is_refused_naming_the_field_and_the_limit(make, field, value, limit):
    with pytest.raises(ValidationError) as info:
        make(**{field: value})
    error = info.value.errors()[0]
    assert error["loc"] == (field,) and limit in error["msg"], error


def test_the_bounds_leave_real_settings_alone():
    ModelConfig(cpu_threads=768, max_batch_size=1024, max_seq_len=131_072, seed=2**32 - 1, prefix_cache_gib=64,
                lora=LoraConfig(rank=512, alpha=1024), max_loaded_adapters=16)
    TrainConfig(microbatch_tokens=262_144, max_completion_length=32_768)
    with pytest.raises(ValidationError, match="at most 64"):
        LoraConfig(target_modules=tuple(f"m{i}" for i in range(65)))


def test_steps_are_bounded_on_the_wire_and_in_the_store(tmp_path):
    """`log(step=10**400)` answered 500 "File name too long": a step names files."""
    for body in (LogBody, DeleteBody):
        field = "step" if body is LogBody else "steps"
        value = 10**400 if body is LogBody else [10**400]
        with pytest.raises(ValidationError) as info:
            body.model_validate({field: value})
        assert info.value.errors()[0]["loc"][0] == field and "1000000000" in info.value.errors()[0]["msg"]
    assert LogBody.model_validate({"step": MAX_STEP}).step == MAX_STEP
    store = ModelStore(tmp_path, "p", "m")
    for step in (10**400, MAX_STEP + 1, -1):
        with pytest.raises(ValueError, match="step must be from 0 to 1,000,000,000"):
            store.trajectory_file("val", step)
        with pytest.raises(ValueError, match="step must be from 0 to"):
            store.checkpoint_dir(step)
