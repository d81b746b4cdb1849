"""What an operator sees when the engine starts: one banner with the model and the config."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from brigade.models.loader import resolve_dtype_name
from brigade.options import option_defaults
from brigade.version import installed_version

if TYPE_CHECKING:
    from brigade.config import EngineConfig
    from brigade.engine import EngineCore

__all__ = ["changed_settings", "startup_banner"]

GIB = 1 << 30


def changed_settings(config: EngineConfig) -> list[str]:
    """``station.key=value`` for every setting that differs from its default (a plugin from
    this machine's default: a CUDA GPU's executor and attention), plugins first."""
    changed: list[str] = []
    for name, station in config.stations.items():
        if station.plugin is not None and station.plugin != config.default_plugin(name):
            changed.append(f"{name}.plugin={station.plugin}")
        for values in (station.settings, station.options):
            if values is None or not dataclasses.is_dataclass(values) or isinstance(values, type):
                continue
            defaults = option_defaults(type(values))
            for key, value in dataclasses.asdict(values).items():
                if defaults.get(key) != value:
                    changed.append(f"{name}.{key}={_shown(key, value)}")
    return changed


def _shown(key: str, value: Any) -> str:
    if key == "api_keys":  # never print secrets
        return f"[{len(value)} key{'s' * (len(value) != 1)}]"
    return repr(value) if isinstance(value, str) else str(value)


def startup_banner(engine: EngineCore) -> str:
    """Several lines: version, model, dtypes, the KV pool, components, the config in effect."""
    config = engine.config
    checkpoint = engine.checkpoint
    model = config["model"].settings
    kv_settings = config["kv"].settings
    dtype = resolve_dtype_name(model.dtype, checkpoint.config)
    cache_dtype = dtype if kv_settings.cache_dtype == "auto" else kv_settings.cache_dtype
    kv = engine.kv.stats()
    spec = engine.executor.kv_cache_spec()
    pool_gib = kv.num_pages * spec.bytes_per_page / GIB
    architecture = (checkpoint.config.get("architectures") or ["?"])[0]
    source = ", ".join(
        part for part in (checkpoint.format.upper(), architecture, checkpoint.describe()) if part
    )
    changed = changed_settings(config)
    lines = [
        f"Brigade {installed_version()}: {checkpoint.name} loaded in {engine.load_time_s:.1f} s",
        f"  model      {checkpoint.path} ({source})",
        f"  dtype      {dtype} weights and activations, {cache_dtype} KV cache",
        f"  KV cache   {kv.num_pages} pages x {engine.batch.page_size} tokens = "
        f"{kv.num_pages * engine.batch.page_size} tokens ({pool_gib:.2f} GiB); "
        f"max_model_len {engine.max_model_len}",
        "  sampling   "
        + (
            ", ".join(f"{k}={v}" for k, v in engine.sampling_defaults.items())
            + " unless a request sets them (the model's recommendation)"
            if engine.sampling_defaults
            else "OpenAI's defaults (temperature 1, top_p 1) unless a request sets them"
        ),
        "  stations   " + " ".join(f"{k}={v}" for k, v in config.components.items()),
        f"  config     {_config_line(config.source, changed)}",
    ]
    return "\n".join(lines)


def _config_line(source: str, changed: list[str]) -> str:
    if not changed:
        return "built-in defaults" if source == "(defaults)" else f"{source}: all defaults"
    return f"{source}; changed: {', '.join(changed)}"
