"""The engine's stations around its loaded model: KV manager, scheduler, sampler, grammar,
persistent batch and speculation, built from a checked config (``EngineCore`` holds them)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from brigade.assemble import ModelPath, build_grammar, build_sampler
from brigade.config import EngineConfig
from brigade.errors import ConfigError
from brigade.grammar import GrammarManager
from brigade.interfaces import (
    Checkpoint,
    DraftModel,
    GrammarParams,
    KVManager,
    KVPoolParams,
    LogitsProcessor,
    Proposer,
    ProposerParams,
    Sampler,
    SamplerParams,
    SchedulerParams,
)
from brigade.persistent_batch import PersistentBatch
from brigade.registry import Registry
from brigade.sampling_stage import SamplingStage
from brigade.scheduling import BatchScheduler
from brigade.speculative import Speculation
from brigade.swap import SwapSpace

__all__ = ["SHARED_PREFILL_MIN_TOKENS", "Stations", "build_stations"]

SHARED_PREFILL_MIN_TOKENS = 32
"""A waiting request that shares at least this many uncached prompt tokens (and a page) with a
prefill of the current step is admitted one step later, from the cache (``BatchScheduler``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Stations:
    """What ``build_stations`` made; ``EngineCore`` keeps each as an attribute of its own."""

    vocab_size: int
    eos_token_ids: frozenset[int]
    sampling_defaults: dict[str, float]
    """Sampling parameters that requests leaving them unset get (the model's advice)."""
    max_model_len: int
    kv: KVManager
    scheduler: BatchScheduler
    device: torch.device
    sampler_name: str
    sampler: Sampler
    returns_token_ids: bool
    """The executor returns token ids, not logits: no processors, no sampler, no grammar."""
    processors: list[LogitsProcessor]
    grammar: GrammarManager | None
    batch: PersistentBatch
    sampling: SamplingStage
    speculation: Speculation | None


def build_stations(
    config: EngineConfig,
    registry: Registry,
    model: ModelPath,
    *,
    clock: Callable[[], float] = time.monotonic,
    load_model: Callable[..., DraftModel],
) -> Stations:
    """Everything around the loaded model. ``load_model`` is ``ProposerParams.load_model``."""
    executor, checkpoint = model.executor, model.checkpoint
    vocab_size = executor.kv_cache_spec().vocab_size
    settings = config["scheduler"].settings
    # A sequence never outgrows the pool, so a request alone always fits.
    max_model_len = min(model.max_model_len, model.num_pages * model.page_size)
    if not settings.enable_chunked_prefill and settings.max_num_batched_tokens < max_model_len:
        raise ConfigError(
            f"{config.source} [scheduler]: with enable_chunked_prefill = false, "
            f"max_num_batched_tokens ({settings.max_num_batched_tokens}) must be at least "
            f"max_model_len ({max_model_len})"
        )
    kv, scheduler = _scheduler(config, registry, model, max_model_len, clock)
    device = torch.device(executor.device)
    stages = _logits_stages(config, registry, model, device, vocab_size)
    batch = PersistentBatch(
        settings.max_num_seqs, max_model_len, model.page_size, settings.max_num_batched_tokens
    )
    return Stations(
        vocab_size=vocab_size,
        eos_token_ids=checkpoint.eos_token_ids,
        sampling_defaults=(
            dict(checkpoint.sampling_defaults())
            if config["model"].settings.generation_config == "auto"
            else {}
        ),
        max_model_len=max_model_len,
        kv=kv,
        scheduler=scheduler,
        device=device,
        sampler_name=stages.sampler_name,
        sampler=stages.sampler,
        returns_token_ids=stages.returns_token_ids,
        processors=stages.processors,
        grammar=stages.grammar,
        batch=batch,
        sampling=SamplingStage(
            stages.sampler, stages.sampler_name, stages.processors, batch, device, vocab_size
        ),
        speculation=_speculation(
            config, registry, checkpoint, vocab_size, max_model_len, stages.processors, load_model
        ),
    )


def _scheduler(
    config: EngineConfig,
    registry: Registry,
    model: ModelPath,
    max_model_len: int,
    clock: Callable[[], float],
) -> tuple[KVManager, BatchScheduler]:
    """The KV manager and the scheduler over it, with its policy (``[scheduler] plugin``)."""
    settings = config["scheduler"].settings
    kv_settings = config["kv"].settings
    kv: KVManager = registry.get("kv", config.plugin("kv")).factory(
        KVPoolParams(model.num_pages, model.page_size, kv_settings.enable_prefix_caching),
        config["kv"].options,
    )
    policy = registry.get("scheduler", config.plugin("scheduler")).factory
    policy_options = config["scheduler"].options
    scheduler = BatchScheduler(
        SchedulerParams(
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=settings.enable_chunked_prefill,
            clock=clock,
        ),
        kv,
        lambda view: policy(view, policy_options),
        swap=SwapSpace(model.host_pages) if settings.preemption == "swap" else None,
        # Sharing prefills pays once the shared part fills a page and is worth a step.
        share_prefills_from=(
            max(model.page_size, SHARED_PREFILL_MIN_TOKENS)
            if kv_settings.enable_prefix_caching
            else 0
        ),
    )
    return kv, scheduler


@dataclasses.dataclass(frozen=True, slots=True)
class _LogitsStages:
    """The sampler and the logits processors before it (the grammar station last)."""

    sampler_name: str
    sampler: Sampler
    returns_token_ids: bool
    processors: list[LogitsProcessor]
    grammar: GrammarManager | None


def _logits_stages(
    config: EngineConfig,
    registry: Registry,
    model: ModelPath,
    device: torch.device,
    vocab_size: int,
) -> _LogitsStages:
    """The sampler, its logits processors and the grammar station (none of these last two
    when the executor returns token ids)."""
    checkpoint = model.checkpoint
    max_num_seqs = config["scheduler"].settings.max_num_seqs
    eos = tuple(sorted(checkpoint.eos_token_ids))
    sampler_name = config.plugin("sampler")
    sampler = build_sampler(
        config,
        registry,
        SamplerParams(
            max_num_seqs,
            vocab_size,
            str(device),
            model_dir=checkpoint.path,
            eos_token_ids=eos,
            checkpoint=checkpoint,
        ),
    )
    returns_token_ids = type(model.executor).returns_token_ids
    if returns_token_ids:
        return _LogitsStages(sampler_name, sampler, True, [], None)
    processors = list(sampler.logits_processors())
    grammar = build_grammar(
        config,
        registry,
        GrammarParams(
            vocab_size,
            eos,
            str(device),
            checkpoint=checkpoint,
            mask_budget_s=config["grammar"].settings.mask_budget_ms / 1000,
        ),
        max_num_seqs,
    )
    processors.append(grammar)  # last: nothing re-enables what it masks
    return _LogitsStages(sampler_name, sampler, False, processors, grammar)


def _speculation(
    config: EngineConfig,
    registry: Registry,
    checkpoint: Checkpoint,
    vocab_size: int,
    max_model_len: int,
    processors: list[LogitsProcessor],
    load_model: Callable[..., DraftModel],
) -> Speculation | None:
    """Speculative decoding (``[speculative] plugin``); None when it is off."""
    speculative = config["speculative"]
    if speculative.plugin is None:
        return None
    settings = speculative.settings
    proposer: Proposer = registry.get("proposer", speculative.plugin).factory(
        ProposerParams(
            settings.num_speculative_tokens,
            vocab_size,
            config["scheduler"].settings.max_num_seqs,
            max_model_len,
            checkpoint=checkpoint,
            load_model=load_model,
        ),
        speculative.options,
    )
    return Speculation(
        proposer,
        speculative.plugin,
        settings,
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        processors=processors,
    )
