"""SFT's pure part: which tokens are labels, batching and learning rates, and the step's loss and update."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from art_nb import TrainSFTConfig, Trajectory
from art_nb.grpo.sft import SFTBatch, prepare_sft_batches, sft_step, tokenize_sft
from art_nb.grpo.tokens import TokenizedTrajectory
from tests.conftest import make_choice

VOCAB = 100


@pytest.fixture(autouse=True)
def _one_thread(one_thread):  # tests/conftest.py
    yield


def labelled_text(tokenizer, item: TokenizedTrajectory) -> list[str]:
    """The label tokens, decoded run by run."""
    runs, current = [], []
    for token, on in zip(item.input_ids, item.assistant_mask):
        if on:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def two_turns() -> Trajectory:
    return Trajectory(messages_and_choices=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "And the weather in Paris?"},
        {"role": "assistant", "content": "sunny"},
        {"role": "user", "content": "Thanks"},  # after the last assistant turn: dropped
    ])


def test_labels_are_exactly_the_assistant_turns_and_their_end_token(chatml_tokenizer):
    item = tokenize_sft(chatml_tokenizer, two_turns(), max_seq_len=4096)
    assert labelled_text(chatml_tokenizer, item) == ["four<|im_end|>", "sunny<|im_end|>"]
    # the whole sequence is the template's rendering up to the last assistant turn, token for token
    rendered = chatml_tokenizer.apply_chat_template(two_turns().messages()[:5], tokenize=False)
    assert chatml_tokenizer.decode(item.input_ids) == rendered
    assert item.trainable_tokens == sum(item.assistant_mask)  # the first token is never a label


def test_last_turn_only_keeps_earlier_turns_as_context(chatml_tokenizer):
    every = tokenize_sft(chatml_tokenizer, two_turns(), max_seq_len=4096, assistant_turns="all")
    last = tokenize_sft(chatml_tokenizer, two_turns(), max_seq_len=4096, assistant_turns="last")
    assert last.input_ids == every.input_ids
    assert labelled_text(chatml_tokenizer, last) == ["sunny<|im_end|>"]


def test_a_sampled_choice_trains_its_own_ids(chatml_tokenizer):
    choice = make_choice(chatml_tokenizer, "four")  # one id per character, as a sampler may produce
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "2+2?"}, choice])
    item = tokenize_sft(chatml_tokenizer, trajectory, max_seq_len=4096)
    labels = [t for t, on in zip(item.input_ids, item.assistant_mask) if on]
    assert labels == choice.model_extra["token_ids"]


def test_batches_rates_and_drops(chatml_tokenizer):
    long = Trajectory(messages_and_choices=[{"role": "user", "content": "x " * 400},
                                            {"role": "assistant", "content": "four"}])
    no_answer = Trajectory(messages_and_choices=[{"role": "user", "content": "hello"}])
    config = TrainSFTConfig(batch_size=2, learning_rate=[1e-4, 5e-5])
    batches = prepare_sft_batches([two_turns(), long, no_answer, two_turns()], chatml_tokenizer, config, 256)
    assert [b.learning_rate for b in batches] == [1e-4, 5e-5]
    assert [len(b.items) for b in batches] == [1, 1]
    assert (batches[0].dropped_too_long, batches[1].without_labels) == (1, 1)
    with pytest.raises(ValueError, match="one rate per batch"):
        prepare_sft_batches([two_turns()] * 5, chatml_tokenizer, config, 256)
    assert TrainSFTConfig().resolved_batch_size == 2  # ART's "auto"


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="batch_size"):
        TrainSFTConfig(batch_size=0)
    with pytest.raises(ValueError, match="learning_rate"):
        TrainSFTConfig(learning_rate=[1e-4, math.nan])
    with pytest.raises(ValueError):
        TrainSFTConfig(assistant_turns="first")


def tiny_lora():
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def item(ids: list[int], labels: list[int]) -> TokenizedTrajectory:
    mask = [i in labels for i in range(len(ids))]
    return TokenizedTrajectory(input_ids=ids, assistant_mask=mask, engine_logprobs=[math.nan] * len(ids))


def hand_loss(model, items: list[TokenizedTrajectory]) -> torch.Tensor:
    """Mean NLL over every label token of the batch, from full logits (no chunking, no microbatches)."""
    total, count = torch.zeros(()), 0
    for it in items:
        ids = torch.tensor([it.input_ids])
        logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, :-1], dim=-1)
        for pos in range(1, len(it.input_ids)):
            if it.assistant_mask[pos]:
                total = total - logp[pos - 1, it.input_ids[pos]]
                count += 1
    return total / count


def test_step_loss_matches_hand_computation_and_lowers_it():
    model = tiny_lora()
    items = [item([1, 5, 7, 9, 11, 13], labels=[3, 4, 5]), item([2, 6, 8, 10], labels=[2, 3])]
    batch = SFTBatch(items=items, learning_rate=1e-2)
    expected = float(hand_loss(model, items).detach())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)
    # microbatches of one sequence each: the sum of the shares is still the batch mean
    metrics = sft_step(model, optimizer, batch, TrainSFTConfig(), microbatch_tokens=6, logprob_chunk_tokens=2)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5)
    assert (metrics["tokens_trained"], metrics["trajectories"], metrics["learning_rate"]) == (5.0, 2.0, 1e-2)
    assert optimizer.param_groups[0]["lr"] == 1e-2
    for _ in range(5):
        sft_step(model, optimizer, batch, TrainSFTConfig(), microbatch_tokens=64, logprob_chunk_tokens=64)
    assert float(hand_loss(model, items).detach()) < expected - 0.05


def test_nonfinite_loss_changes_nothing_and_stop_abandons():
    model = tiny_lora()
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_A" in n).fill_(math.inf)
    batch = SFTBatch(items=[item([1, 2, 3, 4], labels=[2, 3])], learning_rate=1e-2)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    metrics = sft_step(model, optimizer, batch, TrainSFTConfig(), microbatch_tokens=64, logprob_chunk_tokens=64)
    assert metrics["skipped_nonfinite"] == 1.0 and metrics["tokens_trained"] == 0.0
    assert not optimizer.state  # the optimizer never stepped

    model = tiny_lora()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    metrics = sft_step(model, optimizer, batch, TrainSFTConfig(), microbatch_tokens=64, logprob_chunk_tokens=64,
                       should_stop=lambda: True)
    assert metrics["stopped"] == 1.0
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)
