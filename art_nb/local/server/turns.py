"""Token-in/token-out: an assistant turn this endpoint sampled goes back to the model as the ids it
sampled, not as the chat template's rendering of its text.

Why: a client sends the reply back as text (and tool calls as JSON it may re-serialise), and a
template re-renders it: Qwen-style templates rewrite tool-call JSON, Qwen3 drops earlier `<think>`
blocks, and re-tokenising a sampled reply can split it differently (sampled `ĠB ab`, re-rendered
`ĠBab`). Each rewrite makes the next prompt something other than the sampled history, and a
multi-turn rollout then trains on ids the policy was not sampled from (or capture refuses it).

How: every answered choice is kept (`remember`) as the request's prompt ids + the ids it sampled,
under a digest of the request (its tools, and each message in canonical form) followed by the
choice's message. A later request is looked up from its last assistant message backwards: the first
message k whose conversation up to and including k is kept gives the prompt's start, those ids. The
rest is rendered by the template without re-rendering turn k: the whole conversation is rendered
with message k's content replaced by a sentinel (and no tool calls), and the text after the sentinel
is tokenised (special-token text in client strings staying text, `prompt.Rendered.ids`). The
template's end-of-turn token(s) that the sampled ids already end with (the EOS the engine sampled)
are dropped from that tail; a sample cut by a stop string or `max_tokens` keeps the template's
closing. Where the template rejects that form, or the sentinel does not appear exactly once, the
whole conversation is rendered, as with `ModelConfig(assistant_turns="rendered")`, and counted.

Canonical form, so that what a client does to a reply on its way back still matches: content with
surrounding whitespace stripped (None is ""), tool calls by function name and parsed JSON arguments
(key order, spacing and call ids do not matter); other messages as sent. A reply with tool calls is
also kept under its call ids, looked up first: a group's rollouts often write the same call, split
into different ids (measured: 1 of 8 forced calls on Qwen2.5's tokenizer), and the ids a client sends
back say which sample it got. Replies of the same text without calls cannot be told apart; the last
one kept is the one given back. A turn the client edited
misses, is rendered, and capture says where the ids part (`grpo/captured.py`).

Bounded memory: per tokenizer (each engine has its own; one engine serves a base model and its
adapters), least recently used first out, by total ids (`ModelConfig.turn_cache_tokens`, 4 bytes
each) and by entries (`MAX_ENTRIES`). Thread-safe: prompts and responses are built in worker threads
for large requests. The engine is given these ids on every engine alike: the server computes them
before it calls the engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from art_nb.web import ApiError

from .prompt import render_text, render_whole
from .schema import ChatCompletionRequest

__all__ = ["DEFAULT_TOKENS", "MAX_ENTRIES", "TurnCache", "configure", "remember", "render_prompt", "turn_cache"]

_log = logging.getLogger(__name__)
DEFAULT_TOKENS = 1 << 24  # ModelConfig.turn_cache_tokens' default, for a tokenizer register never configured
MAX_ENTRIES = 1 << 16
_SENTINEL = f"ARTNBTURN{secrets.token_hex(8)}T"  # ASCII, no whitespace: no template filter alters it
_MAX_OVERLAP = 4  # end-of-turn special tokens a sample may already end with


class TurnCache:
    """Sampled turns' ids by conversation digest, least recently used first out; counts what it did."""

    def __init__(self, max_tokens: int = DEFAULT_TOKENS, max_entries: int = MAX_ENTRIES) -> None:
        self.max_tokens, self.max_entries = max_tokens, max_entries
        # (prompt, sampled): one request's choices share its prompt's array; each entry counts it in full
        self._entries: OrderedDict[bytes, tuple[array[int], array[int]]] = OrderedDict()
        self._lock = threading.Lock()
        self.tokens = 0
        self.stitched = 0  # prompts that began with a kept turn's ids
        self.missed = 0  # prompts with an assistant turn, none of them kept: rendered whole
        self.fallbacks = 0  # a kept turn, but the template could not render the rest without it: rendered whole
        self.special_ids: frozenset[int] | None = None

    def get(self, key: bytes) -> list[int] | None:
        """The prompt + sampled ids kept under `key` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
        return entry[0].tolist() + entry[1].tolist()

    def put(self, key: bytes, prompt: array[int], sampled: list[int]) -> None:
        """Keep `prompt` + `sampled` under `key`, dropping the least recently used beyond the bounds."""
        size = len(prompt) + len(sampled)
        if size > self.max_tokens:
            return
        entry = (prompt, array("i", sampled))
        with self._lock:
            old = self._entries.pop(key, None)
            self.tokens += size - (len(old[0]) + len(old[1]) if old is not None else 0)
            self._entries[key] = entry
            while self.tokens > self.max_tokens or len(self._entries) > self.max_entries:
                _, (dropped_prompt, dropped) = self._entries.popitem(last=False)
                self.tokens -= len(dropped_prompt) + len(dropped)

    def __len__(self) -> int:
        return len(self._entries)


_CACHES: weakref.WeakKeyDictionary[Any, TurnCache | None] = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


def configure(tokenizer: Any, assistant_turns: str, max_tokens: int) -> None:
    """Set how `tokenizer`'s prompts give back sampled turns (`ModelConfig.assistant_turns`,
    `turn_cache_tokens`); a tokenizer never configured keeps turns with the defaults."""
    with _CACHES_LOCK:
        _CACHES[tokenizer] = TurnCache(max_tokens) if assistant_turns == "sampled" and max_tokens > 0 else None


def turn_cache(tokenizer: Any) -> TurnCache | None:
    """`tokenizer`'s cache; None when turns are rendered."""
    with _CACHES_LOCK:
        if tokenizer not in _CACHES:
            _CACHES[tokenizer] = TurnCache()
        return _CACHES[tokenizer]


def render_prompt(tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
    """The prompt ids for `req`: a kept turn's ids and the rendering of what follows it (the module
    docstring), else the template's rendering of the whole conversation (`prompt.render_whole`)."""
    cache = turn_cache(tokenizer)
    if cache is not None and any(m.role == "assistant" for m in req.messages):
        chain = _chain(req)
        for k in range(len(req.messages) - 1, -1, -1):
            if req.messages[k].role != "assistant":
                continue
            kept = _kept_with_call_ids(cache, chain[k], req.messages[k])
            kept = kept if kept is not None else cache.get(chain[k + 1])
            if kept is None:
                continue
            ids = _stitched(tokenizer, req, k, kept, cache)
            if ids is not None:
                cache.stitched += 1
                return ids
            cache.fallbacks += 1
            break
        else:
            cache.missed += 1
    return render_whole(tokenizer, req)


def remember(tokenizer: Any, req: ChatCompletionRequest, prompt_ids: list[int], choices: Iterable[dict[str, Any]]) -> None:
    """Keep each answered choice's full ids (prompt + sampled) under its conversation's digest."""
    cache = turn_cache(tokenizer)
    if cache is None:
        return
    end, prompt = _chain(req)[-1], array("i", prompt_ids)
    for choice in choices:
        message = choice["message"]
        tool_calls = message.get("tool_calls") or ()
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls]
        cache.put(_link(end, _assistant(message.get("content"), calls)), prompt, choice["token_ids"])
        if tool_calls:
            ids = [c["id"] for c in tool_calls]
            cache.put(_link(end, _assistant(message.get("content"), calls, ids)), prompt, choice["token_ids"])


def _kept_with_call_ids(cache: TurnCache, before: bytes, message: Any) -> list[int] | None:
    """The turn kept under message's call ids too, or None: two samples with the same calls and content
    (a group's rollouts often write the same call) may be split into different ids; the ids a client
    sends back with its calls say which one it got."""
    if not message.tool_calls or not all(c.id for c in message.tool_calls):
        return None
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    return cache.get(_link(before, _assistant(message.content, calls, [c.id for c in message.tool_calls])))


def _stitched(tokenizer: Any, req: ChatCompletionRequest, k: int, kept: list[int], cache: TurnCache) -> list[int] | None:
    """`kept` + the tokenised text that follows message k, or None where the template does not allow it."""
    try:
        rendered = render_text(tokenizer, req, replace=(k, {"role": "assistant", "content": _SENTINEL}))
    except ApiError as exc:
        _log.debug("rendering after a sampled turn failed (%s); rendering the whole conversation", exc.message)
        return None
    text = rendered.text
    at = text.find(_SENTINEL)
    if at < 0 or text.find(_SENTINEL, at + 1) >= 0:
        _log.warning("the chat template did not show a sampled turn's content exactly once; rendering the whole "
                     "conversation for this request")
        return None
    tail = rendered.ids(text[at + len(_SENTINEL):])
    if cache.special_ids is None:
        cache.special_ids = frozenset(tokenizer.all_special_ids) | frozenset(
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    return kept + tail[_overlap(kept, tail, cache.special_ids):]


def _overlap(kept: list[int], tail: list[int], special: frozenset[int]) -> int:
    """How many of `tail`'s first ids repeat the special tokens `kept` ends with (a sampled EOS that
    the template writes again as its end-of-turn)."""
    for n in range(min(_MAX_OVERLAP, len(kept), len(tail)), 0, -1):
        if kept[-n:] == tail[:n] and all(i in special for i in tail[:n]):
            return n
    return 0


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def _link(previous: bytes, message: bytes) -> bytes:
    return _digest(previous, message)


def _chain(req: ChatCompletionRequest) -> list[bytes]:
    """Digests of the conversation's prefixes: [context, +message 0, +message 1, ...]; the context is
    what else changes the rendering (the tools shown, whether special-token text is text)."""
    context = _canonical({"tools": req.offered_tools(), "specials": req.allow_special_tokens_in_content})
    chain = [_digest(b"art_nb turns v1", context)]
    for message in req.messages:
        if message.role == "assistant":
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
            chain.append(_link(chain[-1], _assistant(message.content, calls)))
        else:
            chain.append(_link(chain[-1], _canonical(message.model_dump(exclude_none=True))))
    return chain


def _assistant(content: Any, calls: list[tuple[str, str]], call_ids: list[str] | None = None) -> bytes:
    text = content.strip() if isinstance(content, str) else ""
    canonical = {"role": "assistant", "content": text, "calls": [[name, _arguments(a)] for name, a in calls]}
    return _canonical(canonical if call_ids is None else {**canonical, "call_ids": call_ids})


def _arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        return arguments


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
