"""What only the sdpa backend promises: it is pure torch, its metadata is built once per window,
and it runs on CUDA (its results against the reference: test_paged_attention.py; the cpu
backend's C++ kernels: tests/plugins/cpu)."""

from __future__ import annotations

import pytest
import torch

from brigade.interfaces import NoOptions
from brigade.plugins.attention.sdpa import SdpaBackend
from brigade.testing.attention import (
    MIXED_ROWS,
    case_from_rows,
    check_backend,
    naive_attention,
    run_backend,
)

ATOL = 1e-5
"""fp32 output vs the float64 reference (unit-variance inputs); measured max ~1.2e-6."""


def test_it_runs_no_cpp_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reference stays pure torch: its results are what the kernels are checked against.
    from brigade.plugins.cpu import build as cpu_kernels

    def no_kernels() -> None:
        raise AssertionError("the sdpa backend asked for the C++ kernels")

    monkeypatch.setattr(cpu_kernels, "cpu_ops", no_kernels)
    monkeypatch.setattr(cpu_kernels, "paged_decode_kernel", no_kernels)
    assert SdpaBackend.name == "sdpa"
    case = case_from_rows(MIXED_ROWS, num_heads=4, num_kv_heads=2, head_dim=64, page_size=4)
    check_backend(SdpaBackend(NoOptions()), case, ATOL)


def test_metadata_is_built_once_per_window_and_reused() -> None:
    case = case_from_rows(MIXED_ROWS, num_heads=4, num_kv_heads=2, head_dim=64, page_size=4)
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
    case = case_from_rows(
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
