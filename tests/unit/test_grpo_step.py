"""grpo_step and token_logprobs on a real, tiny, randomly initialised Llama with a peft LoRA."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from art_nb.config import TrainConfig
from art_nb.grpo.advantages import PreparedBatch
from art_nb.grpo.logprobs import token_logprobs
from art_nb.grpo.step import grpo_step, microbatches
from art_nb.grpo.tokens import TokenizedTrajectory

VOCAB = 100


@pytest.fixture(autouse=True)
def _one_thread(one_thread):  # tests/conftest.py
    yield


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)


@pytest.fixture
def lora_model():
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    # peft starts B at zero (no change to the model); give it a value so every LoRA weight has a gradient.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def reference_logprobs(model, input_ids, attention_mask):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()[:, :-1]
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1), entropy


def padded_batch():
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (2, 20), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 14:] = 0  # right padding
    return input_ids, attention_mask


@pytest.mark.parametrize("wrap", ["peft", "plain"])
def test_chunked_logprobs_equal_the_full_forward(lora_model, wrap):
    model = lora_model if wrap == "peft" else tiny_llama()
    input_ids, attention_mask = padded_batch()
    lp, entropy = token_logprobs(model, input_ids, attention_mask, chunk_tokens=6)  # 3 positions a chunk
    ref_lp, ref_entropy = reference_logprobs(model, input_ids, attention_mask)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(entropy, ref_entropy)
    assert not entropy.requires_grad

    assert_same_lora_gradients(model, lp, ref_lp, attention_mask[:, 1:])


def assert_same_lora_gradients(model, lp, ref_lp, where) -> None:
    """A weighted sum of `lp` over `where` has the same gradient as the same sum of `ref_lp`."""
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.linspace(-1, 1, lp.numel()).view_as(lp) * where
    grads = torch.autograd.grad((lp * weights).sum(), params)
    ref_grads = torch.autograd.grad((ref_lp * weights).sum(), params)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref)


def test_logprobs_at_chosen_positions_match_the_full_pass(lora_model):
    """The lm head runs only where `positions` is set; values and gradients there must not change."""
    input_ids, attention_mask = padded_batch()
    positions = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1, dtype=torch.bool)
    positions[0, 5:9] = True
    positions[1, 10:13] = True
    lp, entropy = token_logprobs(lora_model, input_ids, attention_mask, chunk_tokens=4, positions=positions)
    full_lp, full_entropy = token_logprobs(lora_model, input_ids, attention_mask, chunk_tokens=64)
    torch.testing.assert_close(lp[positions], full_lp[positions])
    torch.testing.assert_close(entropy[positions], full_entropy[positions])
    assert torch.all(lp[~positions] == 0) and torch.all(entropy[~positions] == 0)

    assert_same_lora_gradients(lora_model, lp, full_lp, positions)


def test_no_chosen_positions_gives_zeros(lora_model):
    input_ids, attention_mask = padded_batch()
    positions = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1, dtype=torch.bool)
    lp, entropy = token_logprobs(lora_model, input_ids, attention_mask, chunk_tokens=8, positions=positions)
    assert lp.shape == positions.shape and not lp.any() and not entropy.any()


def test_logit_softcapping_is_applied():
    model = tiny_llama()
    model.config.final_logit_softcapping = 0.5
    input_ids, attention_mask = padded_batch()
    lp, _ = token_logprobs(model, input_ids, attention_mask, chunk_tokens=16)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        capped = torch.log_softmax(torch.tanh(logits / 0.5) * 0.5, dim=-1)
    torch.testing.assert_close(lp.detach(), capped.gather(-1, input_ids[:, 1:, None]).squeeze(-1))


def sequence(seed: int, length: int, prompt: int, advantage: float) -> TokenizedTrajectory:
    ids = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    mask = [i >= prompt for i in range(length)]
    return TokenizedTrajectory(ids, mask, [math.nan] * length, advantage=advantage)


def with_engine_logprobs(model, items: list[TokenizedTrajectory], shift: float = 0.0) -> None:
    """Fill the sampled positions with what the model itself assigns now (plus `shift`)."""
    for item in items:
        ids = torch.tensor([item.input_ids])
        with torch.no_grad():
            lp, _ = token_logprobs(model, ids, torch.ones_like(ids), chunk_tokens=64)
        item.engine_logprobs = [math.nan] + [
            v + shift if m else math.nan for v, m in zip(lp[0].tolist(), item.assistant_mask[1:])
        ]


def sampled_logprob(model, item: TokenizedTrajectory) -> float:
    ids = torch.tensor([item.input_ids])
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, torch.ones_like(ids), chunk_tokens=64)
    return float((lp[0] * torch.tensor(item.assistant_mask[1:])).sum())


def lora_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("loss", ["ppo", "cispo"])
def test_steps_raise_positive_and_lower_negative_sequences(lora_model, loss):
    good, bad = sequence(0, 24, 8, advantage=1.0), sequence(1, 18, 6, advantage=-1.0)
    with_engine_logprobs(lora_model, [good, bad])
    batch = PreparedBatch(items=[good, bad], groups=1)
    config = TrainConfig(loss=loss, learning_rate=1e-2)
    optimizer = torch.optim.AdamW([p for p in lora_model.parameters() if p.requires_grad], lr=1e-2)
    before = lora_weights(lora_model)
    good_before, bad_before = sampled_logprob(lora_model, good), sampled_logprob(lora_model, bad)

    history = [grpo_step(lora_model, optimizer, batch, config) for _ in range(4)]

    first = history[0]
    assert first["skipped_nonfinite"] == 0 and first["trajectories"] == 2
    assert first["tokens_trained"] == (24 - 8) + (18 - 6)
    assert first["mismatch_kl"] == pytest.approx(0.0, abs=1e-6)  # engine logprobs are the model's own
    assert first["grad_norm"] > 0 and first["entropy"] > 0
    after = lora_weights(lora_model)
    assert all(not torch.equal(before[n], after[n]) for n in before)
    assert sampled_logprob(lora_model, good) > good_before
    assert sampled_logprob(lora_model, bad) < bad_before
    if loss == "ppo":  # PPO's surrogate falls as the ratios move towards the advantages
        assert history[-1]["loss"] < history[0]["loss"]
    assert all(p.grad is None for p in lora_model.parameters())


def test_mismatch_kl_is_the_k3_estimate(lora_model):
    item = sequence(0, 20, 5, advantage=1.0)
    with_engine_logprobs(lora_model, [item], shift=0.1)  # engine says 0.1 more likely than trainer
    optimizer = torch.optim.SGD([p for p in lora_model.parameters() if p.requires_grad], lr=0.0)
    metrics = grpo_step(lora_model, optimizer, PreparedBatch(items=[item]), TrainConfig())
    # r = p_trainer / p_engine = exp(-0.1): r - 1 - log r
    assert metrics["mismatch_kl"] == pytest.approx(math.exp(-0.1) - 1 + 0.1, rel=1e-4)


def test_nonfinite_loss_skips_without_touching_weights(lora_model):
    items = [sequence(0, 20, 5, advantage=1.0), sequence(1, 20, 5, advantage=math.nan)]
    optimizer = torch.optim.AdamW([p for p in lora_model.parameters() if p.requires_grad], lr=1e-2)
    before = lora_weights(lora_model)
    metrics = grpo_step(lora_model, optimizer, PreparedBatch(items=items), TrainConfig())
    assert metrics["skipped_nonfinite"] == 1 and metrics["tokens_trained"] == 0
    after = lora_weights(lora_model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(p.grad is None for p in lora_model.parameters())
    assert not optimizer.state  # Adam did not count a step either


def test_microbatching_does_not_change_the_update(lora_model):
    items = [sequence(i, 16 + 4 * i, 4, advantage=(-1.0) ** i) for i in range(4)]
    with_engine_logprobs(lora_model, items, shift=0.05)
    config_small = TrainConfig(microbatch_tokens=64, max_grad_norm=1e6)
    config_big = TrainConfig(microbatch_tokens=4096, max_grad_norm=1e6)
    assert len(microbatches(items, 64)) > 1 and len(microbatches(items, 4096)) == 1

    updates = []
    for config in (config_small, config_big):
        model = copy.deepcopy(lora_model)
        before = lora_weights(model)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        metrics = grpo_step(model, optimizer, PreparedBatch(items=items), config)
        updates.append({n: w - before[n] for n, w in lora_weights(model).items()})
        assert metrics["trajectories"] == 4
    for name in updates[0]:
        torch.testing.assert_close(updates[0][name], updates[1][name], rtol=1e-4, atol=1e-6)


def test_microbatches_respect_the_token_budget():
    items = [sequence(i, n, 1, 1.0) for i, n in enumerate([10, 40, 30, 20, 70])]
    groups = microbatches(items, 64)
    assert sorted(len(i.input_ids) for g in groups for i in g) == [10, 20, 30, 40, 70]
    for group in groups:
        assert len(group) == 1 or len(group) * max(len(i.input_ids) for i in group) <= 64


def test_empty_batch_does_nothing(lora_model):
    optimizer = torch.optim.AdamW([p for p in lora_model.parameters() if p.requires_grad], lr=1e-2)
    metrics = grpo_step(lora_model, optimizer, PreparedBatch(), TrainConfig())
    assert metrics["trajectories"] == 0 and metrics["skipped_nonfinite"] == 0 and not optimizer.state


def test_progress_arrives_once_per_microbatch_in_order(lora_model):
    items = [sequence(i, 16 + 4 * i, 4, advantage=(-1.0) ** i) for i in range(4)]
    total = len(microbatches(items, 64))
    assert total > 1
    optimizer = torch.optim.SGD([p for p in lora_model.parameters() if p.requires_grad], lr=0.1)
    events: list[dict] = []

    metrics = grpo_step(lora_model, optimizer, PreparedBatch(items=items), TrainConfig(microbatch_tokens=64),
                        on_progress=events.append)

    assert [e["done"] for e in events] == list(range(1, total + 1))
    assert all(e["phase"] == "train" and e["total"] == total for e in events)
    tokens = [e["tokens"] for e in events]
    assert tokens == sorted(tokens) and tokens[0] > 0
    assert events[-1]["tokens"] == metrics["tokens_trained"] == sum(16 + 4 * i - 4 for i in range(4))
    assert "stopped" not in metrics


@pytest.mark.parametrize("stop_at_call", ["first", "before_optimizer"])
def test_should_stop_abandons_the_step_before_the_optimizer_steps(lora_model, stop_at_call):
    items = [sequence(i, 16 + 4 * i, 4, advantage=(-1.0) ** i) for i in range(4)]
    total = len(microbatches(items, 64))
    calls = {"n": 0}
    stop_on = 1 if stop_at_call == "first" else total + 1  # asked before each microbatch, then before the step

    def should_stop() -> bool:
        calls["n"] += 1
        return calls["n"] >= stop_on

    optimizer = torch.optim.AdamW([p for p in lora_model.parameters() if p.requires_grad], lr=1e-2)
    before = lora_weights(lora_model)
    events: list[dict] = []
    metrics = grpo_step(lora_model, optimizer, PreparedBatch(items=items), TrainConfig(microbatch_tokens=64),
                        should_stop=should_stop, on_progress=events.append)

    assert metrics["stopped"] == 1 and metrics["tokens_trained"] == 0 and metrics["skipped_nonfinite"] == 0
    assert calls["n"] == stop_on
    assert len(events) == stop_on - 1  # every microbatch that ran reported; none after the stop
    after = lora_weights(lora_model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(p.grad is None for p in lora_model.parameters())
    assert not optimizer.state


def test_kl_penalty_uses_the_base_model_and_changes_the_update(lora_model):
    """kl_penalty_coef > 0: the reference is the model with its adapter disabled (peft's
    disable_adapter), the penalty is in the loss, and it changes the update."""
    items = [sequence(0, 24, 8, advantage=1.0), sequence(1, 18, 6, advantage=-1.0)]
    with_engine_logprobs(lora_model, items)
    start = copy.deepcopy(lora_model.state_dict())

    def step(coef: float) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        lora_model.load_state_dict(start)
        optimizer = torch.optim.SGD([p for p in lora_model.parameters() if p.requires_grad], lr=0.5)
        metrics = grpo_step(lora_model, optimizer, PreparedBatch(items=items), TrainConfig(kl_penalty_coef=coef),
                            reference=lora_model.disable_adapter)
        return metrics, lora_weights(lora_model)

    plain, plain_weights = step(0.0)
    penalised, penalised_weights = step(5.0)
    # The LoRA's B is not zero, so the policy differs from the base: a positive KL, reported.
    assert penalised["reference_kl"] > 0 and plain["reference_kl"] == 0
    assert penalised["loss"] > plain["loss"]
    assert any(not torch.allclose(plain_weights[n], penalised_weights[n]) for n in plain_weights)

    # reference_kl is the mean over trained tokens of the k3 estimate e^d - d - 1, d = base - policy,
    # computed here from full forward passes of the model with and without its adapter.
    lora_model.load_state_dict(start)
    total, tokens = 0.0, 0
    for item in items:
        ids = torch.tensor([item.input_ids])
        mask = torch.tensor(item.assistant_mask[1:])
        with torch.no_grad():
            policy, _ = reference_logprobs(lora_model, ids, torch.ones_like(ids))
            with lora_model.disable_adapter():
                base, _ = reference_logprobs(lora_model, ids, torch.ones_like(ids))
        d = (base - policy)[0][mask]
        total += float((torch.exp(d) - d - 1).sum())
        tokens += int(mask.sum())
    assert penalised["reference_kl"] == pytest.approx(total / tokens, rel=2e-3)  # float32 e^d - d - 1 at d ~ 1e-2


def test_kl_penalty_without_a_reference_is_refused(lora_model):
    item = sequence(0, 20, 5, advantage=1.0)
    optimizer = torch.optim.SGD([p for p in lora_model.parameters() if p.requires_grad], lr=0.0)
    with pytest.raises(ValueError, match="kl_penalty_coef"):
        grpo_step(lora_model, optimizer, PreparedBatch(items=[item]), TrainConfig(kl_penalty_coef=0.1))
