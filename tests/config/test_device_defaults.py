"""A station whose table names no plugin gets the machine's fast path: on a CUDA GPU the
cuda-graph executor and triton attention, where the model runs on a CPU the cpu attention
backend; wherever the user chose, nothing moves. CUDA is declared with a patched
``torch.cuda.is_available``: only the choice is tested here (scripts/gpu_check.sh runs the
chosen plugins on a GPU)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Sequence

import pytest
import torch

from brigade.config import load_config
from brigade.errors import ConfigError
from brigade.plugins.gpu import TritonLayerOps, triton_runs_on
from brigade.plugins.gpu import layer_ops as triton_layer_ops
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
    """``triton_runs_on`` and the Triton operations' choice cache per device: no test sees
    another's GPU."""
    for cached in (triton_runs_on, triton_layer_ops._on_device):
        cached.cache_clear()
    yield
    for cached in (triton_runs_on, triton_layer_ops._on_device):
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
        (["executor.device=cpu"], ("torch", "cpu")),  # the model runs on the CPU
        (["executor.plugin=torch"], ("torch", "triton")),  # eager, as named (--enforce-eager)
        (["attention.plugin=sdpa"], ("cuda-graph", "sdpa")),
        (["executor.tensor_parallel_size=2"], ("torch", "triton")),  # an option of torch's
        # an option of the cpu backend's (vLLM's --disable-cascade-attn sets cascade_decode)
        (["attention.cascade_decode=false"], ("cuda-graph", "cpu")),
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


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], ("torch", "cpu")),
        (["executor.device=cpu"], ("torch", "cpu")),
        # The cpu backend's own options, or none of them, keep it.
        (["attention.native_decode=false"], ("torch", "cpu")),
        (["attention.native_prefill=false", "attention.cascade_decode=false"], ("torch", "cpu")),
        (["attention.plugin=sdpa"], ("torch", "sdpa")),  # the reference, as named
        (["executor.plugin=simulated"], ("simulated", "sdpa")),  # it knows its device
        # A CUDA device named where there is none keeps the torch executor and its clear error.
        (["executor.device=cuda"], ("torch", "sdpa")),
    ],
)
def test_on_a_cpu_attention_takes_the_cpu_kernels(
    registry: Registry,
    monkeypatch: pytest.MonkeyPatch,
    overrides: list[str],
    expected: tuple[str, str],
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert chosen(registry, *overrides) == expected


def test_the_cpu_backends_options_are_checked_with_its_messages(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="native_decod"):
        chosen(registry, "attention.native_decode=maybe")
    # A key no plugin takes: the static default's message.
    with pytest.raises(ConfigError, match=r"\(sdpa\)"):
        chosen(registry, "attention.num_kv_splits=2")


def test_a_gpu_older_than_ampere_keeps_sdpa(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    declare_gpu(monkeypatch, (7, 5))  # a T4
    assert chosen(registry) == ("cuda-graph", "sdpa")


def test_the_executors_triton_operations_follow_the_same_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    declare_gpu(monkeypatch, (7, 5))
    assert triton_layer_ops._on_device(0) is None
    declare_gpu(monkeypatch, (8, 0))
    triton_layer_ops._on_device.cache_clear()
    assert isinstance(triton_layer_ops._on_device(0), TritonLayerOps)
    # CPU tensors and other dtypes never take them.
    assert triton_layer_ops.triton_layer_ops(torch.zeros(2, 4)) is None


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
