"""oneDNN GEMMs for a model's linear layers on a CPU (``cpu_gemm.py``): the same outputs as
``F.linear`` on both paths, the swap keeps the checkpoint's parameters (no copy), and the
executor swaps by default on a CPU in float32 and not when told not to."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from executor_helpers import make_executor
from torch import nn

from brigade.model_input import SeqChunk, build_model_input
from brigade.models.create import create_model
from brigade.plugins.executors import cpu_gemm
from brigade.plugins.executors.cpu_gemm import OneDnnLinear, use_onednn_linears

pytestmark = pytest.mark.skipif(
    not cpu_gemm.onednn_usable(), reason="this torch build has no oneDNN linear op"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (7, 24), (2, 5, 24), (40, 24)])
def test_onednn_linear_equals_f_linear_below_and_above_its_threshold(
    bias: bool, shape: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(24, 33, bias=bias)
    packed = OneDnnLinear(linear, min_rows=4)
    x = torch.randn(*shape)
    torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias))
    # A strided input (a column slice, as after a split) gives the same.
    wide = torch.randn(*shape[:-1], 48)[..., 10:34]
    torch.testing.assert_close(packed(wide), F.linear(wide, linear.weight, linear.bias))


def test_use_onednn_linears_swaps_float32_linears_and_keeps_their_parameters() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)))
    model.append(nn.Linear(4, 4, dtype=torch.bfloat16))
    weights = [model[0].weight, model[2][0].weight]
    assert use_onednn_linears(model, min_rows=2) == 2
    assert isinstance(model[0], OneDnnLinear)
    assert isinstance(model[2][0], OneDnnLinear)
    assert type(model[3]) is nn.Linear, "only float32 layers are swapped"
    assert model[0].weight is weights[0]
    assert model[2][0].weight is weights[1]
    assert set(model.state_dict()) == {
        "0.weight",
        "0.bias",
        "2.0.weight",
        "2.0.bias",
        "3.weight",
        "3.bias",
    }


def test_an_unusable_onednn_leaves_the_model_plain_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_gemm, "onednn_usable", lambda: False)
    model = nn.Sequential(nn.Linear(8, 8))
    with caplog.at_level(logging.WARNING, logger=cpu_gemm.__name__):
        assert use_onednn_linears(model, min_rows=2) == 0
    assert type(model[0]) is nn.Linear
    assert "GEMMs stay plain" in caplog.text


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model(
        tmp_path_factory.mktemp("gemm") / "llama", "llama", overrides={"num_hidden_layers": 2}
    )


def test_the_executor_swaps_by_default_and_matches_the_plain_gemm(model_dir: Path) -> None:
    packed = make_executor(model_dir, onednn_min_rows=2)
    plain = make_executor(model_dir, onednn_min_rows=0)
    assert any(isinstance(m, OneDnnLinear) for m in make_executor(model_dir).model.modules())  # type: ignore[attr-defined]
    assert any(isinstance(m, OneDnnLinear) for m in packed.model.modules())  # type: ignore[attr-defined]
    assert not any(isinstance(m, OneDnnLinear) for m in plain.model.modules())  # type: ignore[attr-defined]
    # An 8-token prefill takes the oneDNN path, its 1-token decode the plain one.
    page = 4
    for chunk in (SeqChunk(list(range(3, 11)), 0, [1, 2], "all"), SeqChunk([7], 8, [1, 2, 3])):
        batch = build_model_input([chunk], page)
        torch.testing.assert_close(packed.execute(batch), plain.execute(batch), atol=2e-5, rtol=0)
