"""Where the Triton kernels' tests run: compiled on a CUDA GPU, or in Triton's CPU interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 without CUDA), and the markers that say so."""

from __future__ import annotations

import pytest
import torch

from brigade.plugins.attention.triton_backend import triton_interpreting

INTERPRETED = triton_interpreting()
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA and not INTERPRETED else "cpu"
needs_kernels = pytest.mark.skipif(
    not (INTERPRETED or HAS_CUDA), reason="needs CUDA or TRITON_INTERPRET=1"
)
gpu_only = pytest.mark.skipif(
    not HAS_CUDA or INTERPRETED, reason="needs CUDA and compiled (not interpreted) kernels"
)
