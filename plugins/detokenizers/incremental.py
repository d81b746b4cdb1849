"""The ``incremental`` detokenizer: UTF-8 safe text deltas with stop strings held back.

Each step runs two stages over a handful of recent ids, never over the whole output:

1. **Decode** (the prefix/read-offset technique of vLLM and TGI). ``tokens`` holds a few
   prompt ids as left context followed by the generated ids. Text before ``read_offset`` has
   left; ``tokens[prefix_offset:read_offset]`` is a little context that decodes to
   ``prefix_text``. The step decodes ``tokens[prefix_offset:]`` and the new text is what
   follows ``prefix_text``. While that text ends with U+FFFD a character is still incomplete
   (byte-level tokens split it), so the offsets stay put; the complete text before the
   incomplete tail leaves anyway (``num_sent_chars`` remembers how much did).
2. **Stops**. The new text joins the held-back text and is searched for the stop strings; a
   suffix that could still begin a stop string is held back until it can no longer match.

Conventions (see :meth:`IncrementalDetokenizer.step`): only generated text is searched, the
match that ends first wins, and ``clean_up_tokenization_spaces`` is not applied.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

from brigade.interfaces import Detokenizer, Request, TextDelta

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["IncrementalDetokenizer", "IncrementalDetokenizerOptions", "IncrementalState"]

_REPLACEMENT_CHAR = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5
"""Prompt ids decoded as left context, so the first generated ids get their spacing right."""
_MAX_CONTEXT_TOKENS = 4
"""Left context kept after a release: one step's ids, at most this many."""
_MAX_HELD_TOKENS = 16
"""More ids than this behind an incomplete tail means bytes that never form a character: a
clean cut before the last few ids is released so the decoded window stays small."""
_EMPTY = TextDelta("")


@dataclasses.dataclass(frozen=True)
class IncrementalDetokenizerOptions:
    """Options of the ``incremental`` detokenizer (none yet: its behaviour is fully set by
    each request's sampling parameters)."""


@dataclasses.dataclass(slots=True, eq=False)
class IncrementalState:
    """One request's decoding state; owned by the detokenizer, opaque to callers."""

    decode: Callable[[list[int]], str]
    tokens: list[int]
    """Left context from the prompt, then every generated id fed so far."""
    num_context_tokens: int
    prefix_offset: int
    read_offset: int
    prefix_text: str
    """``decode(tokens[prefix_offset:read_offset])``."""
    stops: tuple[str, ...]
    include_stop_str_in_output: bool
    stop_prefix_chars: frozenset[str]
    """Characters that can end a proper prefix of a stop string (fast path of the hold-back)."""
    num_sent_chars: int = 0
    """Characters of the text after ``prefix_text`` that already went to the stop stage."""
    held: str = ""
    """Text that could be the beginning of a stop string."""
    done: bool = False
    """A stop matched or the request was finished: later calls return empty deltas."""


class IncrementalDetokenizer(Detokenizer):
    """Turns generated ids into text deltas with a small decode window per step.

    Works with any transformers tokenizer; a fast one is decoded through its Rust backend
    directly (about half a microsecond per window).
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, options: IncrementalDetokenizerOptions
    ) -> None:
        self.tokenizer = tokenizer
        self.options = options
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # transformers 5 types decode() as str | list[str]; a list of ids gives a str.
        self._decoders: dict[bool, Callable[[list[int]], str]] = {
            skip: cast(
                "Callable[[list[int]], str]",
                functools.partial(backend.decode, skip_special_tokens=skip)
                if backend is not None
                else functools.partial(
                    tokenizer.decode, skip_special_tokens=skip, clean_up_tokenization_spaces=False
                ),
            )
            for skip in (False, True)
        }

    def start(self, request: Request) -> IncrementalState:
        """State for ``request``: the last prompt ids as context, its stops and special-token
        handling. A prompt that ends inside a character is not used as context, since the
        generated text must start where the generated ids start."""
        params = request.sampling_params
        decode = self._decoders[params.skip_special_tokens]
        context = list(request.prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        prefix_text = decode(context) if context else ""
        if prefix_text.endswith(_REPLACEMENT_CHAR):
            context, prefix_text = [], ""
        stops = tuple(params.stop)
        return IncrementalState(
            decode=decode,
            tokens=context,
            num_context_tokens=len(context),
            prefix_offset=0,
            read_offset=len(context),
            prefix_text=prefix_text,
            stops=stops,
            include_stop_str_in_output=params.include_stop_str_in_output,
            stop_prefix_chars=frozenset("".join(stop[:-1] for stop in stops)),
        )

    def step(self, state: IncrementalState, token_ids: Sequence[int]) -> TextDelta:
        """Feed newly generated ids; return the text that may leave now.

        The deltas of all steps and :meth:`finish` concatenate to
        ``tokenizer.decode(generated_ids, skip_special_tokens=...,
        clean_up_tokenization_spaces=False)``, cut at the first stop string. A character split
        over several ids leaves whole once complete. Stop strings are searched in generated
        text only; when several match, the one that ends first wins (of those, the longest).
        On a match the text ends before the stop (or after it, with
        ``include_stop_str_in_output``), ``num_tokens_to_stop`` counts the generated ids needed
        to produce the stop's last character, and every later call returns an empty delta.
        """
        if state.done or not token_ids:
            return _EMPTY
        num_before = len(state.tokens)
        prefix_offset, prefix_len = state.prefix_offset, len(state.prefix_text)
        num_sent_before = state.num_sent_chars
        state.tokens.extend(token_ids)
        fresh, window_text = _decode_new_text(state)
        if not state.stops:
            return TextDelta(fresh) if fresh else _EMPTY
        if not fresh:
            return _EMPTY
        delta, stop_end = _apply_stops(state, fresh, final=False)
        if delta.stop_reason is None or len(token_ids) == 1:
            return delta
        # Several ids arrived at once: find the first one that completes the stop.
        target = window_text[: num_sent_before + stop_end]
        needed = _first_ids_producing(state, prefix_offset, prefix_len, target, num_before + 1)
        return dataclasses.replace(delta, num_tokens_to_stop=needed)

    def finish(self, state: IncrementalState) -> TextDelta:
        """Flush the held-back text: an incomplete character at the very end comes out as
        U+FFFD, a stop-string prefix that never completed comes out as text."""
        if state.done:
            return _EMPTY
        state.done = True
        full = state.decode(state.tokens[state.prefix_offset :])
        fresh = full[len(state.prefix_text) + state.num_sent_chars :]
        if not state.stops:
            return TextDelta(fresh)
        return _apply_stops(state, fresh, final=True)[0]


def _decode_new_text(state: IncrementalState) -> tuple[str, str]:
    """Decode the window; return (text that may leave now, window text after prefix_text)."""
    tokens = state.tokens
    full = state.decode(tokens[state.prefix_offset :])
    prefix_len = len(state.prefix_text)
    start = prefix_len + state.num_sent_chars
    if not full.endswith(_REPLACEMENT_CHAR):
        new_read = len(tokens)
        state.prefix_offset = max(state.read_offset, new_read - _MAX_CONTEXT_TOKENS)
        state.read_offset = new_read
        state.prefix_text = state.decode(tokens[state.prefix_offset : new_read])
        state.num_sent_chars = 0
        return full[start:], full[prefix_len:]
    # Text before the trailing U+FFFD run can no longer change: let it leave now.
    fresh = full[start : len(full.rstrip(_REPLACEMENT_CHAR))]
    state.num_sent_chars += len(fresh)
    if len(tokens) - state.read_offset > _MAX_HELD_TOKENS:
        fresh += _release_invalid_bytes(state, full)
    return fresh, full[prefix_len:]


def _release_invalid_bytes(state: IncrementalState, full: str) -> str:
    """Move the offsets to a clean cut before the last few ids (an incomplete character spans
    at most three bytes, so at most three ids); return window text that now leaves."""
    tokens, decode = state.tokens, state.decode
    last = len(tokens) - 4
    # A character spans at most four ids, so one of four neighbouring cuts is clean.
    for cut in range(last, max(state.read_offset, last - 4), -1):
        head = decode(tokens[state.prefix_offset : cut])
        if head + decode(tokens[cut:]) != full:
            continue
        released = head[len(state.prefix_text) :]
        extra = released[state.num_sent_chars :]
        state.num_sent_chars = max(state.num_sent_chars - len(released), 0)
        state.prefix_offset = state.read_offset = cut
        state.prefix_text = ""
        return extra
    return ""


def _apply_stops(state: IncrementalState, fresh: str, *, final: bool) -> tuple[TextDelta, int]:
    """Search held + fresh text for a stop; return what may leave (holding back the rest) and,
    on a match, where it ends within ``fresh``."""
    buffer = state.held + fresh
    match = _first_stop(buffer, state.stops)
    if match is not None:
        start, stop = match
        end = start + len(stop)
        held_len = len(state.held)
        state.done, state.held = True, ""
        text = buffer[:end] if state.include_stop_str_in_output else buffer[:start]
        num_generated = len(state.tokens) - state.num_context_tokens
        return TextDelta(text, stop, num_generated), end - held_len
    keep = len(buffer) if final else _stop_prefix_start(buffer, state)
    state.held = buffer[keep:]
    return (TextDelta(buffer[:keep]) if keep else _EMPTY), 0


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(start, stop) of the match that ends first, the longest of those; None if none."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return None if best is None else (best[1], best[2])


def _stop_prefix_start(text: str, state: IncrementalState) -> int:
    """Start of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    if text[-1] not in state.stop_prefix_chars:
        return len(text)
    earliest = len(text)
    for stop in state.stops:
        # Candidates start with the stop's first character, close enough to the end that the
        # suffix is shorter than the stop; str.find skips the rest in C.
        start = text.find(stop[0], max(len(text) - len(stop) + 1, 0), earliest)
        while start >= 0:
            if stop.startswith(text[start:]):
                earliest = start
                break
            start = text.find(stop[0], start + 1, earliest)
    return earliest


def _first_ids_producing(
    state: IncrementalState, prefix_offset: int, prefix_len: int, target: str, low: int
) -> int:
    """Fewest generated ids whose window text (from ``prefix_offset``, after ``prefix_len``
    characters of context) starts with ``target``; a binary search over the ids of one call."""
    tokens, decode = state.tokens, state.decode
    high = len(tokens)  # the whole call produced the target
    while low < high:
        middle = (low + high) // 2
        if decode(tokens[prefix_offset:middle])[prefix_len:].startswith(target):
            high = middle
        else:
            low = middle + 1
    return high - state.num_context_tokens
