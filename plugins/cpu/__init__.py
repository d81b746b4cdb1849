"""Brigade's CPU backend: its C++ kernels (``kernels/``), their build and cache (``build``), the
packed GEMMs the executor swaps in for linear layers (``gemm``), the heap and page settings of a
CPU process (``memory``) and every decoder layer of a step in one C++ call (``fused_step``).

What other plugins may use is exported here; the modules are this package's own.
"""

from __future__ import annotations

from brigade.plugins.cpu.build import (
    KernelBuildError,
    amx_tiles_usable,
    build_kernels,
    cpu_ops,
    has_amx,
    kernel_cache,
)

__all__ = [
    "KernelBuildError",
    "amx_tiles_usable",
    "build_kernels",
    "cpu_ops",
    "has_amx",
    "kernel_cache",
]
