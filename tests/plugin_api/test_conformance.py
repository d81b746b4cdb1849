"""Every registered component passes its contract's conformance checks.

Parametrized over the installed registry, so a third-party plugin installed next to Brigade
is checked here too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import faulty_plugins
import pytest
import torch

from brigade import LLM
from brigade.interfaces import (
    ExecutorParams,
    ModelInput,
    NoOptions,
    ProposerParams,
    Request,
    SamplerParams,
)
from brigade.models.checkpoint import open_checkpoint
from brigade.models.create import create_model
from brigade.options import build_options
from brigade.plugins.attention.sdpa import SdpaBackend, SdpaMetadata
from brigade.plugins.executors.torch_executor import TorchExecutor, TorchExecutorOptions
from brigade.plugins.samplers.ban_words import BanWordsOptions, BanWordsProcessor
from brigade.plugins.samplers.processors import (
    LogitBiasProcessor,
    MinTokensProcessor,
    PenaltiesProcessor,
)
from brigade.plugins.samplers.standard import StandardSamplerOptions
from brigade.registry import Component, load_registry
from brigade.testing.conformance import (
    check_attention_backend,
    check_detokenizer,
    check_executor,
    check_kv_manager,
    check_logits_processor,
    check_model_architecture,
    check_proposer,
    check_router,
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
            checkpoint=open_checkpoint(str(tiny_llama)),
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


@pytest.mark.parametrize("component", components("proposer"), ids=ids)
def test_proposer_conforms(component: Component, tmp_path: Path) -> None:
    if component.name == "draft-model":
        # It runs a second model, which only an engine can load: a tiny one drafts for itself.
        model = create_model(tmp_path / "tiny", "llama", overrides={"num_hidden_layers": 1})
        llm = LLM(
            overrides=[
                f"model.path={model}",
                "kv.page_size=4",
                "kv.num_pages=512",
                "speculative.plugin=draft-model",
                f"speculative.model={model}",
                "speculative.num_speculative_tokens=5",
            ]
        )
        assert llm.engine.speculation is not None
        proposer = llm.engine.speculation.proposer
        check_proposer(proposer, proposer.params)
        return
    params = ProposerParams(
        num_speculative_tokens=5, vocab_size=97, max_num_seqs=8, max_model_len=512
    )
    options = build_options(component.options_type, {}, component.name)
    check_proposer(component.factory(params, options), params)


@pytest.mark.parametrize("component", components("scheduler"), ids=ids)
def test_scheduler_conforms(component: Component) -> None:
    paged = REGISTRY.get("kv", "paged")
    check_scheduler(
        component.factory,
        build_options(component.options_type, {}, component.name),
        paged.factory,
        build_options(paged.options_type, {}, "paged"),
    )


@pytest.mark.parametrize("component", components("router"), ids=ids)
def test_router_conforms(component: Component) -> None:
    check_router(component.factory, build_options(component.options_type, {}, component.name))


@pytest.mark.parametrize("component", components("sampler"), ids=ids)
def test_sampler_conforms(component: Component) -> None:
    check_sampler(component.factory, build_options(component.options_type, {}, component.name))


@pytest.mark.parametrize("component", components("logits_processor"), ids=ids)
def test_logits_processor_conforms(component: Component) -> None:
    options = build_options(component.options_type, {}, component.name)
    check_logits_processor(component.factory, options)


@pytest.mark.parametrize(
    "field",
    [*faulty_plugins.BATCH_FIELDS, *faulty_plugins.REQUEST_FIELDS, "logits_processors"],
)
def test_the_sampler_check_fails_a_sampler_that_ignores_a_field(field: str) -> None:
    """The standard sampler, blind to one field, fails with a message naming that field."""
    options = faulty_plugins.FieldBlindOptions(field=field)
    with pytest.raises(AssertionError, match=rf"^{field}[=:]"):
        check_sampler(faulty_plugins.FieldBlindSampler, options)


@pytest.mark.parametrize(
    ("factory", "options", "message"),
    [
        (
            faulty_plugins.MinTokensFirstSampler,
            StandardSamplerOptions(),
            r"^min_tokens: a configured processor set stop token \d+'s logit",
        ),
        (
            faulty_plugins.ProcessorsFirstSampler,
            StandardSamplerOptions(),
            r"^logits_processors: configured processors must see the logits after the "
            r"request's logit_bias",
        ),
    ],
    ids=["min-tokens-first", "processors-first"],
)
def test_the_sampler_check_fails_a_chain_in_the_wrong_order(
    factory: object, options: object, message: str
) -> None:
    with pytest.raises(AssertionError, match=message):
        check_sampler(factory, options)  # type: ignore[arg-type]


class BansInEveryRow(BanWordsProcessor):
    """Masks its tokens in rows it was never given."""

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        logits[:, 3] = float("-inf")
        return logits


class ForgetsEmittedTokens(PenaltiesProcessor):
    """Ignores a re-added request's emitted tokens (its counts restart after a preemption)."""

    def add(self, row: int, request: Request) -> None:
        fresh = Request(request.request_id, request.prompt_token_ids, request.sampling_params)
        super().add(row, fresh)


class DependsOnTheInstance(BanWordsProcessor):
    """Shifts its rows by a number drawn once per instance: two instances disagree."""

    def __init__(self, params: SamplerParams, options: BanWordsOptions) -> None:
        super().__init__(params, options)
        self.shift = torch.rand(()).item()  # the global generator moves between instances

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        shift = self.shift * self._tracked[rows].unsqueeze(1)  # [S, 1]
        return super().apply(logits, rows) + shift


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (BansInEveryRow, r"BansInEveryRow: row 9 was never added but apply edited it"),
        (
            lambda params, _: ForgetsEmittedTokens(params),
            r"ForgetsEmittedTokens: request conformance-0 added again after a preemption",
        ),
        (
            DependsOnTheInstance,
            r"DependsOnTheInstance: step 0 differs between two instances",
        ),
    ],
    ids=["edits-never-added-rows", "forgets-after-preemption", "nondeterministic"],
)
def test_the_logits_processor_check_fails_a_broken_processor(factory: object, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_logits_processor(factory, BanWordsOptions(token_ids=(3,)))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "stage", [PenaltiesProcessor, MinTokensProcessor, LogitBiasProcessor], ids=lambda c: c.__name__
)
def test_the_standard_samplers_stages_pass_the_logits_processor_check(stage: type) -> None:
    check_logits_processor(lambda params, _: stage(params), None)


class ForgetsToRollBack(PenaltiesProcessor):
    """Claims rollback but keeps the counts of the tokens it should uncount."""

    def rollback(self, row: int, num_tokens: int) -> None:
        pass


class ClaimsIndependence(PenaltiesProcessor):
    """Says every request is position independent, penalties included."""

    def is_position_independent(self, request: Request) -> bool:
        return True


@pytest.mark.parametrize(
    ("stage", "message"),
    [
        (ForgetsToRollBack, r"ForgetsToRollBack: accepting 3 tokens then rolling them back"),
        (ClaimsIndependence, r"ClaimsIndependence: is_position_independent is True"),
    ],
    ids=["no-rollback", "false-independence"],
)
def test_the_logits_processor_check_fails_a_processor_speculation_cannot_trust(
    stage: type, message: str
) -> None:
    with pytest.raises(AssertionError, match=message):
        check_logits_processor(lambda params, _: stage(params), None)


def test_the_logits_processor_check_builds_from_sampler_params() -> None:
    seen: list[SamplerParams] = []

    def factory(params: SamplerParams, options: BanWordsOptions) -> BanWordsProcessor:
        seen.append(params)
        return BanWordsProcessor(params, options)

    check_logits_processor(factory, BanWordsOptions(token_ids=(1,)), vocab_size=40)
    assert seen
    assert all(p.vocab_size == 40 and p.logits_processors == () for p in seen)


@pytest.mark.parametrize("component", components("detokenizer"), ids=ids)
def test_detokenizer_conforms(component: Component, tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    options = build_options(component.options_type, {}, component.name)
    check_detokenizer(component.factory, options, tokenizer)
