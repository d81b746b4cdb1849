"""Brigade's GPU kernels that are not attention: a decoder layer's small operations as Triton
kernels (``fused_ops``)."""
