"""The GEMMs for a model's linear layers on a CPU (``cpu_gemm.py``, ``cpu_gemm.cpp``,
``cpu_tiles.cpp``): the same outputs as ``F.linear`` on Brigade's panels, its AMX tile blocks
(bfloat16, where the CPU has AMX) and oneDNN's packed and dense weights, in float32 and (where
the CPU runs it) bfloat16; the swap keeps the checkpoint's parameters or replaces
them by the packed copy; the executor swaps by default on a CPU, the tied LM head included, and
not when told not to."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from executor_helpers import ATOL, make_executor
from torch import nn

from brigade.model_input import SeqChunk, build_model_input
from brigade.models.create import create_model
from brigade.plugins.cpu import gemm as cpu_gemm
from brigade.plugins.cpu.gemm import CpuLinear, use_cpu_linears

pytestmark = pytest.mark.skipif(
    not cpu_gemm.onednn_usable(), reason="this torch build has no oneDNN linear op"
)
BF16 = pytest.mark.skipif(
    not cpu_gemm.onednn_usable(torch.bfloat16), reason="oneDNN runs no bfloat16 on this CPU"
)


PANELS = pytest.mark.skipif(not cpu_gemm.panels_usable(), reason="the CPU kernels are not built")
TILES = pytest.mark.skipif(not cpu_gemm.tiles_usable(), reason="no AMX tiles on this CPU")


@pytest.mark.parametrize("layout", [pytest.param("panels", marks=PANELS), "packed", "dense"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (2, 5, 24), (40, 24), (600, 24)])
def test_cpu_linear_equals_f_linear(layout: str, bias: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(24, 33, bias=bias)
    expected_weight = linear.weight.detach().clone()
    layer = CpuLinear(linear, layout)
    x = torch.randn(*shape)
    expected = F.linear(x, expected_weight, linear.bias)
    torch.testing.assert_close(layer(x), expected, atol=2e-6, rtol=1e-5)
    # A strided input (a column slice, as after a split) gives the same.
    wide = torch.randn(*shape[:-1], 48)[..., 10:34]
    expected = F.linear(wide, expected_weight, linear.bias)
    torch.testing.assert_close(layer(wide), expected, atol=2e-6, rtol=1e-5)


@PANELS
@pytest.mark.parametrize("rows", [*range(1, 20), 31, 32, 33, 64, 95, 96, 97, 200])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 7), (15, 576), (16, 64), (100, 33)])
def test_the_panel_gemm_takes_every_row_count_and_width(
    rows: int, out_features: int, in_features: int
) -> None:
    """Every tile height, a last panel partly filled, one column, odd K: F.linear within
    float32 rounding (the kernel sums along k in order)."""
    torch.manual_seed(rows)
    linear = nn.Linear(in_features, out_features, bias=True)
    expected = F.linear(x := torch.randn(rows, in_features), linear.weight, linear.bias)
    layer = CpuLinear(linear, "panels")
    assert layer.weight is None
    assert layer.packed is not None
    torch.testing.assert_close(layer(x), expected.detach(), atol=1e-5, rtol=1e-5)


@PANELS
def test_the_panel_gemm_refuses_what_it_cannot_read() -> None:
    ops = cpu_gemm._panel_ops()
    panels = ops.pack_panels(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="float32"):
        ops.pack_panels(torch.randn(20, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="pack_panels for this x"):
        ops.panel_linear(torch.randn(3, 9), panels, None, 20)  # another in_features
    with pytest.raises(RuntimeError, match="pack_panels for this x"):
        ops.panel_linear(torch.randn(3, 8), panels, None, 40)  # another out_features
    with pytest.raises(RuntimeError, match="bias"):
        ops.panel_linear(torch.randn(3, 8), panels, torch.randn(19), 20)
    with pytest.raises(ValueError, match="layout"):
        CpuLinear(nn.Linear(8, 8), "blocked")


@PANELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 33, 300])
@pytest.mark.parametrize(("width", "in_features"), [(16, 24), (20, 9), (96, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_silu_mul_in_the_gemm_equals_the_gemm_then_silu_mul(
    dtype: torch.dtype,
    bias: bool,
    rows: int,
    width: int,
    in_features: int,
    threads: int,
) -> None:
    """Paired panels: every tile height, half-filled last pairs (width 20), biases, bfloat16's
    roundings, one thread or two (each cuts a row's panels into other tiles): bit for bit what
    panel_linear followed by silu_mul gives."""
    ops = cpu_gemm._panel_ops()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_silu_mul_in_the_gemm(ops, dtype, bias, rows, width, in_features)
    finally:
        torch.set_num_threads(previous)


def _check_silu_mul_in_the_gemm(
    ops: Any, dtype: torch.dtype, bias: bool, rows: int, width: int, in_features: int
) -> None:
    generator = torch.Generator().manual_seed(rows + width)
    weight = torch.randn(2 * width, in_features, generator=generator).to(dtype)
    b = torch.randn(2 * width, generator=generator).to(dtype) if bias else None
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    expected = ops.silu_mul(ops.panel_linear(x, ops.pack_panels(weight), b, 2 * width))
    got = ops.panel_silu_mul(x, ops.pack_panels(weight, True), b, width)
    assert got.dtype == dtype
    assert torch.equal(got, expected)
    gate, up = F.linear(x.float(), weight.float(), None if b is None else b.float()).chunk(2, -1)
    # and silu(gate) * up of float32 sums, within float32 (or four bfloat16 roundings)
    tolerance = (
        {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 2**-5}
    )
    torch.testing.assert_close(got.float(), F.silu(gate) * up, **tolerance)


@PANELS
@pytest.mark.parametrize("bias", [False, True])
def test_a_gate_up_projection_packs_in_pairs_and_still_computes_itself(bias: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 2 * 20, bias=bias), nn.Linear(24, 40))
    weight = model[0].weight.detach().clone()
    b = None if model[0].bias is None else model[0].bias.detach().clone()
    assert use_cpu_linears(model, "panels", gate_up=[model[0]]) == 2
    assert model[0].paired
    assert not model[1].paired
    x = torch.randn(5, 3, 24)
    projected = F.linear(x, weight, b)
    torch.testing.assert_close(model[0](x), projected, atol=2e-6, rtol=1e-5)
    gate, up = projected.chunk(2, -1)
    torch.testing.assert_close(model[0].silu_mul(x), F.silu(gate) * up, atol=2e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="pairs"):
        model[1].silu_mul(x)
    ops, flat = cpu_gemm._panel_ops(), x.view(-1, 24)
    with pytest.raises(RuntimeError, match="paired=True"):  # 3 unpaired panels, not 2 pairs
        ops.panel_silu_mul(flat, ops.pack_panels(weight), None, 20)
    with pytest.raises(RuntimeError, match="bias"):  # the gate's bias alone
        ops.panel_silu_mul(flat, model[0].gemm_weight, torch.zeros(20), 20)
    with pytest.raises(RuntimeError, match="even number of rows"):
        ops.pack_panels(weight[1:], True)
    odd = nn.Sequential(nn.Linear(4, 5))
    with pytest.raises(ValueError, match="even width"):
        use_cpu_linears(odd, "panels", gate_up=[odd[0]])
    for mode in ("packed", "onednn"):  # oneDNN's layouts take no pairs
        model = nn.Sequential(nn.Linear(24, 40))
        use_cpu_linears(model, mode, gate_up=[model[0]])
        assert not model[0].paired


@pytest.mark.parametrize(
    "layout", [pytest.param("panels", marks=PANELS), pytest.param("tiles", marks=TILES),
               pytest.param("packed", marks=BF16), pytest.param("dense", marks=BF16)]
)  # fmt: skip
@pytest.mark.parametrize("rows", [1, 5, 32, 300])
@pytest.mark.parametrize("in_features", [64, 33])
def test_cpu_linear_in_bfloat16_sums_in_float32(layout: str, rows: int, in_features: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, 40, bias=True, dtype=torch.bfloat16)
    if layout == "tiles" and in_features % 2:  # use_cpu_linears leaves it to oneDNN
        with pytest.raises(RuntimeError, match="in_features must be even"):
            CpuLinear(linear, layout)
        return
    weight, bias = linear.weight.detach().float(), linear.bias.detach().float()
    layer = CpuLinear(linear, layout)
    x = torch.randn(rows, in_features).bfloat16()
    out = layer(x)
    assert out.dtype == torch.bfloat16
    # float32 sums of the bfloat16 products, one rounding: within a bfloat16 unit
    expected = F.linear(x.float(), weight, bias)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=2**-7)


def test_packed_mode_replaces_the_weight_and_onednn_mode_keeps_it() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)))
    weights = [model[0].weight, model[2][0].weight]
    assert use_cpu_linears(model, "onednn") == 2
    assert isinstance(model[0], CpuLinear)
    assert model[0].weight is weights[0], "onednn mode reads the checkpoint's own tensor"
    assert model[2][0].weight is weights[1]
    assert model[0].packed is None
    assert set(model.state_dict()) == {"0.weight", "0.bias", "2.0.weight", "2.0.bias"}

    for mode in ("packed", "panels"):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)))
        assert use_cpu_linears(model, mode) == 2
        assert isinstance(model[0], CpuLinear)
        assert model[0].weight is None, "no dense copy is kept"
        assert model[0].packed is not None
        assert model[0].layout == (mode if cpu_gemm.panels_chosen() else "packed")
        assert set(model.state_dict()) == {"0.bias", "2.0.bias"}

    if cpu_gemm.onednn_usable(torch.bfloat16):  # without AVX512-BF16 panels leave it to oneDNN
        for mode in ("panels", "tiles"):  # the same: "tiles" is the mode's former name
            model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8, dtype=torch.bfloat16))
            assert use_cpu_linears(model, mode) == 2
            bf16_panels = cpu_gemm.panels_chosen(torch.bfloat16)
            expected = "tiles" if cpu_gemm.tiles_usable() else "panels" if bf16_panels else "packed"
            assert model[1].layout == expected
            assert model[0].layout == ("panels" if cpu_gemm.panels_chosen() else "packed")

    model = nn.Sequential(nn.Linear(8, 16))
    assert use_cpu_linears(model, "plain") == 0
    assert type(model[0]) is nn.Linear
    with pytest.raises(ValueError, match="allowed"):
        use_cpu_linears(model, "fast")


def _raises() -> bool:
    raise RuntimeError("cpuinfo unavailable")


@pytest.mark.parametrize("amx", [lambda: False, lambda: True, _raises])
def test_bfloat16_takes_the_tile_gemm_where_the_cpu_has_amx(
    monkeypatch: pytest.MonkeyPatch, amx: Any
) -> None:
    # Measured on an Intel Xeon with AMX: tile kernels 3.5-12x the panels at 32-512 rows.
    packs = cpu_gemm._panel_ops() is not None and bool(cpu_gemm._panel_ops().tiles_usable())
    has_amx = amx is not _raises and bool(amx())
    monkeypatch.setattr(cpu_gemm, "panels_usable", lambda dtype=torch.float32: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", amx)
    assert cpu_gemm.panels_chosen(torch.float32), "float32 has no AMX kernels"
    assert not cpu_gemm.tiles_usable(torch.float32)
    assert cpu_gemm.tiles_usable(torch.bfloat16) is (has_amx and packs)
    assert cpu_gemm.panels_chosen(torch.bfloat16) is not (has_amx and packs)


@TILES
@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 33, 112, 511, 512, 513, 1100])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 8), (33, 576), (64, 2), (100, 34)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_tile_gemm_takes_every_row_count_and_width(
    rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    """Row blocks of the micro-kernel and their tails, a last block partly filled, one column,
    K of one pair, strided rows: float32 sums of the bfloat16 products rounded once, i.e.
    F.linear in float32 rounded to bfloat16 (within one unit where sums tie-break apart)."""
    torch.manual_seed(rows)
    ops = cpu_gemm._panel_ops()
    weight = (torch.randn(out_features, in_features) / in_features**0.5).bfloat16()
    b = torch.randn(out_features).bfloat16() if bias else None
    wide = torch.randn(rows, in_features + 6).bfloat16()
    for x in (wide[:, :in_features].contiguous(), wide[:, 3 : 3 + in_features]):
        got = ops.tile_linear(x, ops.tile_pack(weight), b, out_features)
        expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
        torch.testing.assert_close(got, expected.bfloat16(), atol=1e-5, rtol=2**-7)


@TILES
@pytest.mark.parametrize("rows", [1, 40, 128])
def test_tile_blocks_another_thread_takes_over_give_the_same_bits(rows: int) -> None:
    """A thread done with its share of the blocks takes the last blocks of another's (paired
    ones too); six threads (more than CI's two cores) change from call to call which thread
    computes which block: every call equals the one-thread result bit for bit."""
    torch.manual_seed(rows)
    ops = cpu_gemm._panel_ops()
    weight = (torch.randn(1000, 256) / 16).bfloat16()
    x = torch.randn(rows, 256).bfloat16()
    blocks, paired = ops.tile_pack(weight), ops.tile_pack(weight, True)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = ops.tile_linear(x, blocks, None, 1000)
        alone_silu = ops.tile_silu_mul(x, paired, None, 500)
        torch.set_num_threads(6)
        for _ in range(20):
            assert torch.equal(ops.tile_linear(x, blocks, None, 1000), alone)
            assert torch.equal(ops.tile_silu_mul(x, paired, None, 500), alone_silu)
    finally:
        torch.set_num_threads(previous)
    expected = F.linear(x.float(), weight.float())
    torch.testing.assert_close(alone, expected.bfloat16(), atol=1e-5, rtol=2**-7)
    assert torch.equal(alone_silu, ops.silu_mul(alone))


@TILES
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(1100, 2048, 64), (1100, 2000, 96), (2100, 1100, 96), (700, 40, 4096)],
)
def test_the_tile_gemm_streams_large_outputs_and_cuts_rows_for_long_x(
    rows: int, out_features: int, in_features: int
) -> None:
    """Outputs of 4 MiB and more go past the caches, line by line where a row starts on one
    (2048 columns: every row; 2000 and 1100: some rows, the others stored as usual); K of 3
    steps spreads the epilogue over one step; K = 4096 cuts the rows into parts of 128 (their x
    fits 1 MiB). Still F.linear in float32 rounded to bfloat16, and the paired SiLU-mul still
    equal to the GEMM then silu_mul."""
    torch.manual_seed(out_features)
    ops = cpu_gemm._panel_ops()
    weight = (torch.randn(out_features, in_features) / in_features**0.5).bfloat16()
    x = torch.randn(rows, in_features).bfloat16()
    got = ops.tile_linear(x, ops.tile_pack(weight), None, out_features)
    expected = F.linear(x.float(), weight.float())
    torch.testing.assert_close(got, expected.bfloat16(), atol=1e-5, rtol=2**-7)
    linear = nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(weight)
    layer = CpuLinear(linear, "tiles", gate_up=True)
    assert layer.paired
    assert torch.equal(layer.silu_mul(x), ops.silu_mul(got))


@TILES
@pytest.mark.parametrize("rows", [1, 7, 40, 600])
@pytest.mark.parametrize("width", [20, 32, 50, 96])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features", [64, 576])
def test_silu_mul_in_the_tile_gemm_equals_the_gemm_then_silu_mul(
    rows: int, width: int, bias: bool, in_features: int
) -> None:
    """Paired blocks (halves padded to whole blocks: widths 20 and 50): bit for bit the unpaired
    GEMM's output through silu_mul, the eager path's two kernels; the projection itself too.
    K of 2 and 18 steps: the tile loop's epilogue at a block's end, or spread under the next one."""
    torch.manual_seed(width)
    ops = cpu_gemm._panel_ops()
    linear = nn.Linear(in_features, 2 * width, bias=bias, dtype=torch.bfloat16)
    x = torch.randn(rows, in_features).bfloat16()
    projected = ops.tile_linear(x, ops.tile_pack(linear.weight.detach()), linear.bias, 2 * width)
    layer = CpuLinear(linear, "tiles", gate_up=True)
    assert layer.paired
    assert torch.equal(layer.silu_mul(x), ops.silu_mul(projected))
    assert torch.equal(layer(x), projected)


@TILES
def test_the_tile_gemm_refuses_what_it_cannot_read() -> None:
    ops = cpu_gemm._panel_ops()
    weight = torch.randn(40, 24).bfloat16()
    x = torch.randn(3, 24).bfloat16()
    with pytest.raises(RuntimeError, match="in_features must be even"):
        ops.tile_pack(torch.randn(8, 5).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.tile_pack(torch.randn(8, 4))
    with pytest.raises(RuntimeError, match="even number of rows"):
        ops.tile_pack(weight[1:], True)
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        ops.tile_linear(x.float(), ops.tile_pack(weight), None, 40)
    with pytest.raises(RuntimeError, match="tile_pack for this x"):  # another K
        ops.tile_linear(torch.randn(3, 26).bfloat16(), ops.tile_pack(weight), None, 40)
    with pytest.raises(RuntimeError, match="paired=True"):  # unpaired blocks
        ops.tile_silu_mul(x, ops.tile_pack(weight), None, 20)
    with pytest.raises(RuntimeError, match="bias"):  # the gate's bias alone
        ops.tile_silu_mul(x, ops.tile_pack(weight, True), torch.zeros(20).bfloat16(), 20)
    model = nn.Sequential(
        nn.Linear(24, 8, dtype=torch.bfloat16), nn.Linear(7, 8, dtype=torch.bfloat16)
    )
    assert use_cpu_linears(model, "tiles") == 2
    assert [layer.layout for layer in model] == ["tiles", "packed"], "odd K stays with oneDNN"


def test_a_dtype_onednn_cannot_run_stays_plain_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_gemm, "onednn_usable", lambda dtype=torch.float32: False)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8, dtype=torch.float64))
    with caplog.at_level(logging.WARNING, logger=cpu_gemm.__name__):
        assert use_cpu_linears(model, "packed") == 0
    assert type(model[0]) is nn.Linear
    assert "float32, float64" in caplog.text
    assert "stay plain" in caplog.text


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemm")
    return {
        tied: create_model(
            root / tied,
            "llama",
            tie_word_embeddings=tied == "tied",
            overrides={"num_hidden_layers": 2},
        )
        for tied in ("tied", "untied")
    }


@pytest.mark.parametrize("tied", ["tied", "untied"])
@pytest.mark.parametrize(("dtype", "atol"), [("float32", ATOL), ("bfloat16", 0.15)])
def test_the_executor_packs_every_gemm_by_default_and_matches_the_plain_one(
    model_dirs: dict[str, Path], tied: str, dtype: str, atol: float
) -> None:
    """Float32, and bfloat16 on every CPU: on the panels (widened from bfloat16 where the CPU
    has no AVX512-BF16) or, in bfloat16 where the CPU has AMX, the tile GEMM; oneDNN's own
    layouts where it runs the dtype, and the tile GEMM's former mode name."""
    default = make_executor(model_dirs[tied], dtype=dtype)
    plain = make_executor(model_dirs[tied], cpu_linear="plain", dtype=dtype)
    others = []
    if cpu_gemm.onednn_usable(getattr(torch, dtype)):
        others = [make_executor(model_dirs[tied], cpu_linear=mode, dtype=dtype)
                  for mode in ("packed", "onednn")]  # fmt: skip
    layers = [m for m in default.model.modules() if isinstance(m, CpuLinear)]  # type: ignore[attr-defined]
    assert len(layers) == 2 * 4 + 1, "four linear layers per decoder layer and the LM head"
    assert all(layer.packed is not None for layer in layers)
    panels = cpu_gemm.panels_chosen(getattr(torch, dtype))
    tiles = cpu_gemm.tiles_usable(getattr(torch, dtype))
    assert {layer.layout for layer in layers} == {
        "tiles" if tiles else "panels" if panels else "packed"
    }
    if cpu_gemm.tiles_usable(getattr(torch, dtype)):
        others.append(make_executor(model_dirs[tied], cpu_linear="tiles", dtype=dtype))
        tiled = [m for m in others[-1].model.modules() if isinstance(m, CpuLinear)]  # type: ignore[attr-defined]
        assert {layer.layout for layer in tiled} == {"tiles"}
    assert not any(isinstance(m, CpuLinear) for m in plain.model.modules())  # type: ignore[attr-defined]
    embedding = default.model.embed_tokens.weight  # type: ignore[attr-defined]
    assert embedding.is_contiguous(), "lookups read the dense embedding"
    page = 4
    for chunk in (SeqChunk(list(range(3, 11)), 0, [1, 2], "all"), SeqChunk([7], 8, [1, 2, 3])):
        batch = build_model_input([chunk], page)
        expected = plain.execute(batch)
        for executor in (default, *others):
            torch.testing.assert_close(executor.execute(batch), expected, atol=atol, rtol=0)
