"""The sdpa backend, the pure-torch reference, against the naive dense reference in
brigade.testing.attention (the cpu backend's C++ kernels are tested in tests/plugins/cpu)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from brigade.interfaces import NoOptions
from brigade.plugins.attention.sdpa import SdpaBackend
from brigade.testing.attention import (
    AttentionCase,
    naive_attention,
    random_attention_case,
    run_backend,
)

ATOL = 1e-5
"""fp32 output vs the float64 reference (unit-variance inputs); measured max ~1.2e-6."""

MIXED_ROWS = [
    # decodes whose contexts end mid-page, on a page boundary, and after a long context
    *[(1, 6), (1, 15), (1, 20)],
    # a fresh prefill, a single-token prompt, and a second chunk after a cached first one
    *[(7, 0), (1, 0), (5, 9)],
]


def _check(case: AttentionCase) -> None:
    output, (key_cache, value_cache) = run_backend(SdpaBackend(NoOptions()), case)
    torch.testing.assert_close(output.double(), naive_attention(case), atol=ATOL, rtol=0)
    slots = case.batch.slot_mapping
    flat_keys = key_cache.flatten(0, 1)  # [num_pages * page_size, kv_heads, head_dim]
    flat_values = value_cache.flatten(0, 1)  # [num_pages * page_size, kv_heads, head_dim]
    torch.testing.assert_close(flat_keys[slots], case.key, atol=0, rtol=0)
    torch.testing.assert_close(flat_values[slots], case.value, atol=0, rtol=0)


def _case(rows: list[tuple[int, int]], **kwargs: Any) -> AttentionCase:
    query_lens, num_computed = zip(*rows, strict=True)
    return random_attention_case(list(query_lens), list(num_computed), **kwargs)


@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_mixed_batch_matches_reference(
    page_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sliding_window: int | None,
) -> None:
    _check(
        _case(
            MIXED_ROWS,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            sliding_window=sliding_window,
            seed=page_size * 1000 + num_heads * 10 + num_kv_heads,
        )
    )


@pytest.mark.parametrize(
    "rows",
    [
        pytest.param([(1, 3), (1, 30), (1, 1)], id="pure-decode"),
        pytest.param([(12, 0), (3, 0), (9, 20)], id="pure-prefill"),
        pytest.param([(1, 0)], id="one-token-prompt"),
    ],
)
@pytest.mark.parametrize("sliding_window", [None, 1, 4, 64])
def test_batch_shapes_and_windows(rows: list[tuple[int, int]], sliding_window: int | None) -> None:
    _check(
        _case(
            rows,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            page_size=4,
            sliding_window=sliding_window,
        )
    )


def test_bfloat16_cache_and_queries_by_tolerance() -> None:
    case = _case(
        MIXED_ROWS,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=4,
        sliding_window=5,
        dtype=torch.bfloat16,
    )
    output, _ = run_backend(SdpaBackend(NoOptions()), case)
    assert output.dtype == torch.bfloat16
    torch.testing.assert_close(output.double(), naive_attention(case), atol=3e-2, rtol=0)


def test_it_runs_no_cpp_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reference stays pure torch: its results are what the kernels are checked against.
    from brigade.plugins.cpu import build as cpu_kernels

    def no_kernels() -> None:
        raise AssertionError("the sdpa backend asked for the C++ kernels")

    monkeypatch.setattr(cpu_kernels, "cpu_ops", no_kernels)
    monkeypatch.setattr(cpu_kernels, "paged_decode_kernel", no_kernels)
    assert SdpaBackend.name == "sdpa"
    _check(_case(MIXED_ROWS, num_heads=4, num_kv_heads=2, head_dim=64, page_size=4))


def test_metadata_is_built_once_per_window_and_reused() -> None:
    case = _case(MIXED_ROWS, num_heads=4, num_kv_heads=2, head_dim=64, page_size=4)
    backend = SdpaBackend(NoOptions())
    metadata = backend.build_metadata(case.batch)
    first = metadata.decode_view(None)
    assert metadata.decode_view(None) is first
    assert metadata.prefill_view(None) is metadata.prefill_view(None)
    assert metadata.decode_view(5) is not first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_cuda(dtype: torch.dtype, atol: float) -> None:
    case = _case(
        MIXED_ROWS,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        page_size=16,
        sliding_window=5,
        dtype=dtype,
        device="cuda",
    )
    output, _ = run_backend(SdpaBackend(NoOptions()), case)
    assert output.device.type == "cuda"
    torch.testing.assert_close(output.double().cpu(), naive_attention(case), atol=atol, rtol=0)
