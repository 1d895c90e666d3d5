"""Training on tokens sampled under a grammar (constrained decoding): the engine's logprob of such a
token is of the masked distribution, log p(t) - log Z (Z: the mass the grammar left), the trainer's
is log p(t). The decision (docs/losses.md): the mismatch correction weighs each token by
pi_trainer / pi_engine = Z <= 1, the step stays finite for every loss, and the metrics report it.

On the tiny random Llama of test_grpo_step.py, with masks drawn here: some positions forced (only the
sampled token allowed), the rest a random share of the vocabulary.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_grpo_step import _one_thread, sequence  # noqa: F401
from test_loss_step import lora, update

from art_nb.config import LOSSES, TrainConfig
from art_nb.grpo.logprobs import token_logprobs


def masked_engine_logprobs(model, item, seed: int) -> list[float]:
    """Set `item.engine_logprobs` to each sampled token's logprob under a random grammar mask; return the
    mass Z each mask left (per trained token, in order)."""
    ids = torch.tensor([item.input_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    generator = torch.Generator().manual_seed(seed)
    engine, left = [math.nan], []
    for position, (logit, token, trained) in enumerate(zip(logits, item.input_ids[1:], item.assistant_mask[1:])):
        if not trained:
            engine.append(math.nan)
            continue
        allowed = torch.rand(logit.shape, generator=generator) < (0.0 if position % 3 == 0 else 0.3)
        allowed[token] = True  # the grammar allowed what was sampled; every third position forced it
        masked = torch.log_softmax(logit.masked_fill(~allowed, -math.inf), -1)[token]
        unmasked = torch.log_softmax(logit, -1)[token]
        engine.append(float(masked))
        left.append(math.exp(float(unmasked - masked)))
    item.engine_logprobs = engine
    return left


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("correction", [True, False])
def test_a_step_on_masked_logprobs_is_finite_and_reports_the_mass_the_grammar_removed(loss, correction):
    model = lora()
    items = [sequence(i, 18 + 3 * i, 4, advantage=(-1.0) ** i) for i in range(3)]
    left = [z for i, item in enumerate(items) for z in masked_engine_logprobs(model, item, seed=i)]
    assert min(left) < 0.05 and max(left) <= 1.0  # forced tokens the model did not favour
    config = TrainConfig(loss=loss, importance_sampling_correction=correction)
    delta, metrics = update(copy.deepcopy(model), items, config, lr=1e-2)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["skipped_nonfinite"] == 0 and metrics["tokens_trained"] == len(left)
    assert any(torch.any(d != 0) for d in delta.values())  # the step trained
    assert metrics["mismatch_logprob_abs"] == pytest.approx(sum(-math.log(z) for z in left) / len(left), rel=1e-3)
    if correction:  # the weight is Z itself: below 1, so the cap (3.0) never acts
        assert metrics["is_weight_mean"] == pytest.approx(sum(left) / len(left), rel=1e-3)
        assert metrics["is_bounded_fraction"] == 0


def test_a_floor_with_token_mask_drops_forced_tokens_from_the_loss():
    model = lora()
    item = sequence(0, 24, 4, advantage=1.0)
    left = masked_engine_logprobs(model, item, seed=0)
    config = TrainConfig(loss="ppo", importance_sampling_mode="token_mask", importance_sampling_floor=0.1)
    _, metrics = update(copy.deepcopy(model), [item], config, lr=1e-2)
    dropped = sum(z < 0.1 for z in left)
    assert 0 < dropped < len(left)
    assert metrics["is_bounded_fraction"] == pytest.approx(dropped / len(left))
    kept = [z for z in left if z >= 0.1]
    assert metrics["is_weight_mean"] == pytest.approx(sum(kept) / len(left), rel=1e-3)


def test_the_trainer_recomputes_the_unmasked_logprob():
    """What the correction divides by: the trainer's logprob has no mask, so it sits below the engine's."""
    model = lora()
    item = sequence(1, 20, 4, advantage=1.0)
    masked_engine_logprobs(model, item, seed=1)
    ids = torch.tensor([item.input_ids])
    with torch.no_grad():
        trainer, _ = token_logprobs(model, ids, torch.ones_like(ids), chunk_tokens=64)
    pairs = [(t, e) for t, e, m in zip(trainer[0].tolist(), item.engine_logprobs[1:], item.assistant_mask[1:]) if m]
    assert all(t <= e + 1e-5 for t, e in pairs) and any(t < e - 1 for t, e in pairs)
