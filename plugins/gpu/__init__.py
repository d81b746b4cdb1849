"""Brigade's GPU kernels that are not attention: a decoder layer's small operations as Triton
kernels (``fused_ops``), the ``LayerOps`` on them (``layer_ops``) and whether Triton runs on a
GPU (``triton_support``).

What other plugins may use is exported here; the modules are this package's own. Nothing here
imports Triton until its kernels are used.
"""

from __future__ import annotations

from brigade.plugins.gpu.layer_ops import TritonLayerOps, triton_layer_ops
from brigade.plugins.gpu.triton_support import MIN_TRITON_CAPABILITY, triton_runs_on

__all__ = ["MIN_TRITON_CAPABILITY", "TritonLayerOps", "triton_layer_ops", "triton_runs_on"]
