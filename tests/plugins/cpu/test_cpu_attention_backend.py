"""What only the cpu attention backend does: which kernel takes which rows, its fallback when the
kernels cannot be built, its registration (its results against the reference, kernels on and
off: tests/plugins/attention/test_paged_attention.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from brigade.interfaces import NoOptions
from brigade.plugins.cpu import attention as cpu_attention
from brigade.plugins.cpu import build as cpu_kernels
from brigade.plugins.cpu.attention import CpuAttentionBackend, CpuAttentionOptions
from brigade.testing.attention import MIXED_ROWS, case_from_rows, naive_attention, run_backend

ATOL = 1e-5
"""fp32 output vs the float64 reference (unit-variance inputs); measured max ~1.2e-6."""


def _backend(native: bool) -> CpuAttentionBackend:
    return CpuAttentionBackend(CpuAttentionOptions(native_decode=native, native_prefill=native))


def test_prefill_chunks_take_the_cpu_kernel_not_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    case = case_from_rows(MIXED_ROWS, num_heads=4, num_kv_heads=2, head_dim=64, page_size=4)

    def no_sdpa(*args: object, **kwargs: object) -> None:
        raise AssertionError("SDPA ran although the CPU kernels take every row")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", no_sdpa)
    output, _ = run_backend(_backend(native=True), case)
    torch.testing.assert_close(output.double(), naive_attention(case), atol=ATOL, rtol=0)
    with pytest.raises(AssertionError, match="SDPA ran"):
        run_backend(CpuAttentionBackend(CpuAttentionOptions(native_prefill=False)), case)


@pytest.mark.parametrize("amx", [True, False])
def test_bfloat16_prefill_takes_the_amx_kernel_where_the_cpu_has_amx(
    monkeypatch: pytest.MonkeyPatch, amx: bool
) -> None:
    # On an AMX Xeon the tile kernel took a 512-token bf16 prompt's attention in less time than
    # torch's flash attention and the vector kernel (docs/benchmarks.md); float32 has no AMX
    # kernels and stays on the vector kernel, as do CPUs without AMX.
    built = cpu_kernels.cpu_ops()
    assert built is not None
    tiles = amx and bool(built.tiles_usable())
    calls: list[str] = []

    class Counting:
        def __getattr__(self, name: str) -> Any:
            op = getattr(built, name)
            if not name.startswith("paged_prefill"):
                return op

            def counted(*args: Any) -> Any:
                calls.append(name)
                return op(*args)

            return counted

    monkeypatch.setattr(cpu_kernels, "has_amx", lambda: amx)
    monkeypatch.setattr(cpu_kernels, "cpu_ops", lambda: Counting())
    monkeypatch.setattr(cpu_attention, "cpu_ops", lambda: Counting())

    def no_sdpa(*args: object, **kwargs: object) -> None:
        raise AssertionError("SDPA ran although a kernel takes every prefill chunk")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", no_sdpa)
    shape: dict[str, Any] = {"num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "page_size": 4}
    # a decode, a whole prompt, a chunk after cached keys
    case = case_from_rows([(1, 6), (7, 0), (5, 9)], dtype=torch.bfloat16, **shape)
    output, _ = run_backend(_backend(native=True), case)
    torch.testing.assert_close(output.double(), naive_attention(case), atol=3e-2, rtol=0)
    assert calls == ["paged_prefill_tiles" if tiles else "paged_prefill"]
    calls.clear()
    case = case_from_rows([(1, 6), (7, 0), (5, 9)], **shape)
    output, _ = run_backend(_backend(native=True), case)
    torch.testing.assert_close(output.double(), naive_attention(case), atol=ATOL, rtol=0)
    assert calls == ["paged_prefill"], "float32 stays on the vector kernel"


def test_without_the_kernels_it_attends_as_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    # Kernels that cannot be built here (no compiler): the sdpa paths, the same results.
    monkeypatch.setattr(cpu_attention, "cpu_ops", lambda: None)
    monkeypatch.setattr(cpu_attention, "paged_decode_kernel", lambda: None)
    backend = CpuAttentionBackend(NoOptions())
    case = case_from_rows(MIXED_ROWS, num_heads=4, num_kv_heads=2, head_dim=64, page_size=4)
    output, _ = run_backend(backend, case)
    torch.testing.assert_close(output.double(), naive_attention(case), atol=ATOL, rtol=0)
    assert backend.decode_kernel(torch.device("cpu")) is None
    assert backend.prefill_kernel(case.query, case.kv_cache[0], case.layer) is None


def test_registered_as_cpu_with_its_options() -> None:
    from brigade.registry import load_registry

    component = load_registry().get("attention", "cpu")
    assert component.options_type is CpuAttentionOptions
    backend = component.factory(CpuAttentionOptions(cascade_decode=False))
    assert isinstance(backend, CpuAttentionBackend)
    assert backend.cascade is False
