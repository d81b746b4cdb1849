"""A naive attention reference and random ragged cases, for testing any attention backend.

A case is one step over a paged KV pool: rows of decodes and prefill chunks whose cached
context already sits in shuffled pages, plus the new tokens' Q/K/V. :func:`naive_attention`
computes the expected output from dense per-request K/V in float64, one request at a time;
:func:`run_backend` runs a backend on a copy of the pool. A backend passes when the two agree
and the new K/V land at ``slot_mapping``::

    case = random_attention_case([1, 1, 7], [9, 15, 4], num_heads=8, num_kv_heads=2,
                                 head_dim=64, page_size=4, sliding_window=5)
    output, kv_cache = run_backend(MyBackend(options), case)
    torch.testing.assert_close(output.double(), naive_attention(case), atol=1e-5, rtol=0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from brigade.interfaces import AttentionBackend, AttentionLayer, ModelInput
from brigade.model_input import SeqChunk, build_model_input

__all__ = [
    "MIXED_ROWS",
    "AttentionCase",
    "case_from_rows",
    "check_backend",
    "naive_attention",
    "random_attention_case",
    "run_backend",
]

MIXED_ROWS = (
    # decodes whose contexts end mid-page, on a page boundary, and after a long context
    *[(1, 6), (1, 15), (1, 20)],
    # a fresh prefill, a single-token prompt, and a second chunk after a cached first one
    *[(7, 0), (1, 0), (5, 9)],
)
"""(new tokens, cached tokens) of a step's rows that reach every path of a backend."""


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionCase:
    """One attention step: the layer, the batch, the new tokens' Q/K/V and the KV pool."""

    layer: AttentionLayer
    batch: ModelInput
    query: torch.Tensor
    """[T, num_heads, head_dim] queries of the new tokens."""
    key: torch.Tensor
    """[T, num_kv_heads, head_dim] keys of the new tokens (the backend writes them)."""
    value: torch.Tensor
    """[T, num_kv_heads, head_dim] values of the new tokens."""
    kv_cache: tuple[torch.Tensor, torch.Tensor]
    """K and V pools [num_pages, page_size, num_kv_heads, head_dim] holding the cached
    context of every row; every slot no row owns holds large finite values (stale K/V), which
    a backend must mask out."""
    dense_keys: tuple[torch.Tensor, ...]
    """Per row: [seq_len, num_kv_heads, head_dim] keys of the whole context, new ones last."""
    dense_values: tuple[torch.Tensor, ...]
    """Per row: [seq_len, num_kv_heads, head_dim] values, as ``dense_keys``."""


def random_attention_case(
    query_lens: Sequence[int],
    num_computed: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    sliding_window: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_pages: int = 3,
) -> AttentionCase:
    """Rows with ``query_lens[i]`` new tokens after ``num_computed[i]`` cached ones.

    Decode rows (one token after a cached context) must come first. Pages are a random
    permutation of the pool, so block tables are neither contiguous nor ordered.
    """
    if len(query_lens) != len(num_computed):
        raise ValueError("query_lens and num_computed need one entry per row")
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for q, c in zip(query_lens, num_computed, strict=True)]
    pages_per_row = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_per_row) + spare_pages
    tables = _shuffled_block_tables(pages_per_row, num_pages, generator)
    batch = _ragged_batch(query_lens, num_computed, tables, page_size)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    pool_shape = (num_pages, page_size, num_kv_heads, head_dim)
    key_pool, value_pool = randn(*pool_shape, scale=100.0), randn(*pool_shape, scale=100.0)
    dense_keys = [randn(s, num_kv_heads, head_dim) for s in seq_lens]
    dense_values = [randn(s, num_kv_heads, head_dim) for s in seq_lens]
    for row, (table, computed) in enumerate(zip(tables, num_computed, strict=True)):
        _write_context(key_pool, table, dense_keys[row][:computed])
        _write_context(value_pool, table, dense_values[row][:computed])
    new_keys = torch.cat([k[c:] for k, c in zip(dense_keys, num_computed, strict=True)])
    new_values = torch.cat([v[c:] for v, c in zip(dense_values, num_computed, strict=True)])
    layer = AttentionLayer(
        layer_index=0,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        scale=head_dim**-0.5,
        sliding_window=sliding_window,
    )
    return AttentionCase(
        layer=layer,
        batch=batch.to(device),
        query=randn(batch.num_tokens, num_heads, head_dim).to(device),
        key=new_keys.to(device),
        value=new_values.to(device),
        kv_cache=(key_pool.to(device), value_pool.to(device)),
        dense_keys=tuple(dense_keys),
        dense_values=tuple(dense_values),
    )


def _shuffled_block_tables(
    pages_per_row: Sequence[int], num_pages: int, generator: torch.Generator
) -> list[list[int]]:
    """Each row's pages, taken in turn from a random permutation of the pool."""
    page_order = torch.randperm(num_pages, generator=generator).tolist()
    tables, next_index = [], 0
    for count in pages_per_row:
        tables.append(page_order[next_index : next_index + count])
        next_index += count
    return tables


def _ragged_batch(
    query_lens: Sequence[int],
    num_computed: Sequence[int],
    tables: Sequence[list[int]],
    page_size: int,
) -> ModelInput:
    """One chunk per row: its new tokens (their ids unused) after its cached ones, every
    position's output wanted."""
    chunks = [
        SeqChunk([0] * q, c, table, want_logits="all")
        for q, c, table in zip(query_lens, num_computed, tables, strict=True)
    ]
    return build_model_input(chunks, page_size)


def _write_context(pool: torch.Tensor, table: Sequence[int], context: torch.Tensor) -> None:
    """Put a row's cached ``context`` [num_computed, num_kv_heads, head_dim] in ``pool``
    [num_pages, page_size, num_kv_heads, head_dim] at positions 0.. of its pages ``table``."""
    page_size = pool.shape[1]
    positions = torch.arange(context.shape[0])
    pages = torch.tensor(table, dtype=torch.int64)[positions // page_size]
    pool[pages, positions % page_size] = context


def naive_attention(case: AttentionCase) -> torch.Tensor:
    """Expected output [T, num_heads, head_dim] in float64, one request at a time.

    A query at position p sees keys at positions <= p, and only those > p - window when the
    layer slides.
    """
    layer = case.layer
    group = layer.num_heads // layer.num_kv_heads
    starts = case.batch.query_start_loc_cpu.tolist()
    outputs = []
    for row, (keys, values) in enumerate(zip(case.dense_keys, case.dense_values, strict=True)):
        query = case.query[starts[row] : starts[row + 1]].double().cpu()  # [n, heads, hd]
        seq_len, num_queries = keys.shape[0], query.shape[0]
        keys = keys.double().repeat_interleave(group, dim=1)  # [seq_len, heads, hd]
        values = values.double().repeat_interleave(group, dim=1)  # [seq_len, heads, hd]
        query_positions = torch.arange(seq_len - num_queries, seq_len)[:, None]
        relative = query_positions - torch.arange(seq_len)[None, :]  # [n, seq_len]
        allowed = relative >= 0
        if layer.sliding_window is not None:
            allowed &= relative < layer.sliding_window
        scores = torch.einsum("qhd,khd->hqk", query, keys) * layer.scale  # [heads, n, seq_len]
        scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # [heads, n, seq_len]
        outputs.append(torch.einsum("hqk,khd->qhd", weights, values))  # [n, heads, hd]
    return torch.cat(outputs)


def run_backend(
    backend: AttentionBackend, case: AttentionCase
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Run ``backend`` on a copy of the case's pool: (output, the pool after the write)."""
    kv_cache = (case.kv_cache[0].clone(), case.kv_cache[1].clone())
    metadata = backend.build_metadata(case.batch)
    output = backend.forward(case.layer, case.query, case.key, case.value, kv_cache, metadata)
    return output, kv_cache


def case_from_rows(rows: Sequence[tuple[int, int]], **kwargs: Any) -> AttentionCase:
    """:func:`random_attention_case` from (new tokens, cached tokens) per row."""
    query_lens, num_computed = zip(*rows, strict=True)
    return random_attention_case(list(query_lens), list(num_computed), **kwargs)


def check_backend(backend: AttentionBackend, case: AttentionCase, atol: float) -> None:
    """Assert that ``backend`` attends like :func:`naive_attention` (within ``atol``) and writes
    the new K/V exactly at ``slot_mapping``."""
    output, (key_cache, value_cache) = run_backend(backend, case)
    assert output.dtype == case.query.dtype
    torch.testing.assert_close(output.double(), naive_attention(case), atol=atol, rtol=0)
    slots = case.batch.slot_mapping
    flat_keys = key_cache.flatten(0, 1)  # [num_pages * page_size, kv_heads, head_dim]
    flat_values = value_cache.flatten(0, 1)  # [num_pages * page_size, kv_heads, head_dim]
    torch.testing.assert_close(flat_keys[slots], case.key.to(key_cache.dtype), atol=0, rtol=0)
    torch.testing.assert_close(flat_values[slots], case.value.to(value_cache.dtype), atol=0, rtol=0)
