"""The loss menu through grpo_step, TrainConfig and porting; truncated-completion masking; float16 scaling.

grpo_step runs on the tiny random Llama of test_grpo_step.py; float16 runs on CPU (torch supports
the half-precision ops a Llama needs there).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import make_choice
from pydantic import ValidationError
from test_grpo_step import (  # noqa: F401
    _one_thread,
    lora_weights,
    sequence,
    tiny_llama,
    with_engine_logprobs,
)

from art_nb.config import LOSSES, TrainConfig
from art_nb.grpo.advantages import PreparedBatch, prepare_batch
from art_nb.grpo.step import grpo_step, microbatches
from art_nb.porting import train_config
from art_nb.trajectories import Trajectory, TrajectoryGroup


def lora(dtype: torch.dtype = torch.float32):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(tiny_llama().to(dtype), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def update(model, items, config, lr: float = 1.0, scaler=None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One SGD step; returns the change of every LoRA weight and the metrics."""
    before = lora_weights(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    metrics = grpo_step(model, optimizer, PreparedBatch(items=items, max_seq_len=64), config, scaler=scaler)
    return {n: w - before[n] for n, w in lora_weights(model).items()}, metrics


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_is_microbatch_invariant(loss):
    model = lora()
    items = [sequence(i, 16 + 4 * i, 4, advantage=(-1.0) ** i) for i in range(4)]
    with_engine_logprobs(model, items, shift=0.05)
    assert len(microbatches(items, 64)) > 1
    small, _ = update(copy.deepcopy(model), items, TrainConfig(loss=loss, microbatch_tokens=64, max_grad_norm=1e6))
    big, metrics = update(copy.deepcopy(model), items, TrainConfig(loss=loss, microbatch_tokens=4096, max_grad_norm=1e6))
    for name in small:
        torch.testing.assert_close(small[name], big[name], rtol=1e-4, atol=1e-7)
    assert metrics["clip_fraction"] == 0  # the old policy is the trainer's own: ratio 1, nothing clipped


def test_losses_weigh_tokens_as_documented():
    """On-policy, every loss is the policy gradient with its own token weights: dr_grpo = dapo x
    (tokens / (trajectories x constant)); gspo = ppo (ratio 1: GSPO and GRPO agree on-policy)."""
    model = lora()
    items = [sequence(i, 12 + 6 * i, 4, advantage=(-1.0) ** i) for i in range(3)]
    with_engine_logprobs(model, items)
    run = {loss: update(copy.deepcopy(model), items, TrainConfig(loss=loss, max_grad_norm=1e6, max_completion_length=10))[0]
           for loss in LOSSES}
    tokens = sum(item.trainable_tokens for item in items)
    for name in run["ppo"]:
        torch.testing.assert_close(run["gspo"][name], run["ppo"][name], rtol=1e-3, atol=1e-7)
        torch.testing.assert_close(run["dr_grpo"][name], run["dapo"][name] * tokens / (3 * 10), rtol=1e-3, atol=1e-7)
        torch.testing.assert_close(run["cispo"][name], run["ppo"][name], rtol=1e-3, atol=1e-7)
    assert not torch.allclose(run["dapo"]["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"],
                              run["ppo"]["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"])


def test_mismatch_correction_weighs_the_gradient_and_reports():
    model = lora()
    item = sequence(0, 20, 5, advantage=1.0)
    with_engine_logprobs(model, [item])
    same, _ = update(copy.deepcopy(model), [item], TrainConfig(loss="ppo", max_grad_norm=1e6))
    with_engine_logprobs(model, [item], shift=0.1)  # engine: 0.1 more likely, so pi_trainer / pi_engine = e^-0.1
    shifted, metrics = update(copy.deepcopy(model), [item], TrainConfig(loss="ppo", max_grad_norm=1e6))
    for name in same:
        torch.testing.assert_close(shifted[name], same[name] * math.exp(-0.1), rtol=1e-3, atol=1e-7)
    assert metrics["mismatch_logprob_abs"] == pytest.approx(0.1, rel=1e-4)
    assert metrics["is_weight_mean"] == pytest.approx(math.exp(-0.1), rel=1e-4)
    assert metrics["is_bounded_fraction"] == 0 and metrics["clip_fraction"] == 0
    with_engine_logprobs(model, [item], shift=-2.0)  # weight e^2 = 7.4, above the cap of 3
    capped, metrics = update(copy.deepcopy(model), [item], TrainConfig(loss="ppo", max_grad_norm=1e6))
    assert metrics["is_bounded_fraction"] == 1 and metrics["is_weight_mean"] == pytest.approx(3.0)
    for name in same:
        torch.testing.assert_close(capped[name], same[name] * 3.0, rtol=1e-3, atol=1e-7)
    masked, metrics = update(copy.deepcopy(model), [item], TrainConfig(loss="ppo", importance_sampling_mode="token_mask"))
    assert all(torch.all(d == 0) for d in masked.values()) and metrics["is_weight_mean"] == 0


def test_without_correction_the_engine_is_the_old_policy():
    model = lora()
    item = sequence(0, 20, 5, advantage=1.0)
    with_engine_logprobs(model, [item], shift=-0.5)  # ratio pi_trainer / pi_engine = e^0.5 = 1.65 > 1.2
    config = TrainConfig(loss="ppo", importance_sampling_correction=False)
    delta, metrics = update(copy.deepcopy(model), [item], config)
    assert metrics["clip_fraction"] == 1  # ART's way: PPO's clip takes the mismatch, and the gradient with it
    assert all(torch.all(d == 0) for d in delta.values())


def test_float16_gradients_underflow_without_the_scaler_and_match_float32_with_it():
    items = [sequence(i, 20, 4, advantage=(-1.0) ** i * 1e-6) for i in range(2)]  # tiny advantages
    config = TrainConfig(loss="ppo", max_grad_norm=1e6, importance_sampling_correction=False)
    reference, _ = update(lora(torch.float32), items, config)
    plain, _ = update(lora(torch.float16), items, config)
    scaler = torch.amp.GradScaler("cpu")
    scaled, metrics = update(lora(torch.float16), items, config, scaler=scaler)

    def relative_error(delta):
        diff = torch.cat([(delta[n] - reference[n]).flatten() for n in reference])
        return float(diff.norm() / torch.cat([r.flatten() for r in reference.values()]).norm())

    assert relative_error(plain) > 0.5  # most of float16's gradient is lost under 6e-8
    assert relative_error(scaled) < 0.01
    assert metrics["grad_scale"] == 65536.0 and metrics["skipped_nonfinite"] == 0


def test_scaler_overflow_skips_the_step_and_lowers_the_scale():
    model = lora(torch.float16)
    items = [sequence(i, 20, 4, advantage=(-1.0) ** i * 1e4) for i in range(2)]  # x 65536 overflows float16
    scaler = torch.amp.GradScaler("cpu")
    delta, metrics = update(model, items, TrainConfig(loss="ppo"), scaler=scaler)
    assert metrics["skipped_nonfinite"] == 1 and metrics["grad_scale"] == 32768.0
    assert all(torch.all(d == 0) for d in delta.values())


# ---- TrainConfig and porting ------------------------------------------------------------------------

def test_each_loss_has_its_defaults():
    defaults = {loss: TrainConfig(loss=loss) for loss in LOSSES}
    assert (defaults["cispo"].epsilon, defaults["cispo"].epsilon_high) == (1.0, 4.0)
    assert (defaults["ppo"].epsilon, defaults["ppo"].epsilon_high) == (0.2, None)
    assert (defaults["dapo"].epsilon, defaults["dapo"].epsilon_high) == (0.2, 0.28)
    assert (defaults["gspo"].epsilon, defaults["gspo"].epsilon_high, defaults["gspo"].importance_sampling_level) == (
        3e-4, 4e-4, "sequence")
    assert defaults["dr_grpo"].scale_rewards is False and defaults["ppo"].scale_rewards is True
    assert TrainConfig(loss="dr_grpo", scale_rewards=True).scale_rewards is True  # the user's choice stays
    default = TrainConfig()
    assert (default.loss, default.importance_sampling_correction, default.importance_sampling_mode,
            default.importance_sampling_cap, default.mask_truncated_completions) == (
        "cispo", True, "token_truncate", 3.0, False)


@pytest.mark.parametrize(("fields", "message"), [
    ({"loss": "gspo", "importance_sampling_level": "token"}, "sequence-level ratio"),
    ({"importance_sampling_cap": 0.5}, "cap >= 1"),
    ({"importance_sampling_floor": 3.0, "importance_sampling_cap": 2.0}, "must be below"),
    ({"loss": "grpo"}, "cispo"),
    ({"importance_sampling_mode": "token"}, "token_truncate"),
])
def test_config_refuses_with_a_reason(fields, message):
    with pytest.raises(ValidationError, match=message):
        TrainConfig(**fields)


def test_porting_maps_art_and_trl_knobs():
    assert train_config(None, {"loss_fn": "grpo"}, "t").loss == "ppo"
    assert train_config(None, {"loss_type": "bnpo"}, "t").loss == "dapo"
    assert train_config(None, {"normalize_by_length": False}, "t").loss == "dr_grpo"
    assert train_config(None, {"importance_sampling_level": "sequence", "ppo": True}, "t").importance_sampling_level == "sequence"
    tis = train_config(None, {"truncated_importance_sampling": 2.0}, "t")
    assert (tis.importance_sampling_mode, tis.importance_sampling_cap) == ("token_truncate", 2.0)
    trl = train_config(None, {"vllm_importance_sampling_correction": False, "vllm_importance_sampling_mode": "sequence_mask",
                              "vllm_importance_sampling_clip_max": 5.0, "vllm_importance_sampling_clip_min": 0.5,
                              "mask_truncated_completions": True, "max_completion_length": 256}, "t")
    assert (trl.importance_sampling_correction, trl.importance_sampling_mode, trl.importance_sampling_cap,
            trl.importance_sampling_floor, trl.mask_truncated_completions, trl.max_completion_length) == (
        False, "sequence_mask", 5.0, 0.5, True, 256)
    with pytest.raises(ValueError, match="'token' or 'sequence'"):
        train_config(None, {"importance_sampling_level": "geometric_average"}, "t")
    with pytest.raises(ValueError, match="'dr_grpo'"):
        train_config(None, {"loss_fn": "sapo"}, "t")


# ---- truncated completions --------------------------------------------------------------------------

def answer(tokenizer, reward: float, finished: bool) -> Trajectory:
    messages = [{"role": "user", "content": "Two plus two?"}, make_choice(tokenizer, "Four.", eos=finished)]
    return Trajectory(messages_and_choices=messages, reward=reward)


@pytest.mark.parametrize("mask", [False, True])
def test_truncated_completions_can_leave_the_loss(chatml_tokenizer, mask):
    tok = chatml_tokenizer
    group = TrajectoryGroup([answer(tok, 1.0, True), answer(tok, 0.0, False), answer(tok, 0.0, True)])
    batch = prepare_batch([group], tok, TrainConfig(mask_truncated_completions=mask), max_seq_len=4096)
    assert len(batch.items) == (2 if mask else 3) and batch.masked_truncated == (1 if mask else 0)
    # the group's advantages still include the cut answer: rewards (1, 0, 0) -> (sqrt 2, -1/sqrt 2, -1/sqrt 2)
    assert [item.advantage for item in batch.items][:2] == pytest.approx([2**0.5, -(0.5**0.5)], abs=1e-5)
    shortest = min(len(item.input_ids) for item in batch.items)
    cut = prepare_batch([group], tok, TrainConfig(mask_truncated_completions=True), max_seq_len=shortest - 3)
    assert cut.items == [] and cut.masked_truncated == 3  # cut by max_seq_len inside the answer counts too
    assert batch.metrics()["masked_truncated"] == batch.masked_truncated
