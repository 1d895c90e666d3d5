"""Tokenising a rendered prompt exactly as the tokenizer would, with the text between control tokens
cached: the system prompt, the tool list and every earlier turn of a rollout are the same text in
request after request, and tokenising them again was the endpoint's largest cost per request
(SmolLM2's byte-level pre-tokenizer runs at about 1 µs per character).

Why caching pieces is exact: a fast (Rust) tokenizer first splits the text at its added tokens
(pass 1: those matched on the raw text; pass 2: those matched on the normalized text, within what
is left), leftmost-longest, and then tokenises each remaining piece on its own. So the ids of a
text are the ids of its pieces in order, and a piece tokenises the same wherever it appears. That
holds as long as the pre-tokenizer treats every piece alike (not Metaspace's `prepend_scheme:
first`), no added token strips whitespace around itself or must stand as a single word
(`lstrip`, `rstrip`, `single_word`), and, when the tokenizer normalizes, no added token is matched
on normalized text; otherwise, and for slow (Python) tokenizers, every text goes through the
tokenizer whole, as before. The first text of each tokenizer is also checked against the whole
call, and a mismatch switches the cache off for it (with a warning) rather than serve other ids.
"""

from __future__ import annotations

import json
import logging
import re
import weakref
from typing import Any

__all__ = ["encode"]

_log = logging.getLogger(__name__)
_MAX_PIECES = 16384  # cached pieces per tokenizer, least recently used dropped first
_MAX_PIECE_CHARS = 32768  # a longer piece (a large tool result) is tokenised but not kept
# New text up to this long is tokenised holding the GIL (~1 us a character). `encode_batch` releases it (and
# hands the work to its thread pool) and must get it back beside the engine's thread and a client building
# requests: in a wave beside a GIL-heavy engine, 256 requests reached it after 0.35 s that way and 0.25 s
# holding it (bench/results/encode_hold_gil_cpu/).
_RELEASE_GIL_CHARS = 4096


class _PieceEncoder:
    """The cache for one fast tokenizer; `None` in `_ENCODERS` when the rule above does not hold."""

    def __init__(self, backend: Any, tokens: dict[str, tuple[int, bool]]) -> None:
        self.backend = backend
        self.ids = {content: token_id for content, (token_id, _) in tokens.items()}
        self.raw = _alternation([c for c, (_, normalized) in tokens.items() if not normalized])
        self.normalized = _alternation([c for c, (_, normalized) in tokens.items() if normalized])
        self.cache: dict[str, list[int]] = {}
        self.checked = False

    def split(self, text: str) -> list[str]:
        """`text` cut before and after every added token, in the tokenizer's two passes."""
        pieces = self.raw.split(text) if self.raw else [text]
        if self.normalized is None:
            return pieces
        out: list[str] = []
        for i, piece in enumerate(pieces):
            out += [piece] if i % 2 else self.normalized.split(piece)  # odd: a raw added token
        return out

    def encode(self, text: str) -> list[int]:
        pieces, cache, ids = self.split(text), self.cache, self.ids
        missing = list(dict.fromkeys(p for p in pieces if p and p not in ids and p not in cache))
        if sum(map(len, missing)) > _RELEASE_GIL_CHARS:  # one call for all of them, the GIL released
            encodings = self.backend.encode_batch(missing, add_special_tokens=False)
        else:
            encodings = [self.backend.encode(piece, add_special_tokens=False) for piece in missing]
        fresh = {piece: encoding.ids for piece, encoding in zip(missing, encodings, strict=True)}
        out: list[int] = []
        for piece in pieces:
            if not piece:
                continue
            token_id = ids.get(piece)
            if token_id is not None:
                out.append(token_id)
                continue
            piece_ids = fresh.get(piece)
            if piece_ids is None:
                piece_ids = cache.pop(piece, None)
                if piece_ids is None:  # dropped by another thread meanwhile
                    piece_ids = self.backend.encode(piece, add_special_tokens=False).ids
            if len(piece) <= _MAX_PIECE_CHARS:
                cache[piece] = piece_ids  # (re)inserted last: most recently used
            out += piece_ids
        while len(cache) > _MAX_PIECES:
            cache.pop(next(iter(cache)), None)
        return out


def _alternation(texts: list[str]) -> re.Pattern[str] | None:
    """A pattern whose `split` keeps the matches; longest first, so the leftmost match is the longest."""
    if not texts:
        return None
    return re.compile("(" + "|".join(map(re.escape, sorted(texts, key=len, reverse=True))) + ")")


_ENCODERS: weakref.WeakKeyDictionary[Any, _PieceEncoder | None] = weakref.WeakKeyDictionary()


def _encoder(tokenizer: Any) -> _PieceEncoder | None:
    if tokenizer in _ENCODERS:
        return _ENCODERS[tokenizer]
    encoder = None
    # third-party: only transformers' fast tokenizers have a Rust backend to call piece by piece
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        added = tokenizer.added_tokens_decoder.values()
        tokens = {t.content: (backend.token_to_id(t.content), bool(t.normalized)) for t in added if t.content}
        exact = (
            not any(t.lstrip or t.rstrip or t.single_word for t in added)
            and not _first_only(backend)
            and not (backend.normalizer is not None and any(n for _, n in tokens.values()))
            and all(token_id is not None for token_id, _ in tokens.values())
        )
        if exact:
            encoder = _PieceEncoder(backend, tokens)
    _ENCODERS[tokenizer] = encoder
    return encoder


def _first_only(backend: Any) -> bool:
    """Whether the pre-tokenizer treats the text's first piece differently (Metaspace with
    `prepend_scheme: first`, as Llama and Mistral tokenizers have): then a piece's ids depend on
    where it stands."""
    pre_tokenizer = json.loads(backend.to_str()).get("pre_tokenizer")
    return '"prepend_scheme":"first"' in json.dumps(pre_tokenizer, separators=(",", ":")).lower()


def encode(tokenizer: Any, text: str) -> list[int]:
    """`tokenizer(text, add_special_tokens=False)["input_ids"]`, with pieces cached (module docstring)."""
    encoder = _encoder(tokenizer)
    # The backend must not truncate, pad or keep control-token text as text, as the whole call would not.
    if encoder is None or encoder.backend.truncation or encoder.backend.padding or encoder.backend.encode_special_tokens:
        return _whole(tokenizer, text)
    ids = encoder.encode(text)
    if not encoder.checked:
        encoder.checked = True
        expected = _whole(tokenizer, text)
        if ids != expected:
            _log.warning("tokenising prompts piece by piece gave other ids than %s does as a whole; "
                         "tokenising whole prompts from now on", type(tokenizer).__name__)
            _ENCODERS[tokenizer] = None
            return expected
    return ids


def _whole(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
