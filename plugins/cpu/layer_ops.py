"""A decoder layer's small operations on Brigade's C++ kernels (``cpu_layer_ops.cpp``), as the
``LayerOps`` the executor hands a model on a CPU.

The kernels compute in float32 in transformers' order and round where its bfloat16 operations
round (tests/plugins/cpu/test_cpu_fused.py); a gate_up projection packed in pairs
(:class:`~brigade.plugins.cpu.gemm.CpuLinear`) computes its SiLU-mul as the GEMM stores its
output, without writing the projection's.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
from torch import nn

from brigade.interfaces import LayerOps
from brigade.plugins.cpu.build import cpu_ops
from brigade.plugins.cpu.gemm import CpuLinear

__all__ = ["KERNEL_DTYPES", "CpuLayerOps", "cpu_layer_ops"]

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""The activation dtypes the C++ kernels take."""


class CpuLayerOps:
    """:class:`~brigade.interfaces.LayerOps` on ``torch.ops.brigade_cpu`` (``ops``)."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops
        """The kernels' namespace (``cpu_ops()``)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """See ``LayerOps.rms_norm``."""
        return cast("torch.Tensor", self.ops.rms_norm(x, weight, eps))

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``LayerOps.add_rms_norm``."""
        total, normed = self.ops.add_rms_norm(x, delta, weight, eps)
        return total, normed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """See ``LayerOps.silu_mul``."""
        return cast("torch.Tensor", self.ops.silu_mul(gate_up))

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``LayerOps.rope``."""
        rotated_q, rotated_k = self.ops.rope(q, k, cos, sin)
        return rotated_q, rotated_k

    def gate_up_silu(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """See ``LayerOps.gate_up_silu``: in the GEMM for a projection packed in pairs."""
        if isinstance(linear, CpuLinear) and linear.paired:
            return linear.silu_mul(x)
        return self.silu_mul(linear(x))


def cpu_layer_ops(x: torch.Tensor) -> LayerOps | None:
    """The executor's ``LayerOpsProvider`` on a CPU: :class:`CpuLayerOps` for float32 and
    bfloat16 CPU tensors once the kernels are built, else None (torch's operations)."""
    if x.device.type != "cpu" or x.dtype not in KERNEL_DTYPES:
        return None
    return _built_layer_ops()


@functools.cache
def _built_layer_ops() -> CpuLayerOps | None:
    """The one :class:`CpuLayerOps` of this process; None where the kernels cannot be built."""
    ops = cpu_ops()
    return None if ops is None else CpuLayerOps(ops)
