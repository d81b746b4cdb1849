"""The triton backend against the naive dense reference and the sdpa backend.

Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 and the kernels run under Triton's CPU
interpreter, which is exact in fp32 but wrong in bf16 (DESIGN.md): those tests use fp32 and
small shapes. With CUDA the same fp32 tests run compiled on the GPU, and the ``gpu``-marked
tests add bf16/fp16 against sdpa (scripts/gpu_check.sh runs them).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

import pytest
import torch
from triton_helpers import DEVICE, HAS_CUDA, gpu_only, needs_kernels

from brigade.errors import ConfigError
from brigade.interfaces import NoOptions
from brigade.options import build_options
from brigade.plugins.attention.sdpa import SdpaBackend
from brigade.plugins.attention.triton_backend import (
    TritonAttentionOptions,
    TritonBackend,
)
from brigade.registry import Registry
from brigade.testing.attention import (
    AttentionCase,
    naive_attention,
    random_attention_case,
    run_backend,
)
from brigade.testing.conformance import check_attention_backend

ATOL = 2e-5
"""fp32 output vs the float64 reference (unit-variance inputs); measured max ~1.2e-6."""

MIXED_ROWS = [
    # decodes whose contexts end mid-page, on a page boundary, and after a long context
    *[(1, 6), (1, 15), (1, 20)],
    # a fresh prefill, a single-token prompt, and a second chunk after a cached first one
    *[(7, 0), (1, 0), (5, 9)],
]


def _case(rows: list[tuple[int, int]], **kwargs: Any) -> AttentionCase:
    query_lens, num_computed = zip(*rows, strict=True)
    kwargs.setdefault("device", DEVICE)
    return random_attention_case(list(query_lens), list(num_computed), **kwargs)


def _check(case: AttentionCase, backend: TritonBackend, atol: float = ATOL) -> torch.Tensor:
    """Output matches the reference; the new K/V, and nothing else, land in the pool."""
    output, kv_after = run_backend(backend, case)
    assert output.shape == case.query.shape
    assert output.dtype == case.query.dtype
    torch.testing.assert_close(output.double().cpu(), naive_attention(case), atol=atol, rtol=0)
    slots = case.batch.slot_mapping
    for before, after, new in zip(case.kv_cache, kv_after, (case.key, case.value), strict=True):
        flat_after = after.flatten(0, 1)  # [num_pages * page_size, kv_heads, head_dim]
        expected = before.flatten(0, 1).clone()
        expected[slots] = new.to(expected.dtype)
        assert torch.equal(flat_after, expected)
    return output


@needs_kernels
@pytest.mark.parametrize(
    ("page_size", "num_heads", "num_kv_heads", "head_dim", "sliding_window"),
    [
        (1, 4, 4, 64, None),
        (4, 4, 2, 64, 5),
        (16, 8, 2, 128, None),
        (4, 8, 2, 128, 5),
        (16, 4, 4, 128, 7),
        (1, 8, 2, 64, 3),
        # an odd page size, a group of three and a head dim that is not a power of two
        (3, 6, 2, 80, None),
    ],
)
def test_mixed_batch_matches_reference(
    page_size: int, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None
) -> None:
    case = _case(
        MIXED_ROWS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        sliding_window=sliding_window,
        seed=page_size * 1000 + num_heads * 10 + num_kv_heads,
    )
    _check(case, TritonBackend())


@needs_kernels
@pytest.mark.parametrize(
    "rows",
    [
        pytest.param([(1, 3), (1, 30), (1, 1)], id="pure-decode"),
        pytest.param([(12, 0), (3, 0), (9, 20)], id="pure-prefill"),
        pytest.param([(1, 0)], id="one-token-prompt"),
    ],
)
@pytest.mark.parametrize("sliding_window", [None, 1, 64])
def test_batch_shapes_and_windows(rows: list[tuple[int, int]], sliding_window: int | None) -> None:
    case = _case(
        rows, num_heads=4, num_kv_heads=2, head_dim=64, page_size=4, sliding_window=sliding_window
    )
    _check(case, TritonBackend())


@needs_kernels
@pytest.mark.parametrize("sliding_window", [None, 40])
@pytest.mark.parametrize("num_kv_splits", [2, 5])
def test_split_k_decode_matches_one_split(num_kv_splits: int, sliding_window: int | None) -> None:
    """Long contexts over 16-key tiles: every split holds keys, one holds only a remainder."""
    case = _case(
        [(1, 150), (1, 97), (1, 33), (6, 20)],
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        sliding_window=sliding_window,
    )
    split = _check(case, TritonBackend(TritonAttentionOptions(num_kv_splits, decode_block_n=16)))
    whole, _ = run_backend(TritonBackend(TritonAttentionOptions(1, decode_block_n=16)), case)
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=0)


@needs_kernels
def test_auto_splits_follow_the_multiprocessor_count() -> None:
    """On a 132-SM GPU a lone long decode gets several splits, a full batch gets one."""
    case = _case([(1, 300)], num_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    backend = TritonBackend(TritonAttentionOptions(decode_block_n=16))
    metadata = dataclasses.replace(backend.build_metadata(case.batch), num_multiprocessors=132)
    splits = metadata.kv_splits(2, None)
    assert splits == 300 // (4 * 16) + 1  # bounded by the context: 4 tiles a split at least
    assert metadata.kv_splits(2, 20) == 1  # a short window needs no splitting
    kv_cache = (case.kv_cache[0].clone(), case.kv_cache[1].clone())
    output = backend.forward(case.layer, case.query, case.key, case.value, kv_cache, metadata)
    torch.testing.assert_close(output.double().cpu(), naive_attention(case), atol=ATOL, rtol=0)
    crowded = dataclasses.replace(metadata, num_decodes=64, _kv_splits={})
    assert crowded.kv_splits(8, None) == 1


@needs_kernels
@pytest.mark.parametrize("sliding_window", [None, 9])
@pytest.mark.parametrize("launch", [{}, {"prefill_num_warps": 8, "prefill_num_stages": 2}])
def test_long_chunk_spans_query_blocks_and_key_tiles(
    sliding_window: int | None, launch: dict[str, int]
) -> None:
    # 16-row tiles over a group of 2: 8 tokens a block, 5 blocks; keys in 16-key tiles, the
    # blocks after the first few wholly past some of them (unmasked tiles, then the diagonal).
    options = TritonAttentionOptions(prefill_block_m=16, prefill_block_n=16, **launch)
    case = _case(
        [(40, 50), (3, 0)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=4,
        sliding_window=sliding_window,
    )
    _check(case, TritonBackend(options))


@needs_kernels
def test_strided_views_of_a_fused_projection() -> None:
    """Q/K/V sliced from one fused [T, (H + 2 KVH) * D] projection are not contiguous."""
    case = _case(MIXED_ROWS, num_heads=4, num_kv_heads=2, head_dim=64, page_size=4)
    fused = torch.cat([t.flatten(1) for t in (case.query, case.key, case.value)], dim=1)
    query, key, value = (
        part.unflatten(1, (-1, 64)) for part in fused.split([4 * 64, 2 * 64, 2 * 64], dim=1)
    )
    assert not query.is_contiguous()
    _check(dataclasses.replace(case, query=query, key=key, value=value), TritonBackend())


@needs_kernels
def test_conformance_kit() -> None:
    # test_conformance runs the full kit once the backend is registered; this is its core.
    check_attention_backend(TritonBackend(), page_sizes=(4,), head_dims=(64,), device=DEVICE)


def test_any_page_size_and_registrable_options() -> None:
    rule = TritonBackend.supported_page_sizes(TritonAttentionOptions())
    assert all(rule.allows(size) for size in (1, 3, 16, 256, 1024))
    Registry().add("attention", "triton", TritonBackend, options=TritonAttentionOptions)
    options = build_options(TritonAttentionOptions, {"num_kv_splits": 4}, "[attention]")
    assert TritonBackend(options).options.num_kv_splits == 4
    with pytest.raises(ConfigError, match="decode_block_n"):
        build_options(TritonAttentionOptions, {"decode_block_n": 48}, "[attention]")


def test_cpu_without_the_interpreter_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"needs a CUDA GPU \(or TRITON_INTERPRET=1"):
        TritonBackend.check_device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # Fine while the kernels are not yet defined (on a GPU machine they may already be,
    # compiled: the next test covers that case).
    monkeypatch.delitem(sys.modules, "brigade.plugins.attention.triton_kernels", raising=False)
    TritonBackend.check_device("cpu")


def test_missing_triton_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    with pytest.raises(RuntimeError, match="needs the 'triton' package"):
        TritonBackend.check_device("cuda")


def test_interpreter_switched_on_too_late_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compiled = types.SimpleNamespace(write_kv_kernel=object())  # not an InterpretedFunction
    monkeypatch.setitem(sys.modules, "brigade.plugins.attention.triton_kernels", compiled)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="set after the triton kernels were defined"):
        TritonBackend.check_device("cpu")


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        TritonBackend.check_device("cuda:0")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_half_precision_on_gpu_matches_sdpa(
    dtype: torch.dtype, atol: float, sliding_window: int | None
) -> None:
    case = _case(
        [(1, 700), *MIXED_ROWS, (300, 40)],  # decode rows come first
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        sliding_window=sliding_window,
        dtype=dtype,
        device="cuda",
    )
    output = _check(case, TritonBackend(), atol=atol)
    reference, _ = run_backend(SdpaBackend(NoOptions()), case)
    # Each is within atol of the float64 reference, so they are within 2 atol of each other.
    torch.testing.assert_close(output.float(), reference.float(), atol=2 * atol, rtol=0)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("head_dim", [64, 128])
def test_long_decode_batch_on_gpu_with_auto_splits(head_dim: int) -> None:
    case = _case(
        [(1, 4000), (1, 1500), (1, 17)],
        num_heads=32,
        num_kv_heads=8,
        head_dim=head_dim,
        page_size=16,
        dtype=torch.bfloat16,
        device="cuda",
    )
    assert TritonBackend().build_metadata(case.batch).kv_splits(8, None) > 1
    _check(case, TritonBackend(), atol=3e-2)
