"""Cascade decode attention on a CPU: rows whose block tables start with the same pages (a
prefix the prefix cache holds once) score those keys together. The result must be what each row
gets over its own keys, and the grouping must pick the rows that share the most."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import assert_same_greedy, make_llm, prompts, run

from brigade.models.create import create_model
from brigade.plugins.cpu.build import cpu_ops, kernels_take_head_dim

PAGE = 16


@pytest.fixture(scope="module")
def ops() -> object:
    built = cpu_ops()
    assert built is not None, "the CPU kernels failed to build (see the log)"
    return built


def _layout(
    shared: list[tuple[int, int, int]], lengths: list[int], page_size: int, seed: int
) -> torch.Tensor:
    """Block tables for rows of `lengths`: rows [first, last) of each (first, last, pages) of
    `shared` start with the same `pages` pages (those of row `first`); all else distinct."""
    max_pages = max(-(-n // page_size) for n in lengths) + 1
    generator = torch.Generator().manual_seed(seed)
    tables = torch.randperm(len(lengths) * max_pages + 7, generator=generator)
    tables = tables[: len(lengths) * max_pages].view(len(lengths), max_pages).clone()
    for first, last, pages in shared:
        tables[first + 1 : last, :pages] = tables[first, :pages]
    return tables


def _case() -> tuple[list[int], list[tuple[int, int, int]], list[int]]:
    """(lengths, shared pages, the keys each row should share)."""
    lengths = [96 + 1 + (7 * row) % 40 for row in range(36)]  # A: 36 rows on 6 shared pages
    lengths.append(96 + 9)  # 36: A's first 2 pages only, so it is left out of A
    lengths += [80 + 3, 80 + 16]  # B: 37-38 share 5 pages; 38 ends on a page's first slot
    lengths += [140, 0, 6 * PAGE + PAGE]  # 39: alone; 40: not a decode row; 41: A's 6 pages
    shared = [(0, 36, 6), (0, 37, 2), (37, 39, 5)]
    expected = [96] * 36 + [0, 80, 80, 0, 0, 96]
    return lengths, shared, expected


def _tables(lengths: list[int], shared: list[tuple[int, int, int]]) -> torch.Tensor:
    tables = _layout(shared, lengths, PAGE, seed=3)
    tables[41, :6] = tables[0, :6]
    return tables


def _reference(query, key_cache, value_cache, tables, lengths, scale) -> torch.Tensor:
    group = query.shape[1] // key_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float32)
    for row, length in enumerate(lengths):
        if length == 0:
            continue
        positions = torch.arange(length)
        pages = tables[row, positions // PAGE]
        keys = key_cache[pages, positions % PAGE].float().repeat_interleave(group, dim=1)
        values = value_cache[pages, positions % PAGE].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[row].float(), keys) * scale
        out[row] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), values)
    return out


def test_rows_are_grouped_by_the_pages_they_share(ops: object) -> None:
    lengths, shared, expected = _case()
    tables = _tables(lengths, shared)
    keys = ops.shared_decode_keys(tables, torch.tensor(lengths), PAGE)  # type: ignore[attr-defined]
    assert keys.tolist() == expected


def test_every_row_keeps_a_key_of_its_own_and_short_prefixes_are_not_shared(ops: object) -> None:
    # Two rows whose every page is the same (a whole last page too): only the pages before
    # the one holding the newest token are shared; 3 pages (48 keys) are too few to pay.
    tables = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 3, 5]])
    share = ops.shared_decode_keys  # type: ignore[attr-defined]
    assert share(tables, torch.tensor([80, 80]), PAGE).tolist() == [64, 64]
    assert share(tables, torch.tensor([64, 64]), PAGE).tolist() == [0, 0]
    assert share(tables, torch.tensor([65, 65]), PAGE).tolist() == [64, 64]
    assert share(tables, torch.tensor([80]), PAGE).tolist() == [0]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype"),
    [
        (9, 3, 64, torch.float32),  # SmolLM2's shape
        (9, 3, 64, torch.bfloat16),  # bfloat16 queries and cache
        (4, 2, 128, torch.float32),
        (8, 1, 16, torch.float32),  # every query head on one KV head
        (4, 2, 36, torch.float32),  # not whole vectors: no cascade, the scalar loops
    ],
)
def test_cascade_equals_each_rows_softmax_over_its_own_keys(
    ops: object, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    lengths, shared, _ = _case()
    tables = _tables(lengths, shared)
    generator = torch.Generator().manual_seed(heads * head_dim)
    num_pages = int(tables.max()) + 1
    key_cache = torch.randn(num_pages, PAGE, kv_heads, head_dim, generator=generator).to(dtype)
    value_cache = torch.randn(num_pages, PAGE, kv_heads, head_dim, generator=generator).to(dtype)
    query = torch.randn(len(lengths), heads, head_dim, generator=generator).to(dtype)
    seq_lens, scale = torch.tensor(lengths), head_dim**-0.5
    decode = ops.paged_decode  # type: ignore[attr-defined]
    cascaded = decode(query, key_cache, value_cache, tables, seq_lens, 0, scale, True)
    alone = decode(query, key_cache, value_cache, tables, seq_lens, 0, scale, False)
    expected = _reference(query, key_cache, value_cache, tables, lengths, scale)
    assert cascaded.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(cascaded, expected, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(cascaded, alone, atol=2e-6, rtol=1e-5)
    else:  # float32 arithmetic, one rounding of the result
        torch.testing.assert_close(cascaded.float(), expected, atol=1e-5, rtol=2**-8)
        torch.testing.assert_close(cascaded.float(), alone.float(), atol=1e-5, rtol=2**-7)
    if not kernels_take_head_dim(head_dim, ops.vector_lanes()):  # type: ignore[attr-defined]
        assert torch.equal(cascaded, alone)  # the scalar path never cascades


def test_a_sliding_window_is_never_cascaded(ops: object) -> None:
    lengths, shared, _ = _case()
    tables = _tables(lengths, shared)
    generator = torch.Generator().manual_seed(7)
    num_pages = int(tables.max()) + 1
    key_cache = torch.randn(num_pages, PAGE, 2, 64, generator=generator)
    value_cache = torch.randn(num_pages, PAGE, 2, 64, generator=generator)
    query = torch.randn(len(lengths), 4, 64, generator=generator)
    decode = ops.paged_decode  # type: ignore[attr-defined]
    args = (query, key_cache, value_cache, tables, torch.tensor(lengths), 50, 0.125)
    assert torch.equal(decode(*args, True), decode(*args, False))


def test_the_engine_gives_the_same_greedy_tokens_with_and_without_cascade(
    tmp_path: Path,
) -> None:
    # Requests behind one cached 96-token prefix (24 pages of 4) decode together: their block
    # tables share those pages, so the cascade path runs; every row's greedy tokens and
    # log probabilities must be what each row reading its own pages gives.
    model = create_model(tmp_path / "llama", "llama", overrides={"num_hidden_layers": 2})
    prefix = prompts([96], seed=1)[0]
    batch = [prefix + tail for tail in prompts([3, 9, 17, 1, 30, 5], seed=2)]
    batch += prompts([40], seed=3)  # one request sharing nothing
    results = {}
    for cascade in (True, False):
        llm = make_llm(
            model,
            "kv.enable_prefix_caching=true",
            f"attention.cascade_decode={str(cascade).lower()}",
        )
        run(llm, [prefix])  # the prefix cached, as a system prompt seen before
        results[cascade] = run(llm, batch)
        del llm
    assert_same_greedy(results[True], results[False], "cascade vs each row alone")
