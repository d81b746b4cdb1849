"""CUDA-independent parts of the cuda-graph executor: bucketing and padding of decode steps.

A CUDA graph replays fixed shapes, so a pure decode step of ``B`` rows runs in the graph
captured for the smallest capture size ``N >= B``; rows ``B .. N-1`` are padding. Padding rows
must not disturb real requests: each one writes its K/V into, and attends to, slot 0 of a
**scratch page**, an extra KV page the executor allocates past the pages core hands out (id
``num_pages``), which no block table ever names. Every function here works on host tensors,
so the tests run on a CPU. (Steps with prefill chunks are bucketed by token count with the
same :func:`bucket_for`; their padding rows live in the piecewise graphs' buffers and never
reach attention, see :mod:`piecewise`.)
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from brigade.interfaces import ModelInput

__all__ = [
    "bucket_for",
    "check_capture_sizes",
    "graph_bucket",
    "pad_decode_input",
    "padding_input",
]


def check_capture_sizes(sizes: Sequence[int], name: str = "capture_sizes") -> tuple[int, ...]:
    """``sizes`` sorted and deduplicated; ``ValueError`` naming option ``name`` if empty or
    not all positive."""
    if not sizes:
        raise ValueError(f"{name} must name at least one size")
    if any(size < 1 for size in sizes):
        raise ValueError(f"{name} must be positive sizes, got {list(sizes)}")
    return tuple(sorted(set(sizes)))


def bucket_for(num_reqs: int, capture_sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``num_reqs`` rows; None if all are smaller.

    ``capture_sizes`` must be sorted ascending (see :func:`check_capture_sizes`).
    """
    index = bisect.bisect_left(capture_sizes, num_reqs)
    return capture_sizes[index] if index < len(capture_sizes) else None


def graph_bucket(batch: ModelInput, capture_sizes: Sequence[int], max_pages: int) -> int | None:
    """The captured size that runs ``batch``, or None when the step must run eagerly.

    A step can replay a graph when every row is a decode that wants its one logit row, the
    batch fits a captured size and its block tables fit the static ``max_pages`` columns.
    Prefill chunks (alone or mixed with decodes) run eagerly.
    """
    if not batch.is_pure_decode or batch.logits_indices.shape[0] != batch.num_reqs:
        return None
    if batch.block_tables.shape[1] > max_pages:
        return None
    return bucket_for(batch.num_reqs, capture_sizes)


def padding_input(
    size: int, max_pages: int, scratch_page: int, page_size: int, max_seq_len: int
) -> ModelInput:
    """A host decode batch of ``size`` padding rows, each writing and reading the scratch page.

    Device-side each row has context length 1 (its own token, in the scratch page's slot 0).
    The host maxima (``seq_lens_cpu``, ``max_seq_len``) say ``max_seq_len`` instead: a graph is
    captured with metadata built from these, so host-derived choices (e.g. the triton
    backend's split count) must hold for the longest context a replay may bring.
    """
    rows = torch.arange(size + 1, dtype=torch.int32)  # [N + 1]
    return ModelInput(
        input_ids=torch.zeros(size, dtype=torch.int64),
        positions=torch.zeros(size, dtype=torch.int64),
        query_start_loc=rows.clone(),
        seq_lens=torch.ones(size, dtype=torch.int32),
        block_tables=torch.full((size, max_pages), scratch_page, dtype=torch.int32),
        slot_mapping=torch.full((size,), scratch_page * page_size, dtype=torch.int64),
        logits_indices=torch.arange(size, dtype=torch.int64),
        query_start_loc_cpu=rows,
        seq_lens_cpu=torch.full((size,), max_seq_len, dtype=torch.int32),
        num_decodes=size,
        max_query_len=1,
        max_seq_len=max_seq_len,
        page_size=page_size,
    )


def pad_decode_input(batch: ModelInput, size: int, max_pages: int, scratch_page: int) -> ModelInput:
    """``batch`` (pure decode, host tensors) padded to ``size`` rows and ``max_pages`` columns.

    Real rows keep their values; padding rows come from :func:`padding_input`, and table
    columns past the batch's own are the scratch page. Only the fields the executor copies into
    its static buffers (input_ids, positions, seq_lens, block_tables, slot_mapping) carry the
    real rows; ``query_start_loc`` and ``logits_indices`` are ``arange`` either way.
    """
    num_reqs = batch.num_reqs
    if not batch.is_pure_decode or num_reqs > size:
        raise ValueError(
            f"pad_decode_input needs a pure decode batch of at most {size} rows; got "
            f"{num_reqs} rows of which {batch.num_decodes} decode"
        )
    padded = padding_input(size, max_pages, scratch_page, batch.page_size, batch.max_seq_len)
    padded.input_ids[:num_reqs] = batch.input_ids
    padded.positions[:num_reqs] = batch.positions
    padded.seq_lens[:num_reqs] = batch.seq_lens
    padded.seq_lens_cpu[:num_reqs] = batch.seq_lens_cpu
    padded.block_tables[:num_reqs, : batch.block_tables.shape[1]] = batch.block_tables
    padded.slot_mapping[:num_reqs] = batch.slot_mapping
    return padded
