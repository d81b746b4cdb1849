"""Brigade's CPU backend: its C++ kernels (``kernels/``), their build and cache (``build``), the
``cpu`` attention backend on them (``attention``), a decoder layer's small operations on them
(``layer_ops``), the packed GEMMs the executor swaps in for linear layers (``gemm``), the heap
and page settings of a CPU process (``memory``) and every decoder layer of a step in one C++
call (``fused_step``).

What other plugins may use is exported here; the modules are this package's own.
"""

from __future__ import annotations

from brigade.plugins.cpu.attention import CpuAttentionBackend, CpuAttentionOptions
from brigade.plugins.cpu.build import (
    KernelBuildError,
    amx_tiles_usable,
    build_kernels,
    cpu_ops,
    has_amx,
    kernel_cache,
)
from brigade.plugins.cpu.fused_step import CpuDecodeLayers
from brigade.plugins.cpu.gemm import CPU_LINEAR_MODES, CpuLinear, use_cpu_linears
from brigade.plugins.cpu.layer_ops import CpuLayerOps, cpu_layer_ops
from brigade.plugins.cpu.memory import advise_huge_pages, keep_freed_memory

__all__ = [
    "CPU_LINEAR_MODES",
    "CpuAttentionBackend",
    "CpuAttentionOptions",
    "CpuDecodeLayers",
    "CpuLayerOps",
    "CpuLinear",
    "KernelBuildError",
    "advise_huge_pages",
    "amx_tiles_usable",
    "build_kernels",
    "cpu_layer_ops",
    "cpu_ops",
    "has_amx",
    "kernel_cache",
    "keep_freed_memory",
    "use_cpu_linears",
]
