"""A CPU ``TorchExecutor`` on a checkpoint, in fp32 (or as told) over small shuffled pages, for the
tests that compare logits (model parity, GGUF weights, the compiled forward, the CPU kernels)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from brigade.interfaces import ExecutorParams
from brigade.models.checkpoint import open_checkpoint
from brigade.plugins.cpu import CpuAttentionBackend, CpuAttentionOptions
from brigade.plugins.executors.torch_executor import TorchExecutor, TorchExecutorOptions

ATOL = 5e-5
"""fp32 logits (|logit| up to ~7): brigade vs transformers eager. Measured max difference
9.2e-6 with MKL's GEMMs on an AVX2 CPU, 3.1e-5 with oneDNN's on weights packed for an AVX-512
CPU (its blocking sums in another order); headroom for other CPUs'."""
PAGE_SIZE = 4
NUM_PAGES = 48


def make_executor(
    directory: Path,
    *,
    compiled: bool = False,
    native_decode: bool = True,
    native_prefill: bool | None = None,
    cpu_linear: str = TorchExecutorOptions.cpu_linear,
    fused: bool = True,
    fused_decode: bool = True,
    dtype: str = "float32",
    kv_cache_dtype: str = "auto",
    kv_prefault: bool = True,
) -> TorchExecutor:
    params = ExecutorParams(
        model_path=str(directory),
        dtype=dtype,
        attention=CpuAttentionBackend(
            CpuAttentionOptions(
                native_decode=native_decode,
                native_prefill=native_decode if native_prefill is None else native_prefill,
            )
        ),
        page_size=PAGE_SIZE,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=0,
        checkpoint=open_checkpoint(str(directory)),
    )
    executor = TorchExecutor(
        params,
        TorchExecutorOptions(
            device="cpu",
            compile=compiled,
            cpu_linear=cpu_linear,
            fused_ops=fused,
            fused_decode=fused_decode,
            kv_prefault=kv_prefault,
        ),
    )
    executor.initialize_kv_cache(NUM_PAGES)
    return executor


class ShuffledPages:
    """Hands out pages of the pool in a fixed random order (non-contiguous block tables)."""

    def __init__(self, seed: int = 0) -> None:
        self.free = torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(seed))
        self.free_list: list[int] = self.free.tolist()

    def take(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // PAGE_SIZE)
        pages, self.free_list = self.free_list[:count], self.free_list[count:]
        return pages


def token_sequences(lengths: Sequence[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


class CountingOps:
    """Forwards to fused operations (a ``LayerOps``, or the kernels' namespace) and records
    which operations were called."""

    def __init__(self, ops: object, calls: list[str]) -> None:
        self._ops, self._calls = ops, calls

    def __getattr__(self, name: str) -> object:
        self._calls.append(name)
        return getattr(self._ops, name)


def strided_rows(
    rows: int, width: int, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[rows, width] as a column slice of a wider tensor (rows not contiguous): how the fused
    operations meet q/k/v and gate/up columns of a fused projection's output."""
    generator = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, width + 40, generator=generator)
    return wide.to(device=device, dtype=dtype)[:, 17 : 17 + width]
