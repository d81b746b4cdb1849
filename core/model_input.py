"""A simple reference builder of :class:`ModelInput` from per-request chunks.

Tests and the greedy reference loop use it; the persistent batch must produce the same
``ModelInput`` for the same step (same row order, same tensors).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import torch

from brigade.interfaces import ModelInput
from brigade.interfaces.request import is_decode

__all__ = ["LogitsWanted", "SeqChunk", "build_model_input"]

LogitsWanted = Literal["last", "all", "none"]
_LOGITS_WANTED = ("last", "all", "none")


@dataclasses.dataclass(frozen=True, slots=True)
class SeqChunk:
    """One request's share of a step: the new tokens and where its KV lives."""

    token_ids: Sequence[int]
    """The tokens this step computes (a prefill chunk, or one decode token)."""
    num_computed_tokens: int
    """Tokens of this request already in the KV cache (the new ones start at this position)."""
    block_table: Sequence[int]
    """Page ids of the request, enough pages for ``num_computed_tokens + len(token_ids)``."""
    want_logits: LogitsWanted = "last"
    """Which of the new tokens' logits the step returns: the last, all, or none (a prefill
    chunk that is not the prompt's last)."""

    @property
    def is_decode(self) -> bool:
        """Exactly one new token after a cached context."""
        return is_decode(len(self.token_ids), self.num_computed_tokens)


def build_model_input(seqs: Sequence[SeqChunk], page_size: int) -> ModelInput:
    """Flatten ``seqs`` into one step's :class:`ModelInput` (host tensors).

    Rows keep the caller's order, which must put every decode row (one new token after a
    cached context) before every prefill chunk: the builder raises ``ValueError`` rather than
    sorting, so row ``i`` of the batch (and of the returned logits) is always ``seqs[i]``.
    Logits rows follow the rows' order, each row's wanted positions in token order.
    """
    _check_chunks(seqs, page_size)
    num_reqs = len(seqs)
    query_lens = torch.tensor([len(s.token_ids) for s in seqs], dtype=torch.int64)
    computed = torch.tensor([s.num_computed_tokens for s in seqs], dtype=torch.int64)
    seq_lens = computed + query_lens
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int64)
    torch.cumsum(query_lens, dim=0, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    max_pages = max(len(s.block_table) for s in seqs)
    block_tables = torch.zeros(num_reqs, max_pages, dtype=torch.int64)
    for row, seq in enumerate(seqs):
        block_tables[row, : len(seq.block_table)] = torch.tensor(seq.block_table)

    # Per token: its row, and its position counted from the row's first new token.
    token_rows = torch.repeat_interleave(torch.arange(num_reqs), query_lens)  # [T]
    offsets = torch.arange(num_tokens) - query_start_loc[token_rows]  # [T]
    positions = computed[token_rows] + offsets  # [T]
    pages = block_tables[token_rows, positions // page_size]  # [T]
    slot_mapping = pages * page_size + positions % page_size  # [T]

    input_ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64)
    logits_indices = torch.cat(
        [
            _wanted_rows(s.want_logits, int(query_start_loc[i]), len(s.token_ids))
            for i, s in enumerate(seqs)
        ]
    )
    num_decodes = sum(1 for s in seqs if s.is_decode)
    query_start_loc_i32 = query_start_loc.to(torch.int32)
    seq_lens_i32 = seq_lens.to(torch.int32)
    return ModelInput(
        input_ids=input_ids,
        positions=positions,
        query_start_loc=query_start_loc_i32,
        seq_lens=seq_lens_i32,
        block_tables=block_tables.to(torch.int32),
        slot_mapping=slot_mapping,
        logits_indices=logits_indices,
        query_start_loc_cpu=query_start_loc_i32.clone(),
        seq_lens_cpu=seq_lens_i32.clone(),
        num_decodes=num_decodes,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        page_size=page_size,
    )


def _wanted_rows(want: LogitsWanted, start: int, length: int) -> torch.Tensor:
    if want == "all":
        return torch.arange(start, start + length, dtype=torch.int64)
    if want == "last":
        return torch.tensor([start + length - 1], dtype=torch.int64)
    return torch.empty(0, dtype=torch.int64)


def _check_chunks(seqs: Sequence[SeqChunk], page_size: int) -> None:
    if page_size < 1:
        raise ValueError(f"page_size must be at least 1, got {page_size}")
    if not seqs:
        raise ValueError("build_model_input needs at least one SeqChunk")
    seen_prefill = False
    for row, seq in enumerate(seqs):
        if not seq.token_ids:
            raise ValueError(f"row {row}: token_ids is empty; every row needs new tokens")
        if seq.num_computed_tokens < 0:
            raise ValueError(
                f"row {row}: num_computed_tokens must be >= 0, got {seq.num_computed_tokens}"
            )
        if seq.want_logits not in _LOGITS_WANTED:
            raise ValueError(
                f"row {row}: want_logits={seq.want_logits!r}; allowed: {', '.join(_LOGITS_WANTED)}"
            )
        seq_len = seq.num_computed_tokens + len(seq.token_ids)
        pages_needed = -(-seq_len // page_size)
        if len(seq.block_table) < pages_needed:
            raise ValueError(
                f"row {row}: {seq_len} tokens need {pages_needed} pages of {page_size}, "
                f"but its block_table has {len(seq.block_table)}"
            )
        if any(page < 0 for page in seq.block_table):
            raise ValueError(f"row {row}: block_table holds a negative page id")
        if seq.is_decode and seen_prefill:
            raise ValueError(
                f"row {row} is a decode row after a prefill row; put every decode row "
                "(one new token after a cached context) before the prefill chunks"
            )
        seen_prefill = seen_prefill or not seq.is_decode
