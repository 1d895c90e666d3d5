"""Prompt tokenising piece by piece (art_nb.local.server.encode) gives exactly the ids of the whole call.

The cache is only worth having if it is exact: every case compares with
`tokenizer(text, add_special_tokens=False)["input_ids"]`, on first use and on cache hits, and the
tokenizers whose pieces are not independent (whitespace-stripping added tokens, Metaspace with
`prepend_scheme: first`) must not be cached at all.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from art_nb.local.server import encode as encode_module
from art_nb.local.server.encode import encode

TEXTS = [
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nA1 or B2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|im_start|>",  # adjacent control tokens, empty pieces between them
    "  leading spaces <|im_end|>  trailing spaces  ",
    "no control tokens at all, just words and 123 digits",
    "unicode: héllo wörld ✓ 中文 <|im_end|>\n\n\n",
    "<|im_start|<|im_end|>>",  # a broken tag next to a real one
    "",
]


def whole(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_chatml_pieces_match_the_whole_call_fresh_and_cached(chatml_tokenizer: Any) -> None:
    assert encode_module._encoder(chatml_tokenizer) is not None  # this tokenizer is cached
    for _ in range(2):  # the second round is served from the cache
        for text in TEXTS:
            assert encode(chatml_tokenizer, text) == whole(chatml_tokenizer, text), text
    cache = encode_module._encoder(chatml_tokenizer).cache
    assert "system\nYou are terse." in cache  # the text between control tokens was kept


def _byte_bpe(pre_tokenizer: Any = None, **special: Any) -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, **special)


def test_normalized_added_tokens_split_in_the_second_pass() -> None:
    """Raw added tokens are cut first; normalized ones only inside what is left (tokenizers' order)."""
    tokenizer = _byte_bpe(eos_token="<|im_end|>")
    tokenizer.add_tokens([AddedToken("end|>", normalized=True, special=False),
                          AddedToken("<tool_call>", normalized=True, special=False)])
    assert encode_module._encoder(tokenizer) is not None
    for text in ["x<|im_end|>y end|> z", "<tool_call>{}</tool_call><|im_end|>", "end|><|im_end|>end|>"]:
        for _ in range(2):
            assert encode(tokenizer, text) == whole(tokenizer, text), text


def test_whitespace_stripping_tokens_are_tokenised_whole() -> None:
    tokenizer = _byte_bpe(eos_token=AddedToken("<|im_end|>", lstrip=True, rstrip=True, special=True))
    assert encode_module._encoder(tokenizer) is None
    text = "a   <|im_end|>   b"
    assert encode(tokenizer, text) == whole(tokenizer, text)


def _metaspace_first() -> PreTrainedTokenizerFast:
    vocab = {c: i for i, c in enumerate(["<unk>", "▁", *"abcdefghijklmnopqrstuvwxyz"])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="<unk>")


def test_metaspace_first_is_position_dependent_so_not_cached() -> None:
    """Llama-style tokenizers prepend '▁' to the text's first piece only: pieces are not independent."""
    tokenizer = _metaspace_first()
    text = "ab</s>cd"
    assert encode_module._encoder(tokenizer) is None
    assert encode(tokenizer, text) == whole(tokenizer, text)


def test_a_mismatch_on_first_use_switches_the_cache_off(caplog: pytest.LogCaptureFixture) -> None:
    """The first text is checked against the whole call: a piece encoder forced onto a tokenizer
    where it is wrong (Metaspace first) is noticed, the right ids are returned, and it stays off."""
    tokenizer = _metaspace_first()
    backend = tokenizer.backend_tokenizer
    forced = encode_module._PieceEncoder(backend, {"</s>": (backend.token_to_id("</s>"), False)})
    encode_module._ENCODERS[tokenizer] = forced
    text = "ab</s>cd"
    assert forced.encode(text) != whole(tokenizer, text)  # the forced encoder really is wrong here
    with caplog.at_level(logging.WARNING, logger="art_nb.local.server.encode"):
        assert encode(tokenizer, text) == whole(tokenizer, text)
    assert "tokenising whole prompts from now on" in caplog.text
    assert encode_module._ENCODERS[tokenizer] is None


def test_the_cache_is_bounded(chatml_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encode_module, "_MAX_PIECES", 3)
    encoder = encode_module._encoder(chatml_tokenizer)
    assert encoder is not None
    for i in range(10):
        text = f"<|im_start|>user\nmessage {i}<|im_end|>"
        assert encode(chatml_tokenizer, text) == whole(chatml_tokenizer, text)
    assert len(encoder.cache) <= 3
    assert "user\nmessage 9" in encoder.cache  # the most recent piece is kept
