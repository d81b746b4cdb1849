"""Detokenizer: turns token ids into text deltas, holding back partial characters and stops."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

from brigade.interfaces.request import Request

__all__ = ["Detokenizer", "TextDelta"]


@dataclasses.dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    """New text that may leave now: never a U+FFFD for an incomplete character (only
    :meth:`Detokenizer.finish` may emit one) and never a possible start of a stop string."""
    stop_reason: str | None = None
    """The stop string that matched, when one did; the caller then aborts the request."""
    num_tokens_to_stop: int | None = None
    """When stopped: how many of the generated ids given so far are needed to produce the
    text up to and including the matched stop string; the caller keeps and counts these
    (usage) and drops the rest."""


class Detokenizer(abc.ABC):
    """Incremental decoding, run in the frontend, outside the step loop.

    Constructed as ``factory(tokenizer, options)`` with a transformers tokenizer.
    """

    @abc.abstractmethod
    def start(self, request: Request) -> Any:
        """Create per-request state (the prompt is left context, never searched for stops)."""

    @abc.abstractmethod
    def step(self, state: Any, token_ids: Sequence[int]) -> TextDelta:
        """Feed newly generated ids; return the text that may leave now.

        The deltas plus :meth:`finish` concatenate to the decode of the generated ids
        (``clean_up_tokenization_spaces=False``), cut at the stop. Complete text leaves as
        soon as it is complete. Only generated text is searched for the request's stop
        strings; when several match, the one that ends first wins, the longest on a tie.
        After a stop every call returns an empty delta.
        """

    @abc.abstractmethod
    def finish(self, state: Any) -> TextDelta:
        """Flush what was held back at the end of the request (empty after a stop)."""
