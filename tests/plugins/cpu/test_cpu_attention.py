"""Brigade's C++ decode and prefill attention for CPUs (prefill also on AMX tiles) against a plain
softmax over each row's own keys."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from brigade.plugins.cpu import build as cpu_kernels
from brigade.plugins.cpu.build import (
    exclusive_build,
    kernels_take_head_dim,
    paged_decode_kernel,
)
from brigade.plugins.cpu.gemm import tiles_usable


def _paged_case(
    lengths: list[int], *, heads: int, kv_heads: int, head_dim: int, page_size: int, seed: int
) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // page_size) for n in lengths) + 1  # a spare column, never read
    num_pages = len(lengths) * max_pages + 3
    key_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=generator)
    # Each row's pages scattered over the pool, padded with page ids nobody should read.
    order = torch.randperm(num_pages, generator=generator)
    block_tables = order[: len(lengths) * max_pages].view(len(lengths), max_pages).clone()
    query = torch.randn(len(lengths), heads, head_dim, generator=generator)
    return query, key_cache, value_cache, block_tables, torch.tensor(lengths)


def _reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int,
    scale: float,
) -> torch.Tensor:
    page_size = key_cache.shape[1]
    group = query.shape[1] // key_cache.shape[2]
    out = torch.zeros_like(query)
    for row, length in enumerate(seq_lens.tolist()):
        first = max(0, length - window) if window else 0
        positions = torch.arange(first, length)
        pages = block_tables[row, positions // page_size]
        keys = key_cache[pages, positions % page_size].float()  # [n, kv_heads, head_dim]
        values = value_cache[pages, positions % page_size].float()
        keys = keys.repeat_interleave(group, dim=1)  # [n, heads, head_dim]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[row], keys) * scale
        out[row] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), values)
    return out


def _on_threads(threads: int, call: Callable[[], torch.Tensor]) -> torch.Tensor:
    """call() with torch's thread count set to ``threads`` (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return call()
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def kernel() -> object:
    built = paged_decode_kernel()
    assert built is not None, "the CPU attention kernel failed to build (see the log)"
    return built


@pytest.mark.parametrize(
    ("heads", "kv_heads", "page_size", "window", "dtype", "head_dim"),
    [
        (9, 3, 16, 0, torch.float32, 64),  # SmolLM2's grouping
        (4, 4, 1, 0, torch.float32, 64),  # no grouping, one token per page
        (8, 2, 4, 5, torch.float32, 64),  # sliding window shorter than most rows
        (8, 2, 16, 0, torch.bfloat16, 64),  # a bfloat16 cache (widened as it is loaded)
        (8, 2, 4, 5, torch.bfloat16, 64),  # bfloat16 with a sliding window
        (4, 2, 16, 0, torch.float32, 128),  # two 64-float blocks per head
        (4, 2, 8, 0, torch.float32, 40),  # a partial block of vectors
        (4, 2, 8, 0, torch.float32, 36),  # not a multiple of 8: the scalar loops
        (4, 2, 8, 0, torch.bfloat16, 36),  # the scalar loops on a bfloat16 cache
    ],
)
def test_paged_decode_equals_softmax_over_each_rows_own_keys(
    kernel: object,
    heads: int,
    kv_heads: int,
    page_size: int,
    window: int,
    dtype: torch.dtype,
    head_dim: int,
) -> None:
    lengths = [1, 7, 16, 17, 130, 3]  # mixed: one page, page edges, many pages
    query, keys, values, tables, seq_lens = _paged_case(
        lengths, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, seed=heads
    )
    keys, values = keys.to(dtype), values.to(dtype)
    scale = head_dim**-0.5
    out = kernel(query, keys, values, tables, seq_lens, window, scale)  # type: ignore[operator]
    expected = _reference(query, keys, values, tables, seq_lens, window, scale)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths", [[130], [130, 17], [40, 1, 9]])
def test_rows_fewer_than_twice_the_threads_are_cut_into_key_ranges(
    kernel: object, lengths: list[int]
) -> None:
    # With fewer rows than twice the threads a row's keys are cut into ranges (the rows long
    # enough for it), each range a task over all the row's KV heads.
    query, keys, values, tables, seq_lens = _paged_case(
        lengths, heads=9, kv_heads=3, head_dim=64, page_size=16, seed=len(lengths)
    )
    out = _on_threads(2, lambda: kernel(query, keys, values, tables, seq_lens, 0, 0.125))  # type: ignore[operator]
    expected = _reference(query, keys, values, tables, seq_lens, 0, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize(
    ("lengths", "heads", "kv_heads", "window", "head_dim", "dtype"),
    [
        ([1000], 9, 3, 0, 64, torch.float32),  # one row: its 3 KV heads' keys cut into ranges
        ([1000], 9, 3, 300, 64, torch.float32),  # a sliding window starting mid-page
        ([517, 2], 4, 1, 0, 64, torch.bfloat16),  # a row too short to fill its ranges
        ([1000, 0], 4, 1, 0, 64, torch.float32),  # a row with no keys: zeros, not NaN
        ([700], 4, 2, 0, 36, torch.float32),  # the scalar loops
    ],
)
def test_too_few_tasks_for_the_threads_are_cut_into_key_ranges_and_merged(
    kernel: object,
    threads: int,
    lengths: list[int],
    heads: int,
    kv_heads: int,
    window: int,
    head_dim: int,
    dtype: torch.dtype,
) -> None:
    # A batch of one row has one task per KV head; with fewer tasks than threads each task's
    # keys are cut into ranges of whole pages, whose results merge by their log-sum-exps.
    query, keys, values, tables, seq_lens = _paged_case(
        lengths, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=16, seed=threads
    )
    keys, values = keys.to(dtype), values.to(dtype)
    out = _on_threads(
        threads,
        lambda: kernel(query, keys, values, tables, seq_lens, window, 0.125),  # type: ignore[operator]
    )
    expected = _reference(query, keys, values, tables, seq_lens, window, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [2, 3])
def test_rows_of_unequal_lengths_are_shared_out_by_keys(kernel: object, threads: int) -> None:
    # The threads take runs of rows with about equal keys (long rows first: the first thread's
    # run is a few rows, the last one's many), every row attended to once.
    lengths = [400, 350, 300] + [5 + 7 * i for i in range(30)] + [0, 1]
    query, keys, values, tables, seq_lens = _paged_case(
        lengths, heads=9, kv_heads=3, head_dim=64, page_size=16, seed=threads
    )
    out = _on_threads(threads, lambda: kernel(query, keys, values, tables, seq_lens, 0, 0.125))  # type: ignore[operator]
    expected = _reference(query, keys, values, tables, seq_lens, 0, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_rows_another_thread_takes_over_give_the_same_bits(kernel: object) -> None:
    # A thread done with its run takes the last rows of another's (cpu_tasks.h). Six threads
    # (more than CI's two cores) start and finish at different times, so which thread attends
    # to which row changes from call to call: every call equals the one-thread result bit for
    # bit.
    lengths = [3 + 37 * i % 300 for i in range(60)]
    query, keys, values, tables, seq_lens = _paged_case(
        lengths, heads=8, kv_heads=2, head_dim=64, page_size=16, seed=11
    )
    query, keys, values = query.bfloat16(), keys.bfloat16(), values.bfloat16()

    def call() -> torch.Tensor:
        return kernel(query, keys, values, tables, seq_lens, 0, 0.125)  # type: ignore[operator, no-any-return]

    alone = _on_threads(1, call)
    for _ in range(20):
        assert torch.equal(_on_threads(6, call), alone)
    expected = _reference(query.float(), keys, values, tables, seq_lens, 0, 0.125)
    torch.testing.assert_close(alone.float(), expected, atol=1e-5, rtol=2**-8)


@pytest.mark.parametrize("head_dim", [64, 36])
def test_a_bfloat16_query_is_computed_in_float32_and_rounded_once(
    kernel: object, head_dim: int
) -> None:
    lengths = [1, 7, 16, 17, 130, 3]
    query, keys, values, tables, seq_lens = _paged_case(
        lengths, heads=9, kv_heads=3, head_dim=head_dim, page_size=16, seed=5
    )
    query, keys, values = query.bfloat16(), keys.bfloat16(), values.bfloat16()
    scale = head_dim**-0.5
    out = kernel(query, keys, values, tables, seq_lens, 0, scale)  # type: ignore[operator]
    assert out.dtype == torch.bfloat16
    expected = _reference(query.float(), keys, values, tables, seq_lens, 0, scale)
    # float32 arithmetic on the bfloat16 inputs, one rounding of the result: within half a
    # bfloat16 unit of the exact value (plus float32 noise)
    torch.testing.assert_close(out.float(), expected, atol=1e-5, rtol=2**-8)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [
        (9, 3, 64),  # SmolLM2: three query heads a KV head
        (16, 2, 128),  # 8 query heads a KV head: the values pass takes them a few at a time
        (14, 2, 32),  # 7 query heads a KV head, one pair of vectors per head
        (4, 1, 48),  # an odd number of vectors per head: no pairs
        (6, 6, 16),  # one query head a KV head, one vector per head
    ],
)
def test_bfloat16_queries_on_a_bfloat16_cache_for_each_head_grouping(
    kernel: object, heads: int, kv_heads: int, head_dim: int
) -> None:
    lengths = [1, 7, 16, 17, 130, 3, 64]
    query, keys, values, tables, seq_lens = _paged_case(
        lengths, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=16, seed=heads
    )
    query, keys, values = query.bfloat16(), keys.bfloat16(), values.bfloat16()
    scale = head_dim**-0.5
    out = kernel(query, keys, values, tables, seq_lens, 0, scale)  # type: ignore[operator]
    expected = _reference(query.float(), keys, values, tables, seq_lens, 0, scale)
    torch.testing.assert_close(out.float(), expected, atol=1e-5, rtol=2**-8)


def test_a_row_longer_than_its_block_table_is_refused(kernel: object) -> None:
    query, keys, values, tables, _ = _paged_case(
        [5, 9], heads=2, kv_heads=1, head_dim=8, page_size=4, seed=0
    )
    too_long = torch.tensor([5, tables.shape[1] * 4 + 1])
    with pytest.raises(RuntimeError, match="row 1 has 17 tokens but its block table holds 16"):
        kernel(query, keys, values, tables, too_long, 0, 1.0)  # type: ignore[operator]


def test_a_kernel_that_cannot_be_built_is_reported_once_and_none_returned(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_compiler() -> object:
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(cpu_kernels, "_build", no_compiler)
    cpu_kernels.cpu_ops.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert paged_decode_kernel() is None
            assert paged_decode_kernel() is None
    finally:
        cpu_kernels.cpu_ops.cache_clear()  # later tests build (or load) the real one
    warnings = [r for r in caplog.records if "could not be built" in r.getMessage()]
    assert len(warnings) == 1
    assert "c++: command not found" in warnings[0].getMessage()


def test_a_build_killed_midway_does_not_hang_the_next_one(tmp_path: Path) -> None:
    # torch's load() waits forever on a `lock` file a killed build left behind.
    stale = tmp_path / "lock"
    stale.touch()
    with exclusive_build(tmp_path):
        assert not stale.exists()
    done = threading.Event()

    def hold_then_build() -> None:
        with exclusive_build(tmp_path):
            done.set()

    with exclusive_build(tmp_path):  # another process builds: the next one waits its turn
        worker = threading.Thread(target=hold_then_build)
        worker.start()
        worker.join(timeout=0.5)
        assert not done.is_set(), "a second build did not wait for the first"
    worker.join(timeout=10)
    assert done.is_set()


def _prefill_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    chunks: torch.Tensor,
    window: int,
    scale: float,
) -> torch.Tensor:
    """Each chunk's tokens attend causally (and within the window) to their row's keys."""
    page_size = key_cache.shape[1]
    group = query.shape[1] // key_cache.shape[2]
    outputs = []
    for row, first, end, seq_len in chunks.tolist():
        positions = torch.arange(seq_len)
        pages = block_tables[row, positions // page_size]
        keys = key_cache[pages, positions % page_size].float().repeat_interleave(group, dim=1)
        values = value_cache[pages, positions % page_size].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,khd->htk", query[first:end].float(), keys) * scale
        query_positions = torch.arange(seq_len - (end - first), seq_len)[:, None]
        visible = positions[None, :] <= query_positions
        if window:
            visible &= positions[None, :] > query_positions - window
        weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        outputs.append(torch.einsum("htk,khd->thd", weights, values))
    return torch.cat(outputs)


def _prefill_case(
    heads: int, kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype
) -> tuple[Any, ...]:
    """Chunks of six rows over scattered pages: (query, key_cache, value_cache, block_tables,
    chunks, the end of the last chunk, the first chunk's first token)."""
    # (row length after the step, its new tokens): a whole prompt, chunks after cached
    # prefixes (short, across pages, longer than a key block), one token, a long prompt.
    rows = [(5, 5), (40, 7), (300, 33), (130, 130), (34, 1), (600, 600)]
    generator = torch.Generator().manual_seed(heads + head_dim)
    max_pages = max(-(-n // page_size) for n, _ in rows) + 1
    num_pages = len(rows) * max_pages + 2
    key_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=generator)
    key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    order = torch.randperm(num_pages, generator=generator)
    block_tables = order[: len(rows) * max_pages].view(len(rows), max_pages).clone()
    offset = 3  # three decode tokens before the chunks, which the kernel must not read
    spans, token = [], offset
    for row, (length, new) in enumerate(rows):
        spans.append([row, token, token + new, length])
        token += new
    chunks = torch.tensor(spans)
    query = torch.randn(token, heads, head_dim, generator=generator).to(dtype)
    return query, key_cache, value_cache, block_tables, chunks, token, offset


@pytest.fixture(scope="module")
def ops() -> object:
    built = cpu_kernels.cpu_ops()
    assert built is not None, "the CPU kernels failed to build (see the log)"
    return built


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page_size", "window", "dtype"),
    [
        (9, 3, 64, 16, 0, torch.float32),  # SmolLM2's shape
        (9, 3, 64, 16, 20, torch.float32),  # a sliding window shorter than most chunks
        (9, 3, 64, 16, 0, torch.bfloat16),
        (8, 2, 128, 4, 0, torch.float32),  # eight vectors per head, small pages
        (4, 4, 32, 1, 7, torch.bfloat16),  # no grouping, one token per page
        (8, 1, 16, 16, 0, torch.float32),  # all heads on one KV head
    ],
)
def test_paged_prefill_equals_causal_softmax_over_each_rows_keys(
    ops: object,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    window: int,
    dtype: torch.dtype,
) -> None:
    if not kernels_take_head_dim(head_dim, ops.vector_lanes()):  # type: ignore[attr-defined]
        pytest.skip(f"head_dim {head_dim} does not fill this CPU's vectors")
    query, key_cache, value_cache, block_tables, chunks, token, offset = _prefill_case(
        heads, kv_heads, head_dim, page_size, dtype
    )
    scale = head_dim**-0.5
    out = ops.paged_prefill(query, key_cache, value_cache, block_tables, chunks, window, scale)  # type: ignore[attr-defined]
    assert out.shape == (token - offset, heads, head_dim)
    assert out.dtype == dtype
    expected = _prefill_reference(
        query, key_cache, value_cache, block_tables, chunks, window, scale
    )
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    else:  # float32 arithmetic, one rounding of the result
        torch.testing.assert_close(out.float(), expected, atol=1e-5, rtol=2**-8)


@pytest.mark.skipif(not tiles_usable(), reason="no AMX tiles on this CPU")
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page_size", "window"),
    [
        (9, 3, 64, 16, 0),  # SmolLM2's shape
        (9, 3, 64, 16, 20),  # a sliding window shorter than most chunks
        (16, 8, 64, 16, 0),  # the small Llama's: groups of 2, tasks of 64 tokens
        (8, 2, 128, 4, 0),  # a wider head, small pages
        (4, 4, 32, 1, 7),  # no grouping, one token per page
        (8, 1, 16, 16, 0),  # all heads on one KV head
    ],
)
def test_paged_prefill_on_amx_tiles_equals_causal_softmax_over_each_rows_keys(
    ops: object, heads: int, kv_heads: int, head_dim: int, page_size: int, window: int
) -> None:
    """bfloat16 products summed in float32, the softmax weights rounded to bfloat16 before
    the second product (as torch's flash attention rounds them): within bfloat16's precision
    of the float32 reference."""
    query, key_cache, value_cache, block_tables, chunks, token, offset = _prefill_case(
        heads, kv_heads, head_dim, page_size, torch.bfloat16
    )
    scale = head_dim**-0.5
    out = ops.paged_prefill_tiles(  # type: ignore[attr-defined]
        query, key_cache, value_cache, block_tables, chunks, window, scale
    )
    assert out.shape == (token - offset, heads, head_dim)
    assert out.dtype == torch.bfloat16
    expected = _prefill_reference(
        query, key_cache, value_cache, block_tables, chunks, window, scale
    )
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2**-6)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.paged_prefill_tiles(  # type: ignore[attr-defined]
            query.float(), key_cache, value_cache, block_tables, chunks, window, scale
        )
    too_long = chunks[:1].clone()
    too_long[0, 3] = block_tables.shape[1] * page_size + 1
    with pytest.raises(RuntimeError, match="inside its row's block table"):
        ops.paged_prefill_tiles(  # type: ignore[attr-defined]
            query, key_cache, value_cache, block_tables, too_long, window, scale
        )


def test_paged_prefill_refuses_chunks_that_do_not_fit(ops: object) -> None:
    query, keys, values, tables, _ = _paged_case(
        [5, 9], heads=2, kv_heads=1, head_dim=16, page_size=4, seed=0
    )
    too_long = torch.tensor([[0, 0, 2, tables.shape[1] * 4 + 1]])
    with pytest.raises(RuntimeError, match="inside its row's block table"):
        ops.paged_prefill(query, keys, values, tables, too_long, 0, 1.0)  # type: ignore[attr-defined]
    gap = torch.tensor([[0, 0, 1, 3], [1, 2, 3, 4]])  # token 1 belongs to no chunk
    with pytest.raises(RuntimeError, match="contiguous run"):
        ops.paged_prefill(query, keys, values, tables, gap, 0, 1.0)  # type: ignore[attr-defined]
