"""The small operations of a decoder layer as Triton kernels, for GPUs: RMSNorm (optionally
after the residual add), SiLU(gate) * up, and RoPE on q and k in one launch.

The same four operations, with the same signatures and arithmetic, as the fused CPU kernels
(``cpu_layer_ops.cpp``), so a model takes either through one seam (``LayerOps``, which the executor
hands it: ``layer_ops``). In eager torch each is three to seven kernels; on an H200 a batch-1
decode step of a 1B Llama in CUDA graphs spent about as long in those ~430 small launches as in its
GEMMs (docs/gpu.md). Arithmetic is float32 in transformers' order, rounded to the activation dtype
wherever transformers' chain of torch operations rounds (after the normalisation and after the
weight; after SiLU and after the product), so bf16 and fp16 norms and SiLU-mul equal the torch
operations' up to a unit or two in the last place, from the norm's float32 summation order and
Triton's exp. RoPE rounds once, after the sum of its two products (torch, and the CPU kernel, round
each product too): compiled on an H200, the per-product roundings written in Triton did not
reproduce torch's results (a unit in the last place apart; the compiler may contract a product into
an FMA), while one rounding of an exact float32 sum of exact products cannot differ, and is the
more exact. In float32 RoPE matches torch to float32 rounding.

Layouts: every tensor of one dtype (float32, bfloat16 or float16) with a contiguous last
dimension; rows may be strided (views such as the q/k/v columns of a fused projection's
output are read in place). Results are new contiguous tensors.
"""

# The @triton.jit kernels carry no type hints (Triton reads parameter annotations itself), and
# compile-time constants keep Triton's UPPER_CASE convention.
# mypy: disallow-untyped-defs=False
# ruff: noqa: N803
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["add_rms_norm", "rms_norm", "rope", "silu_mul"]

_SILU_BLOCK = 1024


@triton.jit
def _norm_kernel(
    a_ptr,
    b_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    a_stride,
    b_stride,
    size,
    eps,
    HAS_B: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: out = weight * (x * rsqrt(mean(x^2) + eps)) for x = a (+ b, stored in sum)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(a_ptr + row * a_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = tl.load(b_ptr + row * b_stride + cols, mask=mask, other=0.0).to(tl.float32)
        total = (x + y).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * size + cols, total, mask=mask)
        x = total.to(tl.float32)
    inverse = tl.rsqrt(tl.sum(x * x, axis=0) / size + eps)
    normed = (x * inverse).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * size + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, in_stride, width, BLOCK: tl.constexpr):
    """Program (row, block): out[row, cols] = silu(gate[row, cols]) * up[row, cols]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * in_stride + width + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        out_ptr + row * width + cols,
        (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _rotate(source, target, heads, cols, half, mask, cos, sin):
    """Rotate-half RoPE of one token's heads (rows of ``heads``) from source to target."""
    dtype = target.dtype.element_ty
    first = source + heads * (2 * half) + cols
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    # One rounding, after the sum: a product of two bf16/fp16 values is exact in float32, so
    # the result does not depend on whether the compiler contracts it into an FMA.
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    out = target + heads * (2 * half) + cols
    tl.store(out, out1.to(dtype), mask=mask)
    tl.store(out + half, out2.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    q_stride,
    k_stride,
    num_heads,
    num_kv_heads,
    half,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
):
    """One token: its q heads and k heads rotated by its cos/sin [half]."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    in_half = cols < half
    cos = tl.load(cos_ptr + token * half + cols, mask=in_half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * half + cols, mask=in_half, other=0.0).to(tl.float32)
    q_target = q_out_ptr + token * num_heads * (2 * half)
    k_target = k_out_ptr + token * num_kv_heads * (2 * half)
    q_mask = (heads < num_heads) & in_half
    k_mask = (heads < num_kv_heads) & in_half
    _rotate(q_ptr + token * q_stride, q_target, heads, cols, half, q_mask, cos, sin)
    _rotate(k_ptr + token * k_stride, k_target, heads, cols, half, k_mask, cos, sin)


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name} must be a [rows, width] tensor with contiguous rows")


def _norm_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def _norm(
    a: torch.Tensor, b: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_rows(a, "x")
    if b is not None:
        _check_rows(b, "delta")
        if b.shape != a.shape or b.dtype != a.dtype:
            raise ValueError("hidden and delta must have one shape and dtype")
    if weight.dtype != a.dtype or not weight.is_contiguous() or weight.numel() != a.shape[1]:
        raise ValueError("weight must be a contiguous vector of the input's width and dtype")
    rows, size = a.shape
    out = torch.empty((rows, size), dtype=a.dtype, device=a.device)
    total = torch.empty_like(out) if b is not None else out
    if rows:
        block = triton.next_power_of_2(size)
        _norm_kernel[(rows,)](
            a,
            a if b is None else b,
            weight,
            out,
            total,
            a.stride(0),
            a.stride(0) if b is None else b.stride(0),
            size,
            eps,
            HAS_B=b is not None,
            BLOCK=block,
            num_warps=_norm_warps(block),
        )
    return total, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [rows, size] -> weight * (x * rsqrt(mean(x^2) + eps)), x's dtype."""
    return _norm(x, None, weight, eps)[1]


def add_rms_norm(
    hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden + delta, rms_norm(hidden + delta)): the residual add and the next norm."""
    return _norm(hidden, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * width] (gate columns first) -> silu(gate) * up [rows, width]."""
    _check_rows(gate_up, "gate_up")
    if gate_up.shape[1] % 2:
        raise ValueError("gate_up must have an even width")
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        grid = (rows, triton.cdiv(width, _SILU_BLOCK))
        _silu_mul_kernel[grid](gate_up, out, gate_up.stride(0), width, BLOCK=_SILU_BLOCK)
    return out


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim] (heads contiguous, tokens
    may be strided), cos, sin [tokens, head_dim / 2] contiguous, one dtype -> rotated q, k."""
    if len({q.dtype, k.dtype, cos.dtype, sin.dtype}) != 1:
        raise ValueError("q, k, cos and sin must have one dtype")
    if not (cos.is_contiguous() and sin.is_contiguous() and cos.dim() == 2):
        raise ValueError("cos and sin must be contiguous [tokens, head_dim / 2] tensors")
    half = cos.shape[1]
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2] or x.shape[2] != 2 * half:
            raise ValueError(f"{name} must be [tokens, heads, head_dim] with contiguous heads")
        if x.shape[0] != cos.shape[0] or sin.shape != cos.shape:
            raise ValueError("q, k, cos and sin need one row per token")
    q_out, k_out = (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
    )
    if q.shape[0]:
        _rope_kernel[(q.shape[0],)](
            q,
            k,
            cos,
            sin,
            q_out,
            k_out,
            q.stride(0),
            k.stride(0),
            q.shape[1],
            k.shape[1],
            half,
            HEADS=triton.next_power_of_2(max(q.shape[1], k.shape[1])),
            HALF=triton.next_power_of_2(half),
        )
    return q_out, k_out
