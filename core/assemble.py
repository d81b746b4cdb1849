"""Turns a validated config into live components (the model side, for now)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from brigade.config import EngineConfig
from brigade.errors import ConfigError, ModelLoadError
from brigade.interfaces import AttentionBackend, Executor, ExecutorParams
from brigade.registry import Registry

if TYPE_CHECKING:
    from pathlib import Path

__all__ = [
    "ModelPath",
    "build_executor",
    "kv_pool_pages",
    "read_eos_token_ids",
    "resolve_model_path",
]

GIB = 1 << 30


@dataclasses.dataclass(frozen=True, slots=True)
class ModelPath:
    """An executor with its KV pool allocated, and where its model came from."""

    executor: Executor
    model_dir: Path
    num_pages: int
    page_size: int
    max_model_len: int
    host_pages: tuple[int, ...] = ()
    """Ids of the executor's host (swap) pages."""


def resolve_model_path(config: EngineConfig) -> Path:
    """``[model] path``, building the built-in default model on first use."""
    from pathlib import Path

    from brigade.models.create import default_model_dir

    path = config["model"].settings.path
    return default_model_dir() if path == "default" else Path(path).expanduser()


def build_executor(config: EngineConfig, registry: Registry) -> ModelPath:
    """Create the attention backend and executor, load weights, allocate the KV pool."""
    from brigade.models.loader import read_hf_config

    model_dir = resolve_model_path(config)
    hf_config = read_hf_config(model_dir)
    architecture = _model_architecture(hf_config.get("architectures") or [], registry, model_dir)
    attention_station = config["attention"]
    attention: AttentionBackend = registry.get("attention", config.plugin("attention")).factory(
        attention_station.options
    )
    model = config["model"].settings
    kv = config["kv"].settings
    params = ExecutorParams(
        model_path=str(model_dir),
        dtype=model.dtype,
        attention=attention,
        page_size=kv.page_size,
        kv_cache_dtype=kv.cache_dtype,
        max_model_len=model.max_model_len,
        seed=model.seed,
        model_factory=architecture,
    )
    executor_station = config["executor"]
    try:
        executor: Executor = registry.get("executor", config.plugin("executor")).factory(
            params, executor_station.options
        )
    except RuntimeError as exc:  # a device the chosen executor or backend cannot use
        raise ConfigError(
            f"{config.source}: executor {config.plugin('executor')!r} with attention "
            f"{config.plugin('attention')!r} cannot start here: {exc}"
        ) from exc
    num_pages = kv_pool_pages(executor, config)
    num_host_pages = _host_pages(executor, config)
    executor.initialize_kv_cache(num_pages, num_host_pages)
    max_model_len = executor.kv_cache_spec().max_model_len
    host_pages = tuple(range(num_pages, num_pages + num_host_pages))
    return ModelPath(executor, model_dir, num_pages, kv.page_size, max_model_len, host_pages)


def kv_pool_pages(executor: Executor, config: EngineConfig) -> int:
    """Pages in the KV pool: ``[kv] num_pages``, or what the memory settings allow."""
    kv = config["kv"].settings
    spec = executor.kv_cache_spec()
    if kv.num_pages:
        num_pages = kv.num_pages
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


def _model_architecture(names: list[str], registry: Registry, model_dir: Path) -> object:
    for name in names:
        if name in registry.names("model"):
            return registry.get("model", name).factory()
    raise ModelLoadError(
        f"{model_dir}: architecture {', '.join(names) or '(none given)'} is not supported; "
        f"supported: {', '.join(registry.names('model'))}"
    )


def read_eos_token_ids(model_dir: Path) -> frozenset[int]:
    """End-of-sequence ids: ``generation_config.json``'s, else ``config.json``'s."""
    import json

    from brigade.models.loader import read_hf_config

    ids: object = None
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        try:
            ids = json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{generation} is not valid JSON: {exc}") from exc
    if ids is None:
        ids = read_hf_config(model_dir).get("eos_token_id")
    if ids is None:
        return frozenset()
    values = ids if isinstance(ids, list) else [ids]
    if not all(isinstance(v, int) for v in values):
        raise ModelLoadError(f"{model_dir}: eos_token_id must be an integer or a list of them")
    return frozenset(values)
