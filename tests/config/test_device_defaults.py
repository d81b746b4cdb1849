"""On a CUDA GPU, a station whose table names no plugin gets the GPU's fast path (the
cuda-graph executor, triton attention); elsewhere, and wherever the user chose, nothing moves.
CUDA is declared with a patched ``torch.cuda.is_available``: only the choice is tested here
(scripts/gpu_check.sh runs the chosen plugins on a GPU)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Sequence

import pytest
import torch

from brigade.config import load_config
from brigade.errors import ConfigError
from brigade.plugins.attention.triton_backend import triton_runs_on
from brigade.plugins.gpu import fused_ops as triton_fused
from brigade.plugins.models import decoder
from brigade.registry import Registry, load_registry
from brigade.startup import changed_settings


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry()


def chosen(registry: Registry, *overrides: str) -> tuple[str, str]:
    config = load_config(None, registry, overrides=overrides, environ={})
    return config.plugin("executor"), config.plugin("attention")


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """An H200, declared."""
    declare_gpu(monkeypatch, (9, 0))


def declare_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    triton_runs_on.cache_clear()


@pytest.fixture(autouse=True)
def _fresh_answers() -> Iterator[None]:
    """``triton_runs_on`` and the decoder's choice cache per device: no test sees another's
    GPU."""
    for cached in (triton_runs_on, decoder._triton_fused):
        cached.cache_clear()
    yield
    for cached in (triton_runs_on, decoder._triton_fused):
        cached.cache_clear()


@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize(
    "device",
    [(), ("executor.device=auto",), ("executor.device=cuda",), ("executor.device=cuda:1",)],
)
def test_a_gpu_gets_graphs_and_triton(registry: Registry, device: Sequence[str]) -> None:
    assert chosen(registry, *device) == ("cuda-graph", "triton")
    # The cuda-graph executor's own options ride along.
    assert chosen(registry, *device, "executor.compile=true") == ("cuda-graph", "triton")


@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["executor.device=cpu"], ("torch", "sdpa")),  # the model runs on the CPU
        (["executor.plugin=torch"], ("torch", "triton")),  # eager, as named (--enforce-eager)
        (["attention.plugin=sdpa"], ("cuda-graph", "sdpa")),
        (["executor.tensor_parallel_size=2"], ("torch", "triton")),  # an option of torch's
        (["attention.native_decode=false"], ("cuda-graph", "sdpa")),  # an option of sdpa's
        (["executor.plugin=simulated"], ("simulated", "sdpa")),  # it knows its device
    ],
)
def test_what_is_named_keeps_its_plugin(
    registry: Registry, overrides: list[str], expected: tuple[str, str]
) -> None:
    assert chosen(registry, *overrides) == expected


@pytest.mark.usefixtures("gpu")
def test_a_bad_value_gets_the_gpu_plugins_own_message(registry: Registry) -> None:
    with pytest.raises(ConfigError, match="capture_sizes"):
        chosen(registry, "executor.capture_sizes=[0]")


def test_without_a_gpu_nothing_moves(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert chosen(registry) == ("torch", "sdpa")
    # A CUDA device named where there is none keeps the torch executor and its clear error.
    assert chosen(registry, "executor.device=cuda") == ("torch", "sdpa")


def test_a_gpu_older_than_ampere_keeps_sdpa(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    declare_gpu(monkeypatch, (7, 5))  # a T4
    assert chosen(registry) == ("cuda-graph", "sdpa")


def test_the_decoder_takes_the_triton_kernels_by_the_same_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    declare_gpu(monkeypatch, (7, 5))
    assert decoder._triton_fused(0) is None
    declare_gpu(monkeypatch, (8, 0))
    decoder._triton_fused.cache_clear()
    assert decoder._triton_fused(0) is triton_fused


@pytest.mark.usefixtures("gpu")
def test_without_triton_attention_stays_sdpa(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    assert chosen(registry) == ("cuda-graph", "sdpa")


@pytest.mark.usefixtures("gpu")
def test_the_banner_counts_the_machines_choice_as_a_default(registry: Registry) -> None:
    config = load_config(None, registry, environ={})
    assert config.default_plugin("executor") == "cuda-graph"
    assert changed_settings(config) == []
    eager = load_config(None, registry, overrides=["executor.plugin=torch"], environ={})
    assert changed_settings(eager) == ["executor.plugin=torch"]
