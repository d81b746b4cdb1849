"""The Triton kernels of a decoder layer's small operations (``triton_fused``) against the torch
operations transformers uses, and the decoder with them against the decoder without.

Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 and the kernels run in Triton's CPU
interpreter, exact in fp32 only: those tests use fp32. With CUDA the same tests run compiled,
and the ``gpu``-marked ones add bf16 and fp16 (scripts/gpu_check.sh runs them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from executor_helpers import CountingOps, make_executor, strided_rows
from triton_helpers import DEVICE, INTERPRETED, gpu_only, needs_kernels

from brigade.model_input import SeqChunk, build_model_input
from brigade.models.create import create_model
from brigade.plugins.gpu import TritonLayerOps
from brigade.plugins.gpu import fused_ops as triton_fused
from brigade.plugins.models.decoder import RMSNorm
from brigade.plugins.models.rope import apply_rope

pytestmark = needs_kernels


def _strided(rows: int, width: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return strided_rows(rows, width, seed, DEVICE, dtype)


def _torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (the decoder's unfused path)."""
    norm = RMSNorm(x.shape[-1], eps, x.dtype).to(x.device)
    norm.weight.data.copy_(weight)
    return norm(x)


@pytest.mark.parametrize("rows", [0, 1, 5, 70])
@pytest.mark.parametrize("width", [96, 576])  # 576: SmolLM2's hidden size, not a power of two
def test_rms_norm_and_add_rms_norm(rows: int, width: int) -> None:
    weight = torch.randn(width, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x, delta = _strided(rows, width, 2), _strided(rows, width, 3) * 4
    normed = triton_fused.rms_norm(x, weight, 1e-6)
    assert normed.shape == (rows, width)
    assert normed.is_contiguous()
    torch.testing.assert_close(normed, _torch_norm(x, weight, 1e-6), rtol=1e-5, atol=1e-5)
    total, normed = triton_fused.add_rms_norm(x, delta, weight, 1e-5)
    torch.testing.assert_close(total, x + delta, rtol=0, atol=0)
    torch.testing.assert_close(normed, _torch_norm(x + delta, weight, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("width", [80, 1100])  # 1100: a second, partial block of 1024
def test_silu_mul(rows: int, width: int) -> None:
    gate_up = _strided(rows, 2 * width, 4) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0])  # saturated and zero gates
    gate, up = gate_up.split(width, dim=-1)
    out = triton_fused.silu_mul(gate_up)
    assert out.shape == (rows, width)
    assert out.is_contiguous()
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=2e-6, atol=1e-6)


def _qkv(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple:
    """q, k as the decoder has them: [tokens, heads, head_dim] views of a fused qkv output
    (tokens strided), and cos/sin [tokens, head_dim / 2] for scattered positions."""
    generator = torch.Generator().manual_seed(5)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=generator).to(device=DEVICE, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 100
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    return (
        q.reshape(tokens, heads, head_dim),
        k.reshape(tokens, kv_heads, head_dim),
        cos.contiguous(),
        sin.contiguous(),
    )


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 80), (2, 1, 128)])
def test_rope_on_q_and_k_in_one_launch(heads: int, kv_heads: int, head_dim: int) -> None:
    q, k, cos, sin = _qkv(7, heads, kv_heads, head_dim, torch.float32)
    rotated_q, rotated_k = triton_fused.rope(q, k, cos, sin)
    assert rotated_q.is_contiguous()
    assert rotated_k.shape == k.shape
    torch.testing.assert_close(rotated_q, apply_rope(q, cos, sin), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rotated_k, apply_rope(k, cos, sin), rtol=1e-6, atol=1e-6)


def test_bad_inputs_are_refused_with_a_message() -> None:
    x = torch.zeros(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="even width"):
        triton_fused.silu_mul(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="width and dtype"):
        triton_fused.rms_norm(x, torch.ones(5, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="width and dtype"):
        triton_fused.rms_norm(x, torch.ones(4, device=DEVICE, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="contiguous rows"):
        triton_fused.rms_norm(torch.zeros(4, 2, device=DEVICE).t(), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="one shape"):
        triton_fused.add_rms_norm(x, torch.zeros(3, 4, device=DEVICE), torch.ones(4), 1e-6)
    q = torch.zeros(1, 2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="one dtype"):
        triton_fused.rope(q, q, torch.zeros(1, 2, device=DEVICE, dtype=torch.float16), q[0])
    half = torch.zeros(1, 2, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous heads"):
        triton_fused.rope(q.transpose(1, 2), q, half, half)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model(
        tmp_path_factory.mktemp("triton-fused") / "llama",
        "llama",
        overrides={"num_hidden_layers": 2},
    )


@pytest.mark.skipif(
    not INTERPRETED, reason="a CPU executor; on a GPU test_gpu_parity runs the kernels' decoder"
)
def test_the_decoder_gives_the_same_logits_with_the_triton_kernels(model_dir: Path) -> None:
    # On a CPU the decoder would take the C++ kernels: hand it the Triton ones instead (the
    # interpreter runs them on CPU tensors), so the seam is the one a GPU takes.
    fused = make_executor(model_dir, cpu_linear="plain", fused_decode=False)
    unfused = make_executor(model_dir, cpu_linear="plain", fused=False)
    calls: list[str] = []
    triton_ops = TritonLayerOps(triton_fused)
    fused.model.use_layer_ops(lambda x: CountingOps(triton_ops, calls))  # type: ignore[attr-defined]
    for chunk in (SeqChunk(list(range(3, 11)), 0, [1, 2], "all"), SeqChunk([7], 8, [1, 2, 3])):
        batch = build_model_input([chunk], 4)
        torch.testing.assert_close(fused.execute(batch), unfused.execute(batch), atol=2e-5, rtol=0)
    assert {"rms_norm", "add_rms_norm", "gate_up_silu", "rope"} <= set(calls)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_torch(dtype: torch.dtype) -> None:
    # The norm sums its squares in another order than torch, and Triton's exp is not CUDA's
    # expf: a unit or two in the last place of the result, never more.
    close = {"rtol": 2 * torch.finfo(dtype).eps, "atol": 1e-5}
    weight = torch.randn(576, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    x, delta = _strided(33, 576, 2, dtype), _strided(33, 576, 3, dtype)
    torch.testing.assert_close(
        triton_fused.rms_norm(x, weight, 1e-6), _torch_norm(x, weight, 1e-6), **close
    )
    total, normed = triton_fused.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, _torch_norm(x + delta, weight, 1e-6), **close)
    gate_up = _strided(33, 2 * 1100, 4, dtype) * 4
    gate, up = gate_up.split(1100, dim=-1)
    torch.testing.assert_close(triton_fused.silu_mul(gate_up), F.silu(gate) * up, **close)
    q, k, cos, sin = _qkv(33, 32, 8, 128, dtype)
    rotated_q, rotated_k = triton_fused.rope(q, k, cos, sin)
    # Products of two half-precision values are exact in float32: one rounding, of the sum.
    cos32, sin32 = cos.float(), sin.float()
    assert torch.equal(rotated_q, apply_rope(q.float(), cos32, sin32).to(dtype))
    assert torch.equal(rotated_k, apply_rope(k.float(), cos32, sin32).to(dtype))
