"""Every registered component passes its contract's conformance checks.

Parametrized over the installed registry, so a third-party plugin installed next to Brigade
is checked here too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from brigade.interfaces import ExecutorParams, ModelInput, NoOptions
from brigade.models.create import create_model
from brigade.options import build_options
from brigade.plugins.attention.sdpa import SdpaBackend, SdpaMetadata
from brigade.plugins.executors.torch_executor import TorchExecutor, TorchExecutorOptions
from brigade.registry import Component, load_registry
from brigade.testing.conformance import (
    check_attention_backend,
    check_detokenizer,
    check_executor,
    check_kv_manager,
    check_model_architecture,
    check_sampler,
    check_scheduler,
)

REGISTRY = load_registry()
LOCAL_RECIPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
"""Architectures ``brigade model create`` can build, so they can be checked offline."""


def components(kind: str) -> list[Component]:
    return [REGISTRY.get(kind, name) for name in REGISTRY.names(kind)]


def ids(component: Component) -> str:
    return component.name


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    overrides = {"num_hidden_layers": 2}
    return create_model(tmp_path_factory.mktemp("m") / "llama", "llama", overrides=overrides)


@pytest.mark.parametrize("component", components("attention"), ids=ids)
def test_attention_backend_conforms(component: Component) -> None:
    try:
        component.factory.check_device("cpu")
    except RuntimeError as exc:
        pytest.skip(f"{component.name} cannot run on this machine's CPU: {exc}")
    backend = component.factory(build_options(component.options_type, {}, component.name))
    check_attention_backend(backend)


@pytest.mark.parametrize("component", components("executor"), ids=ids)
def test_executor_conforms(component: Component, tiny_llama: Path) -> None:
    options = build_options(component.options_type, {}, component.name)
    if isinstance(options, TorchExecutorOptions):
        options = TorchExecutorOptions(device="cpu")
    check_device = getattr(component.factory, "check_device", None)
    if check_device is not None:
        try:
            check_device(getattr(options, "device", "cpu"))
        except RuntimeError as exc:
            pytest.skip(f"{component.name} cannot run on this machine: {exc}")
    reference = TorchExecutor(
        ExecutorParams(
            model_path=str(tiny_llama),
            dtype="float32",
            attention=SdpaBackend(NoOptions()),
            page_size=4,
            kv_cache_dtype="auto",
            max_model_len=0,
        ),
        TorchExecutorOptions(device="cpu"),
    )
    reference.initialize_kv_cache(32)
    check_executor(component.factory, options, tiny_llama, reference=reference)


@pytest.mark.parametrize("component", components("model"), ids=ids)
def test_model_architecture_conforms(component: Component, tmp_path: Path) -> None:
    recipe = LOCAL_RECIPES.get(component.name)
    if recipe is None:
        pytest.skip(f"no local model recipe for {component.name}")
    model_dir = create_model(tmp_path / recipe, recipe, overrides={"num_hidden_layers": 2})
    check_model_architecture(component.factory(), model_dir)


def test_a_wrong_backend_fails_the_attention_check() -> None:
    """The kit must catch a real bug: here, a backend that ignores the cached context."""

    class ForgetfulBackend(SdpaBackend):
        def build_metadata(self, batch: ModelInput) -> SdpaMetadata:
            forgetful = dataclasses.replace(
                batch,
                seq_lens=batch.query_start_loc[1:] - batch.query_start_loc[:-1],
                seq_lens_cpu=batch.query_start_loc_cpu[1:] - batch.query_start_loc_cpu[:-1],
            )
            return super().build_metadata(forgetful)

    with pytest.raises(AssertionError, match=r"against the reference|non-finite"):
        check_attention_backend(ForgetfulBackend(NoOptions()), head_dims=(64,))


@pytest.mark.parametrize("component", components("kv"), ids=ids)
def test_kv_manager_conforms(component: Component) -> None:
    check_kv_manager(component.factory, build_options(component.options_type, {}, component.name))


@pytest.mark.parametrize("component", components("scheduler"), ids=ids)
def test_scheduler_conforms(component: Component) -> None:
    paged = REGISTRY.get("kv", "paged")
    check_scheduler(
        component.factory,
        build_options(component.options_type, {}, component.name),
        paged.factory,
        build_options(paged.options_type, {}, "paged"),
    )


@pytest.mark.parametrize("component", components("sampler"), ids=ids)
def test_sampler_conforms(component: Component) -> None:
    check_sampler(component.factory, build_options(component.options_type, {}, component.name))


@pytest.mark.parametrize("component", components("detokenizer"), ids=ids)
def test_detokenizer_conforms(component: Component, tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    options = build_options(component.options_type, {}, component.name)
    check_detokenizer(component.factory, options, tokenizer)
