"""Brigade's CPU backend: its C++ kernels (``kernels/``), their build and cache (``build``), the
packed GEMMs the executor swaps in for linear layers (``gemm``), the heap and page settings of a
CPU process (``memory``) and every decoder layer of a step in one C++ call (``fused_step``)."""
