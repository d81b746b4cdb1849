"""The CPU-run paged attention backends against the naive dense reference in
brigade.testing.attention: ``sdpa`` (pure torch), ``cpu`` on its C++ kernels, and ``cpu`` with
its kernels turned off (the sdpa paths it falls back on)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from brigade.interfaces import AttentionBackend, NoOptions
from brigade.plugins.attention import SdpaBackend
from brigade.plugins.cpu import CpuAttentionBackend, CpuAttentionOptions
from brigade.testing.attention import MIXED_ROWS, case_from_rows, check_backend

ATOL = 1e-5
"""fp32 output vs the float64 reference (unit-variance inputs); measured max ~1.2e-6."""

BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "sdpa": lambda: SdpaBackend(NoOptions()),
    "cpu-kernels": lambda: CpuAttentionBackend(NoOptions()),
    "cpu-kernels-off": lambda: CpuAttentionBackend(
        CpuAttentionOptions(native_decode=False, native_prefill=False)
    ),
}

each_backend = pytest.mark.parametrize("backend", list(BACKENDS))


@each_backend
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
    backend: str,
) -> None:
    case = case_from_rows(
        MIXED_ROWS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        sliding_window=sliding_window,
        seed=page_size * 1000 + num_heads * 10 + num_kv_heads,
    )
    check_backend(BACKENDS[backend](), case, ATOL)


@each_backend
@pytest.mark.parametrize(
    "rows",
    [
        pytest.param([(1, 3), (1, 30), (1, 1)], id="pure-decode"),
        pytest.param([(12, 0), (3, 0), (9, 20)], id="pure-prefill"),
        pytest.param([(1, 0)], id="one-token-prompt"),
    ],
)
@pytest.mark.parametrize("sliding_window", [None, 1, 4, 64])
def test_batch_shapes_and_windows(
    rows: list[tuple[int, int]], sliding_window: int | None, backend: str
) -> None:
    case = case_from_rows(
        rows, num_heads=4, num_kv_heads=2, head_dim=64, page_size=4, sliding_window=sliding_window
    )
    check_backend(BACKENDS[backend](), case, ATOL)


@each_backend
def test_bfloat16_cache_and_queries_by_tolerance(backend: str) -> None:
    case = case_from_rows(
        MIXED_ROWS,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=4,
        sliding_window=5,
        dtype=torch.bfloat16,
    )
    check_backend(BACKENDS[backend](), case, 3e-2)
