"""Turns a validated config into live components (the model side, for now)."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from brigade.config import EngineConfig, check_draft_model
from brigade.errors import ConfigError, ModelLoadError
from brigade.grammar import GrammarManager
from brigade.interfaces import (
    AttentionBackend,
    Checkpoint,
    DraftModel,
    Executor,
    ExecutorParams,
    GrammarBackend,
    GrammarParams,
    KVManager,
    KVPoolParams,
    LogitsProcessor,
    ModelArchitecture,
    Sampler,
    SamplerParams,
)
from brigade.interfaces.executor import DTYPE_NAMES
from brigade.registry import Registry

__all__ = [
    "ModelPath",
    "build_executor",
    "build_grammar",
    "build_sampler",
    "kv_pool_pages",
    "load_draft_model",
    "model_architecture",
    "open_model",
]

GIB = 1 << 30

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelPath:
    """An executor with its KV pool allocated, and the checkpoint it loaded."""

    executor: Executor
    checkpoint: Checkpoint
    num_pages: int
    page_size: int
    max_model_len: int
    host_pages: tuple[int, ...] = ()
    """Ids of the executor's host (swap) pages."""
    dtype: str = "float32"
    """The model's dtype (``[model] dtype`` resolved against its config)."""

    @property
    def model_dir(self) -> Path:
        """Where the model's files are (a directory or a GGUF file)."""
        return Path(self.checkpoint.path)


def open_model(config: EngineConfig) -> Checkpoint:
    """Open ``[model] path`` (see ``brigade.models.checkpoint``); reads no weights."""
    from brigade.models.checkpoint import open_checkpoint

    settings = config["model"].settings
    return open_checkpoint(settings.path, chat_template=settings.chat_template)


def build_executor(
    config: EngineConfig, registry: Registry, checkpoint: Checkpoint | None = None
) -> ModelPath:
    """Create the attention backend and executor, load weights, allocate the KV pool.

    The executor reads the model through ``checkpoint`` (opened here when not given) and gets
    ``[model] dtype`` resolved against its config, so it opens and parses nothing itself.
    """
    from brigade.models.loader import resolve_dtype_name

    checkpoint = checkpoint or open_model(config)
    model = config["model"].settings
    dtype = resolve_dtype_name(model.dtype, checkpoint.config)
    executor = _new_executor(config, registry, checkpoint, dtype, model.max_model_len)
    num_pages = kv_pool_pages(executor, config)
    num_host_pages = _host_pages(executor, config)
    executor.initialize_kv_cache(num_pages, num_host_pages)
    max_model_len = executor.kv_cache_spec().max_model_len
    host_pages = tuple(range(num_pages, num_pages + num_host_pages))
    page_size = config["kv"].settings.page_size
    return ModelPath(
        executor, checkpoint, num_pages, page_size, max_model_len, host_pages, dtype=dtype
    )


def _new_executor(
    config: EngineConfig,
    registry: Registry,
    checkpoint: Checkpoint,
    dtype: str,
    max_model_len: int,
) -> Executor:
    """The configured executor and attention backend over ``checkpoint``, weights loaded, no
    KV pool yet."""
    architecture = model_architecture(checkpoint, registry)
    attention: AttentionBackend = registry.get("attention", config.plugin("attention")).factory(
        config["attention"].options
    )
    kv = config["kv"].settings
    params = ExecutorParams(
        model_path=checkpoint.path,
        dtype=dtype,
        attention=attention,
        page_size=kv.page_size,
        kv_cache_dtype=kv.cache_dtype,
        max_model_len=max_model_len,
        seed=config["model"].settings.seed,
        model_factory=architecture,
        checkpoint=checkpoint,
    )
    try:
        executor: Executor = registry.get("executor", config.plugin("executor")).factory(
            params, config["executor"].options
        )
    except RuntimeError as exc:  # a device the chosen executor or backend cannot use
        raise ConfigError(
            f"{config.source}: executor {config.plugin('executor')!r} with attention "
            f"{config.plugin('attention')!r} cannot start here: {exc}"
        ) from exc
    return executor


def load_draft_model(
    config: EngineConfig,
    registry: Registry,
    served: ModelPath,
    path: str,
    *,
    num_pages: int = 0,
    dtype: str = "auto",
) -> DraftModel:
    """``ProposerParams.load_model`` for an engine serving ``served``: the model
    at ``path`` on the engine's executor and attention plugins, with a KV pool of its own
    (``num_pages``; 0: as many as the served model's) under a new instance of the engine's KV
    manager plugin. Refuses what :func:`check_draft_model` refuses."""
    where = f"{config.source} [speculative] model {path!r}"
    if dtype != "auto" and dtype not in DTYPE_NAMES:
        raise ConfigError(f"{where}: dtype {dtype!r}; allowed: auto, {', '.join(DTYPE_NAMES)}")
    if num_pages < 0:
        raise ConfigError(f"{where}: num_pages = {num_pages}; expected 0 (auto) or more")
    started = time.perf_counter()
    checkpoint = check_draft_model(config, registry, served.checkpoint, path)
    executor = _new_executor(
        config, registry, checkpoint, served.dtype if dtype == "auto" else dtype, 0
    )
    spec = executor.kv_cache_spec()
    pages = num_pages or served.num_pages
    executor.initialize_kv_cache(pages)
    kv_settings = config["kv"].settings
    kv: KVManager = registry.get("kv", config.plugin("kv")).factory(
        KVPoolParams(pages, spec.page_size, kv_settings.enable_prefix_caching),
        config["kv"].options,
    )
    logger.info(
        "draft model %s loaded in %.1f s; its KV pool: %d pages of %d tokens (%.2f GiB)",
        checkpoint.path,
        time.perf_counter() - started,
        pages,
        spec.page_size,
        pages * spec.bytes_per_page / GIB,
    )
    return DraftModel(
        executor=executor,
        kv=kv,
        checkpoint=checkpoint,
        num_pages=pages,
        page_size=spec.page_size,
        max_model_len=min(spec.max_model_len, served.max_model_len, pages * spec.page_size),
        vocab_size=spec.vocab_size,
    )


def build_sampler(config: EngineConfig, registry: Registry, params: SamplerParams) -> Sampler:
    """Build the configured logits processors, then the sampler that applies them.

    Raises ``ConfigError`` naming the processor when one cannot be built (a token id outside
    this model's vocabulary, words without a tokenizer), and naming the sampler when it
    leaves a configured processor out of its chain.
    """
    station = config["sampler"]
    processors: list[LogitsProcessor] = []
    for entry in station.chain:
        factory = registry.get("logits_processor", entry.name).factory
        try:
            processors.append(factory(params, entry.options))
        except ValueError as exc:
            raise ConfigError(
                f"{config.source} [sampler] logits_processors: {entry.name!r} cannot start "
                f"with this model: {exc}"
            ) from exc
    name = config.plugin("sampler")
    sampler: Sampler = registry.get("sampler", name).factory(
        dataclasses.replace(params, logits_processors=tuple(processors)), station.options
    )
    chain = list(sampler.logits_processors())
    missing = [
        entry.name
        for entry, processor in zip(station.chain, processors, strict=True)
        if not any(stage is processor for stage in chain)
    ]
    if missing:
        raise ConfigError(
            f"{config.source} [sampler]: sampler {name!r} does not apply the configured logits "
            f"processors {', '.join(missing)} (it must return SamplerParams.logits_processors "
            "from logits_processors()); use a sampler that does, such as 'standard'"
        )
    return sampler


def build_grammar(
    config: EngineConfig, registry: Registry, params: GrammarParams, max_num_seqs: int
) -> GrammarManager:
    """The structured-output station: the configured backend under core's manager."""
    name = config.plugin("grammar")
    backend: GrammarBackend = registry.get("grammar", name).factory(
        params, config["grammar"].options
    )
    return GrammarManager(
        backend,
        name,
        max_num_seqs=max_num_seqs,
        vocab_size=params.vocab_size,
        device=torch.device(params.device),
        mask_budget_s=params.mask_budget_s,
    )


def kv_pool_pages(executor: Executor, config: EngineConfig) -> int:
    """Pages in the KV pool: ``[kv] num_pages``, or what the memory settings allow."""
    kv = config["kv"].settings
    spec = executor.kv_cache_spec()
    if kv.num_pages:
        num_pages = kv.num_pages
        # brigade.limits held the pool to the machine's memory; this holds it to what the
        # executor has free after the weights, before the pool is allocated.
        if num_pages * spec.bytes_per_page > spec.available_bytes:
            raise ConfigError(
                f"{config.source}: [kv] num_pages = {num_pages} would need "
                f"{num_pages * spec.bytes_per_page / GIB:.2f} GiB for the KV pool; executor "
                f"{config.plugin('executor')!r} has {spec.available_bytes / GIB:.2f} GiB free "
                f"after the weights, room for {spec.available_bytes // spec.bytes_per_page} "
                "pages: lower num_pages, or set 0 to size the pool from the memory free"
            )
    else:
        budget = min(spec.available_bytes * kv.memory_fraction, kv.max_memory_gib * GIB)
        # More than every sequence at full length could ever hold is memory wasted.
        max_num_seqs = config["scheduler"].settings.max_num_seqs
        useful = max_num_seqs * -(-spec.max_model_len // kv.page_size)
        num_pages = min(int(budget // spec.bytes_per_page), useful)
    if num_pages < 1:
        raise ConfigError(
            f"{config.source} [kv]: no room for a single KV page "
            f"({spec.bytes_per_page} bytes each); raise max_memory_gib or set num_pages"
        )
    return num_pages


def _host_pages(executor: Executor, config: EngineConfig) -> int:
    """Host pages for swapping: only when ``[scheduler] preemption = "swap"``."""
    if config["scheduler"].settings.preemption != "swap":
        return 0
    if not type(executor).supports_copy_pages:
        raise ConfigError(
            f"{config.source} [scheduler]: preemption = 'swap' needs an executor that can copy "
            f"pages; {config.plugin('executor')!r} cannot"
        )
    bytes_per_page = executor.kv_cache_spec().bytes_per_page
    return int(config["kv"].settings.swap_space_gib * GIB // bytes_per_page)


def model_architecture(checkpoint: Checkpoint, registry: Registry) -> ModelArchitecture:
    """The registered architecture for the checkpoint's ``architectures`` names."""
    names = checkpoint.config.get("architectures") or []
    for name in names:
        if name in registry.names("model"):
            architecture: ModelArchitecture = registry.get("model", name).factory()
            return architecture
    raise ModelLoadError(
        f"{checkpoint.path}: architecture {', '.join(names) or '(none given)'} is not "
        f"supported; supported: {', '.join(registry.names('model'))}"
    )
