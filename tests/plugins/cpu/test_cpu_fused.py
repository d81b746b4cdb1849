"""The fused CPU kernels of a decoder layer's small operations (``cpu_layer_ops.cpp``) against the
torch operations transformers uses, on contiguous and strided rows, one row and many (the
parallel path), in float32 and bfloat16, and the decoder with them on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from executor_helpers import CountingOps, make_executor, strided_rows

from brigade.model_input import SeqChunk, build_model_input
from brigade.models.create import create_model
from brigade.plugins.cpu.build import cpu_ops
from brigade.plugins.cpu.layer_ops import CpuLayerOps
from brigade.plugins.models.decoder import RMSNorm
from brigade.plugins.models.rope import apply_rope

ROWS = [1, 5, 300]


@pytest.fixture(scope="module")
def ops() -> object:
    built = cpu_ops()
    assert built is not None, "the CPU kernels failed to build (see the log)"
    return built


def _reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_and_add_rms_norm_equal_transformers_arithmetic(ops: object, rows: int) -> None:
    weight = torch.randn(96, generator=torch.Generator().manual_seed(1))
    x, delta = strided_rows(rows, 96, 2), strided_rows(rows, 96, 3) * 4
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), _reference_norm(x, weight, 1e-6))  # type: ignore[attr-defined]
    total, normed = ops.add_rms_norm(x, delta, weight, 1e-5)  # type: ignore[attr-defined]
    torch.testing.assert_close(total, x + delta, rtol=0, atol=0)
    torch.testing.assert_close(normed, _reference_norm(x + delta, weight, 1e-5))


@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_equals_silu_of_gate_times_up(ops: object, rows: int) -> None:
    gate_up = strided_rows(rows, 2 * 80, 4) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0])  # saturated and zero gates
    gate, up = gate_up.split(80, dim=-1)
    out = ops.silu_mul(gate_up)  # type: ignore[attr-defined]
    assert out.shape == (rows, 80)
    assert out.is_contiguous()
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("head_dim", [16, 64, 80])  # vectors, a tail, or both, per half head
def test_rope_rotates_q_and_k_views_like_apply_rope(ops: object, rows: int, head_dim: int) -> None:
    generator = torch.Generator().manual_seed(5)
    heads, kv_heads = 6, 2
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator)
    q = qkv[:, : heads * head_dim].reshape(rows, heads, head_dim)  # strided views, as in
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(rows, kv_heads, head_dim)
    angles = torch.rand(rows, head_dim // 2, generator=generator) * 50
    cos, sin = angles.cos(), angles.sin()
    before = qkv.clone()
    rotated_q, rotated_k = ops.rope(q, k, cos, sin)  # type: ignore[attr-defined]
    torch.testing.assert_close(rotated_q, apply_rope(q, cos, sin))
    torch.testing.assert_close(rotated_k, apply_rope(k, cos, sin))
    assert torch.equal(qkv, before), "the inputs are left as they were"


def _mostly_equal(ours: torch.Tensor, theirs: torch.Tensor, share: float = 0.99) -> None:
    """bfloat16 results that round where transformers' chain of bfloat16 operations rounds:
    equal but for rare one-unit differences (float32 sums in another order, another exp)."""
    assert ours.dtype == theirs.dtype == torch.bfloat16
    equal = (ours == theirs).float().mean().item()
    assert equal >= share, f"only {equal:.1%} of the values equal transformers' arithmetic"
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("rows", ROWS)
def test_bfloat16_kernels_round_where_transformers_bfloat16_operations_do(
    ops: object, rows: int
) -> None:
    weight = torch.randn(96, generator=torch.Generator().manual_seed(1)).bfloat16()
    x, delta = strided_rows(rows, 96, 2).bfloat16(), (strided_rows(rows, 96, 3) * 4).bfloat16()
    norm = RMSNorm(96, 1e-6, torch.bfloat16)  # the torch operations, as transformers runs them
    norm.weight.data.copy_(weight)
    _mostly_equal(ops.rms_norm(x, weight, 1e-6), norm(x))  # type: ignore[attr-defined]
    total, normed = ops.add_rms_norm(x, delta, weight, 1e-6)  # type: ignore[attr-defined]
    assert torch.equal(total, x + delta)
    _mostly_equal(normed, norm(x + delta))

    gate_up = (strided_rows(rows, 2 * 80, 4) * 6).bfloat16()
    gate, up = gate_up.split(80, dim=-1)
    _mostly_equal(ops.silu_mul(gate_up), F.silu(gate) * up)  # type: ignore[attr-defined]

    generator = torch.Generator().manual_seed(5)
    for head_dim in (16, 80):  # a half head of a tail only, or of vectors and a tail
        qkv = torch.randn(rows, 10 * head_dim, generator=generator).bfloat16()
        q = qkv[:, : 6 * head_dim].reshape(rows, 6, head_dim)
        k = qkv[:, 6 * head_dim : 8 * head_dim].reshape(rows, 2, head_dim)
        angles = torch.rand(rows, head_dim // 2, generator=generator) * 50
        cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
        rotated_q, rotated_k = ops.rope(q, k, cos, sin)  # type: ignore[attr-defined]
        # Products of two bfloat16 values are exact in float32: the same roundings, bit for
        # bit.
        assert torch.equal(rotated_q, apply_rope(q, cos, sin))
        assert torch.equal(rotated_k, apply_rope(k, cos, sin))


def test_bfloat16_silu_mul_rounds_the_float32_silu_for_every_gate_value(ops: object) -> None:
    """All 65536 bfloat16 gates (CPUs with AVX512-BF16 look the SiLU up in a table built from
    the float32 kernel's arithmetic): the float32 silu_mul's value rounded to bfloat16, bit for
    bit (where that is not below bfloat16's smallest normal, which the BF16 instructions flush
    to zero), and torch's silu but for rare one-unit differences (from -88 up; below, -0)."""
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = gate.reshape(256, 256)
    up = torch.randn(256, 256, generator=torch.Generator().manual_seed(8)).bfloat16()
    gate_ones = torch.cat([gate, torch.ones_like(gate)], dim=1)
    silu = ops.silu_mul(gate_ones)  # type: ignore[attr-defined]
    in_float32 = ops.silu_mul(gate_ones.float())  # type: ignore[attr-defined]
    normal = (in_float32.abs() >= torch.finfo(torch.bfloat16).tiny) | (in_float32 == 0)
    assert normal.float().mean().item() > 0.98
    bits, expected = silu.view(torch.int16), in_float32.bfloat16().view(torch.int16)
    assert torch.equal(bits[normal], expected[normal])
    assert torch.equal(silu.isnan(), in_float32.isnan())
    flushed_or_equal = (silu == 0) | (bits == expected)  # flushed with AVX512-BF16 only
    assert flushed_or_equal[~normal & ~in_float32.isnan()].all()
    finite = gate.isfinite() & normal
    # Below -88 the kernels' SiLU is -0 (NaN for -inf), torch's -0 or as tiny as 3e-37.
    below = gate < -88
    _mostly_equal(silu[finite & ~below], F.silu(gate[finite & ~below]), share=0.999)
    assert (silu[below & gate.isfinite()].view(torch.int16) == -32768).all()
    assert silu[gate == float("-inf")].isnan().all()
    torch.testing.assert_close(
        silu[below].float(), F.silu(gate[below].float()), atol=1e-36, rtol=0, equal_nan=True
    )
    # Times up, as the GEMMs' epilogues take it (the product rounded once).
    product = ops.silu_mul(torch.cat([gate, up], dim=1))  # type: ignore[attr-defined]
    exact = silu.float() * up.float()
    normal = finite & ((exact.abs() >= torch.finfo(torch.bfloat16).tiny) | (exact == 0))
    expected = exact[normal].bfloat16().view(torch.int16)
    assert torch.equal(product[normal].view(torch.int16), expected)


def test_bad_shapes_are_refused_with_a_message(ops: object) -> None:
    with pytest.raises(RuntimeError, match="even width"):
        ops.silu_mul(torch.zeros(2, 7))  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(torch.zeros(2, 4, dtype=torch.float64), torch.ones(4), 1e-6)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="width"):
        ops.rms_norm(torch.zeros(2, 4), torch.ones(5), 1e-6)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="dtype"):
        ops.rms_norm(torch.zeros(2, 4), torch.ones(4, dtype=torch.bfloat16), 1e-6)  # type: ignore[attr-defined]
    q = torch.zeros(1, 2, 4)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.rope(q, q, torch.zeros(1, 2, dtype=torch.bfloat16), torch.zeros(1, 2))  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model(
        tmp_path_factory.mktemp("fused") / "llama", "llama", overrides={"num_hidden_layers": 2}
    )


@pytest.mark.parametrize(("dtype", "atol"), [("float32", 2e-5), ("bfloat16", 0.1)])
def test_the_decoder_gives_the_same_logits_fused_and_unfused(
    model_dir: Path, dtype: str, atol: float
) -> None:
    # The eager layers with the fused small ops (not the whole step in one decode_layers call,
    # which test_cpu_decode compares with these layers) against torch's own ops.
    fused = make_executor(model_dir, cpu_linear="plain", dtype=dtype, fused_decode=False)
    unfused = make_executor(model_dir, cpu_linear="plain", fused=False, dtype=dtype)
    calls: list[str] = []
    counted = CountingOps(CpuLayerOps(cpu_ops()), calls)
    fused.model.use_layer_ops(lambda x: counted)  # type: ignore[attr-defined]  # records the calls
    for chunk in (SeqChunk(list(range(3, 11)), 0, [1, 2], "all"), SeqChunk([7], 8, [1, 2, 3])):
        batch = build_model_input([chunk], 4)
        torch.testing.assert_close(fused.execute(batch), unfused.execute(batch), atol=atol, rtol=0)
    assert {"rms_norm", "add_rms_norm", "gate_up_silu", "rope"} <= set(calls)


def test_the_executor_hands_the_model_the_cpu_kernels_unless_told_not_to(model_dir: Path) -> None:
    calls: list[str] = []
    for fused_ops in (True, False):
        executor = make_executor(model_dir, fused=fused_ops, fused_decode=False)
        slot = executor.model.layer_ops  # type: ignore[union-attr]
        provider = slot.provider
        assert (provider is not None) == fused_ops
        if provider is None:
            continue
        assert isinstance(provider(torch.zeros(2, 4)), CpuLayerOps)
        assert provider(torch.zeros(2, 4, dtype=torch.float64)) is None  # torch's operations
        counted = CountingOps(provider(torch.zeros(2, 4)), calls)
        slot.provider = lambda x, counted=counted: counted
        executor.execute(build_model_input([SeqChunk([3, 4, 5], 0, [1])], 4))
    assert {"rms_norm", "add_rms_norm", "gate_up_silu", "rope"} <= set(calls)
