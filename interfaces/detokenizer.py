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
    """New text safe to show (valid UTF-8, no possible stop string prefix)."""
    stop_reason: str | None = None
    """The stop string that matched, when one did; the request must then be aborted."""
    num_tokens_to_stop: int | None = None
    """When stopped: how many of the tokens given so far precede the stop (usage counts these)."""


class Detokenizer(abc.ABC):
    """Incremental decoding, run in the frontend, outside the step loop."""

    @abc.abstractmethod
    def start(self, request: Request) -> Any:
        """Create per-request state."""

    @abc.abstractmethod
    def step(self, state: Any, token_ids: Sequence[int]) -> TextDelta:
        """Feed newly generated ids; return the text that may leave now."""

    @abc.abstractmethod
    def finish(self, state: Any) -> TextDelta:
        """Flush what was held back at the end of the request."""
