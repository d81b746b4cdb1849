"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the
request's last n tokens in its own prompt and output.

Output that repeats its input (editing code, summarising with quotes, answering about a given
text) is where this pays: the continuation of a quoted span is usually the span itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from brigade.interfaces import DraftSlot, Proposer, ProposerParams, Request, option

__all__ = ["NgramOptions", "NgramProposer"]


@dataclasses.dataclass(frozen=True)
class NgramOptions:
    max_n: int = option(4, help="longest suffix looked up (tried first)", ge=1, le=64)
    min_n: int = option(2, help="shortest suffix looked up", ge=1, le=64)

    def __post_init__(self) -> None:
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must not exceed max_n ({self.max_n})")


class _Index:
    """A request's tokens and, per n-gram, the end of its latest occurrence."""

    __slots__ = ("ends", "num_indexed", "tokens")

    def __init__(self, prompt: Sequence[int]) -> None:
        self.tokens: list[int] = list(prompt)
        self.ends: dict[tuple[int, ...], int] = {}
        """n-gram -> index just past its latest occurrence (its continuation starts there)."""
        self.num_indexed = 0
        """n-grams ending at or before this index are in :attr:`ends`."""


class NgramProposer(Proposer):
    """Looks up the last ``max_n`` .. ``min_n`` tokens (longest first) among the request's
    earlier tokens and proposes what followed their latest occurrence.

    Each request's n-grams are indexed once, as its tokens arrive (a dict per request), so a
    step costs O(new tokens x n sizes), whatever the request's length.
    """

    def __init__(self, params: ProposerParams, options: NgramOptions) -> None:
        super().__init__(params, options)
        self._sizes = range(options.max_n, options.min_n - 1, -1)
        self._indexes: dict[str, _Index] = {}

    def propose(self, slots: Sequence[DraftSlot]) -> list[list[int]]:
        return [self._propose(slot.request, slot.max_tokens) for slot in slots]

    def remove(self, request: Request) -> None:
        self._indexes.pop(request.request_id, None)

    def _propose(self, request: Request, max_tokens: int) -> list[int]:
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = _Index(request.prompt_token_ids)
        tokens = index.tokens
        known_output = len(tokens) - request.num_prompt_tokens
        if request.num_output_tokens > known_output:
            tokens.extend(request.output_token_ids[known_output:])
        length = len(tokens)
        # Index every n-gram ending before the last token: the suffix must not find itself.
        ends = index.ends
        for end in range(index.num_indexed + 1, length):
            for n in self._sizes:
                if n <= end:
                    ends[tuple(tokens[end - n : end])] = end
        index.num_indexed = max(index.num_indexed, length - 1)
        for n in self._sizes:
            if n > length:
                continue
            found = ends.get(tuple(tokens[length - n :]))
            if found is not None:
                return tokens[found : found + max_tokens]
        return []
