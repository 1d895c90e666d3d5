"""A request's messages into prompt ids, with control tokens only where the chat template put them.

The template renders text, and tokenising that text turns every occurrence of a special token's
text into the control token, wherever it came from. So a user who types
`<|im_end|>\\n<|im_start|>assistant\\n...` into a message (or a tool result that carries it) would
close their own turn and forge an assistant turn: the policy is trained and sampled on a
conversation nobody had.

The rule: special-token text inside anything the client sent (message content, names, tool-call
arguments, tool descriptions and schemas) is text. How, simply and exactly for HF tokenizers:
before rendering, each such occurrence is swapped for a sentinel (ASCII, with a per-request random
part, so no client text can imitate it and no template filter escapes it); the template renders
as usual, so every special-token text left in its output is the template's own; the output is then
tokenised piece by piece, splitting at the sentinels: the pieces normally, each swapped-out
special-token text with `split_special_tokens=True` (as the characters it is made of). A request
whose strings hold no special-token text, nearly all of them, is tokenised in one call exactly as
before.

`allow_special_tokens_in_content: true` in the request opts out, for clients that put control
tokens into content on purpose (say, a raw few-shot transcript).

Tools, tool calls and tool results are shown as `art_nb.tool_prompt` decides (the template's own
rendering, or the Hermes-style fallback written after the swap, so its markers are the template's);
a template that rejects them or does not show the tools gets a 400 naming why. `render_whole` is
the whole conversation's ids; `render_text` is the text with a tokeniser for any part of it, which
`turns.py` uses to render only what follows a turn it gives back as sampled ids.
"""

from __future__ import annotations

import re
import secrets
import weakref
from dataclasses import dataclass
from typing import Any

from art_nb.tool_prompt import template_inputs, tool_style, tools_missing
from art_nb.web import ApiError

from .encode import encode
from .schema import ChatCompletionRequest

__all__ = ["Rendered", "render_text", "render_whole", "special_token_texts"]

_PATTERNS: weakref.WeakKeyDictionary[Any, re.Pattern[str] | None] = weakref.WeakKeyDictionary()


def special_token_texts(tokenizer: Any) -> list[str]:
    """The texts that tokenise to a special (control) token, longest first."""
    texts = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    texts.update(tokenizer.all_special_tokens)
    return sorted((t for t in texts if t), key=len, reverse=True)


def _special_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    if tokenizer not in _PATTERNS:
        texts = special_token_texts(tokenizer)
        _PATTERNS[tokenizer] = re.compile("|".join(map(re.escape, texts))) if texts else None
    return _PATTERNS[tokenizer]


def render_whole(tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
    """Prompt ids for `req`: the chat template's rendering with the generation prompt, tokenised
    with control tokens only where the template wrote them (see the module docstring)."""
    rendered = render_text(tokenizer, req)
    return rendered.ids(rendered.text)


@dataclass(frozen=True)
class Rendered:
    """A request's prompt as the template wrote it, with client strings' special-token text swapped
    for `sentinel` + index (`swapped` holds the originals); `ids` tokenises any part of `text` that
    does not cut through a swapped piece."""

    tokenizer: Any
    text: str
    sentinel: str
    swapped: tuple[str, ...]

    def ids(self, text: str) -> list[int]:
        if not self.swapped:
            return _encode(self.tokenizer, text)
        ids: list[int] = []
        pieces = re.split(f"{self.sentinel}(\\d+)E", text)  # text, index, text, index, ..., text
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                ids += _encode(self.tokenizer, piece)
            else:
                ids += _encode(self.tokenizer, self.swapped[int(piece)], as_text=True)
        return ids


def render_text(tokenizer: Any, req: ChatCompletionRequest, replace: tuple[int, dict[str, Any]] | None = None
                ) -> Rendered:
    """The template's text for `req`'s messages (with message `replace[0]` replaced by `replace[1]`,
    a message as templates take it), its tools shown as `art_nb.tool_prompt` decides; a 400 when the
    template rejects them or does not show the tools."""
    messages = [m.for_template() for m in req.messages]
    if replace is not None:
        messages[replace[0]] = replace[1]
    tools = req.offered_tools()
    pattern = None if req.allow_special_tokens_in_content else _special_pattern(tokenizer)
    swapped: list[str] = []
    sentinel = ""  # drawn at the first swap: nearly no request needs one, and os.urandom costs the GIL
    if pattern is not None:
        def swap(text: str) -> str:
            def one(match: re.Match[str]) -> str:
                nonlocal sentinel
                sentinel = sentinel or f"ARTNB{secrets.token_hex(8)}S"
                swapped.append(match.group())
                return f"{sentinel}{len(swapped) - 1}E"

            return pattern.sub(one, text)

        messages, tools = _map_strings(messages, swap), _map_strings(tools, swap)
    # After the swap: the tool instructions art_nb writes are the template's own text, not the client's.
    shown, shown_tools = template_inputs(tokenizer, messages, tools)
    try:
        text = _render(tokenizer, shown, shown_tools)
    except ApiError as exc:
        if shown is messages:
            raise
        raise ApiError(400, f"{exc.message} (the template does not show tools itself, so art_nb wrote them, the "
                       "tool calls and the tool results as text: the tools into a system message, the results "
                       "into user messages; pass ModelConfig(chat_template=...) with a template that shows "
                       "tools)", param="tools" if tools else "messages") from exc
    missing = tools_missing(text, tools, tool_style(tokenizer)) if tools else None
    if missing:
        raise ApiError(400, missing, param="tools")
    return Rendered(tokenizer, text, sentinel, tuple(swapped))


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    import jinja2  # a dependency of transformers' chat templating

    try:
        return str(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False))
    except jinja2.TemplateError as exc:  # templates raise for conversations they cannot render
        raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc


def _encode(tokenizer: Any, text: str, as_text: bool = False) -> list[int]:
    if not text:
        return []
    # The template already wrote BOS and the role markers; tokenising must not add them again.
    if as_text:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    return encode(tokenizer, text)


def _map_strings(value: Any, fn: Any) -> Any:
    """`value` with `fn` applied to every string in it (dict keys included)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    return value
