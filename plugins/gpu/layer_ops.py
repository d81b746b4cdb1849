"""A decoder layer's small operations as Triton kernels (``fused_ops``), as the ``LayerOps``
the executor hands a model on a CUDA GPU of Ampere or later with Triton."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import cast

import torch
from torch import nn

from brigade.interfaces import LayerOps
from brigade.plugins.gpu.triton_support import triton_runs_on

__all__ = ["TritonLayerOps", "triton_layer_ops"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TritonLayerOps:
    """:class:`~brigade.interfaces.LayerOps` on the Triton kernels of ``fused_ops`` (``kernels``;
    the module is imported on first use, since it imports Triton)."""

    def __init__(self, kernels: ModuleType | None = None) -> None:
        if kernels is None:
            import brigade.plugins.gpu.fused_ops as fused_ops

            kernels = fused_ops
        self.kernels = kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """See ``LayerOps.rms_norm``."""
        return cast("torch.Tensor", self.kernels.rms_norm(x, weight, eps))

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``LayerOps.add_rms_norm``."""
        total, normed = self.kernels.add_rms_norm(x, delta, weight, eps)
        return total, normed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """See ``LayerOps.silu_mul``."""
        return cast("torch.Tensor", self.kernels.silu_mul(gate_up))

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``LayerOps.rope``."""
        rotated_q, rotated_k = self.kernels.rope(q, k, cos, sin)
        return rotated_q, rotated_k

    def gate_up_silu(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """See ``LayerOps.gate_up_silu``: the projection, then the SiLU-mul kernel."""
        return self.silu_mul(linear(x))


def triton_layer_ops(x: torch.Tensor) -> LayerOps | None:
    """The executor's ``LayerOpsProvider`` on CUDA: :class:`TritonLayerOps` for float32,
    bfloat16 and float16 tensors on a GPU the kernels run on (``triton_runs_on``), else None
    (torch's operations)."""
    if x.device.type != "cuda" or x.dtype not in _DTYPES:
        return None
    return _on_device(x.device.index or 0)


@functools.cache
def _on_device(index: int) -> TritonLayerOps | None:
    """The Triton operations for CUDA device ``index``, or None where they are not used."""
    return TritonLayerOps() if triton_runs_on(index) else None
