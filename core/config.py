"""The engine config: one TOML table per station, validated against typed schemas.

Precedence, lowest first: built-in defaults, the TOML file, ``BRIGADE_<STATION>__<KEY>``
environment variables, ``--set station.key=value`` flags.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from brigade.device_defaults import machine_defaults
from brigade.errors import ConfigError, ModelLoadError, UnknownComponentError
from brigade.interfaces import Checkpoint, PageSizeRule
from brigade.limits import check_process_counts, executor_models_time
from brigade.memory_limits import check_memory
from brigade.models.tensor_shapes import check_weights_match_config, require_weights
from brigade.options import build_options, unknown_key_error
from brigade.registry import Registry
from brigade.stations import STATIONS, Station

__all__ = [
    "OFFLINE_DEFAULTS",
    "ChainEntry",
    "EngineConfig",
    "StationConfig",
    "check_config",
    "check_draft_model",
    "load_config",
    "parse_override",
]

ENV_PREFIX = "BRIGADE_"
OFFLINE_DEFAULTS = {"scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 4096}}
"""The offline API's step budget where the config sets none: twice the server's (which keeps
inter-token latency down), as vLLM's ``LLM`` class on a CPU takes. A batch has no one waiting
on its next token, and fewer, larger prefill chunks leave fewer steps: SmolLM2's mixed workload
in bfloat16 ran ~3% faster with 4096 tokens a step than with 2048 (docs/benchmarks.md)."""

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class ChainEntry:
    """One component of a station's chain: a logits processor the sampler applies."""

    name: str
    options: Any
    """Its options instance, from ``[<station>.<kind>_options.<name>]`` (defaults if absent)."""


@dataclasses.dataclass(frozen=True, slots=True)
class StationConfig:
    """One station's validated table."""

    plugin: str | None
    """The selected component's name (None for a station with no plugin chosen)."""
    settings: Any
    """The station's own options (e.g. ``[kv] page_size``), shared by all its plugins."""
    options: Any
    """The plugin's options instance (``NoOptions()`` when there is no plugin)."""
    chain: tuple[ChainEntry, ...] = ()
    """The components the station's chain setting lists, in order (``[sampler]
    logits_processors``); empty for a station without one."""


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """The assembled, validated and frozen configuration."""

    stations: Mapping[str, StationConfig]
    source: str
    """Where it came from (file path or '(defaults)'), for error messages."""
    machine_defaults: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Station -> the plugin this machine gives it where the config names none (a CUDA GPU's,
    ``brigade.device_defaults``); the other stations' default is their static one."""

    def default_plugin(self, station: str) -> str | None:
        """The plugin ``station`` gets when the config names none, on this machine."""
        return self.machine_defaults.get(station) or STATIONS[station].default_plugin

    def __getitem__(self, station: str) -> StationConfig:
        return self.stations[station]

    def plugin(self, station: str) -> str:
        """The plugin chosen for ``station``; ``ConfigError`` if the station has none."""
        name = self.stations[station].plugin
        if name is None:
            raise ConfigError(f"{self.source} [{station}]: choose a component with plugin = ...")
        return name

    @property
    def components(self) -> dict[str, str]:
        """Station -> selected plugin name, for logs and ``brigade_engine_started``."""
        return {name: s.plugin for name, s in self.stations.items() if s.plugin is not None}


def load_config(
    path: str | os.PathLike[str] | None,
    registry: Registry,
    *,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    defaults: Mapping[str, Mapping[str, Any]] | None = None,
) -> EngineConfig:
    """Read, merge and validate a config. ``path=None`` means defaults only. ``defaults``
    (station -> key -> value) replace the options' own defaults: a value the file, the
    environment or an override sets wins over them (the offline API's step budget)."""
    source = str(path) if path is not None else "(defaults)"
    tables = _read_toml(Path(path)) if path is not None else {}
    _merge(tables, _env_overrides(os.environ if environ is None else environ), "environment")
    for override in overrides:
        station, values = parse_override(override)
        _merge(tables, {station: values}, "--set")
    for station, given in (defaults or {}).items():
        for key, value in given.items():
            tables.setdefault(station, {}).setdefault(key, value)
    unknown = sorted(set(tables) - set(STATIONS))
    if unknown:
        raise ConfigError(
            f"{source}: unknown table [{unknown[0]}]; tables are {', '.join(STATIONS)}"
        )
    machine = machine_defaults(tables, registry)
    if taken := {s: p for s, p in machine.items() if "plugin" not in tables.get(s, {})}:
        logger.info(
            "this machine: %s (name a plugin to choose another)",
            ", ".join(f"[{station}] plugin = {plugin!r}" for station, plugin in taken.items()),
        )
    stations = {
        name: _build_station(station, tables.get(name, {}), registry, source, machine.get(name))
        for name, station in STATIONS.items()
    }
    return EngineConfig(stations=stations, source=source, machine_defaults=machine)


def check_config(
    config: EngineConfig, registry: Registry, checkpoint: Checkpoint | None = None
) -> list[str]:
    """Cross-station checks that need no model weights; returns notes for the user.

    Raises ``ConfigError`` when stations disagree (e.g. a page size the attention backend
    cannot read) or ask this machine for more processes or memory than it has
    (``brigade.limits``, ``brigade.memory_limits``), and ``ModelLoadError`` for a model that
    loading would refuse: a missing or unreadable file, a config.json that disagrees with its
    weights, an unsupported architecture, tensor type or config value, a tokenizer or chat
    template that cannot be built. ``checkpoint`` is the already opened model, if any.
    """
    notes: list[str] = []
    page_size = config["kv"].settings.page_size
    for station in ("attention", "kv"):
        chosen = config[station]
        if chosen.plugin is None:
            continue
        factory = registry.get(station, chosen.plugin).factory
        rule_of = getattr(factory, "supported_page_sizes", None)
        rule = rule_of(chosen.options) if rule_of is not None else PageSizeRule()
        if not rule.allows(page_size):
            what = "attention backend" if station == "attention" else "KV manager"
            raise ConfigError(
                f"{config.source}: [kv] page_size = {page_size} cannot be used by {what} "
                f"{chosen.plugin!r}; it needs {rule.describe()}"
            )
    _check_speculative(config, registry)
    check_process_counts(config, registry)
    from brigade.models.checkpoint import open_checkpoint

    settings = config["model"].settings
    checkpoint = checkpoint or open_checkpoint(settings.path, chat_template=settings.chat_template)
    notes.append(f"model: {_check_model(config, registry, checkpoint)}")
    check_memory(config, registry, checkpoint)
    draft = _check_proposer_model(config, registry, checkpoint)
    if draft is not None:
        notes.append(f"draft model: {draft}")
    return notes


def _check_speculative(config: EngineConfig, registry: Registry) -> None:
    """A proposer needs a KV manager that reserves pages for drafts. Any executor verifies
    them: one that returns token ids returns one per logits row, each checked against the
    next draft like a sampled token (the ``simulated`` executor models acceptance so)."""
    proposer = config["speculative"].plugin
    if proposer is None:
        return
    where = f"{config.source} [speculative] plugin = {proposer!r}"
    kv = registry.get("kv", config.plugin("kv")).factory
    if not getattr(kv, "supports_draft_tokens", False):
        raise ConfigError(
            f"{where}: the KV manager {config.plugin('kv')!r} reserves no pages for draft "
            "tokens (KVManager.supports_draft_tokens); use kv 'paged' or 'radix', or turn "
            "speculation off"
        )


def _check_proposer_model(
    config: EngineConfig, registry: Registry, served: Checkpoint
) -> str | None:
    """The model the proposer will load (``Proposer.model_to_load``), checked without its
    weights; described in one line, or None when it loads none."""
    speculative = config["speculative"]
    if speculative.plugin is None:
        return None
    factory = registry.get("proposer", speculative.plugin).factory
    model_to_load = getattr(factory, "model_to_load", None)
    path = model_to_load(speculative.options) if model_to_load is not None else None
    if path is None:
        return None
    draft = check_draft_model(config, registry, served, path)
    return f"{draft.name} ({draft.format}) at {draft.path}"


def check_draft_model(
    config: EngineConfig, registry: Registry, served: Checkpoint, path: str
) -> Checkpoint:
    """Open the draft model at ``path`` (no weights) and refuse what loading it would: a
    missing or unreadable model (``ModelLoadError``), an unsupported architecture, another
    tokenizer than the served model's, tensor parallelism (``ConfigError``)."""
    from brigade.models.checkpoint import open_checkpoint

    where = f"{config.source} [speculative] model {path!r}"
    if getattr(config["executor"].options, "tensor_parallel_size", 1) > 1:
        raise ConfigError(
            f"{where}: a draft model does not run under tensor parallelism yet; set "
            "[executor] tensor_parallel_size = 1 or use the ngram or suffix proposer"
        )
    try:
        checkpoint = open_checkpoint(path)
        check_weights_match_config(checkpoint)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{where}: {exc}") from None
    _check_architecture(where, checkpoint, registry)
    if not executor_models_time(config, registry):
        try:
            require_weights(checkpoint)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{where}: {exc}") from None
    _check_same_tokenizer(where, served, checkpoint)
    return checkpoint


def _check_architecture(where: str, checkpoint: Checkpoint, registry: Registry) -> None:
    """A registered architecture that accepts the checkpoint's config."""
    from brigade.assemble import model_architecture

    try:
        architecture = model_architecture(checkpoint, registry)
    except ModelLoadError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    try:
        architecture.validate_config(checkpoint.config)
    except ValueError as exc:
        raise ModelLoadError(f"{where}: {exc}") from None


def _check_same_tokenizer(where: str, served: Checkpoint, draft: Checkpoint) -> None:
    """A draft speaks the served model's token ids: the same vocabulary, id for id."""
    mine, theirs = served.tokenizer(), draft.tokenizer()
    if mine is None or theirs is None:
        return  # token-id models (tests, config-only folders): ids are all there is
    ours, its = mine.get_vocab(), theirs.get_vocab()
    if ours != its:
        differ = sum(1 for token, i in its.items() if ours.get(token) != i)
        raise ConfigError(
            f"{where}: its tokenizer is not the served model's ({len(its)} tokens, "
            f"{differ + len(set(ours) - set(its))} differ from the served model's {len(ours)}); "
            "a draft model must share the served model's tokenizer"
        )


def _check_model(config: EngineConfig, registry: Registry, checkpoint: Checkpoint) -> str:
    """Check what loading the opened model checks (no weights); describe it in one line."""
    where = f"{config.source} [model]"
    check_weights_match_config(checkpoint)  # first: the config may describe a huge model
    _check_architecture(where, checkpoint, registry)
    if not executor_models_time(config, registry):
        require_weights(checkpoint)
    names = checkpoint.config.get("architectures") or ["?"]
    described = f"{checkpoint.name} ({checkpoint.format}, {names[0]}) at {checkpoint.path}"
    tokenizer = checkpoint.tokenizer()
    if tokenizer is None:
        return f"{described}; no tokenizer (token-id prompts only)"
    vocab_size = checkpoint.config.get("vocab_size")
    tokens = len(tokenizer)
    if isinstance(vocab_size, int) and tokens > vocab_size:
        raise ModelLoadError(
            f"{where}: the tokenizer has {tokens} tokens but the model only {vocab_size} "
            "embeddings; they are not from the same model"
        )
    return described


def parse_override(text: str) -> tuple[str, dict[str, Any]]:
    """``'kv.page_size=32'`` -> ``('kv', {'page_size': 32})``; the value is read as TOML."""
    key, sep, raw = text.partition("=")
    station, dot, option = key.strip().partition(".")
    if not sep or not dot or not station or not option:
        raise ConfigError(f"override {text!r} must look like station.key=value")
    return station, {option: _parse_value(raw.strip(), f"--set {key.strip()}")}


def _parse_value(raw: str, where: str) -> Any:
    """``raw`` read as a TOML value, else as the string itself."""
    try:
        return _loads_toml(f"value = {raw}", where)["value"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word is a string: --set model.path=/models/x


def _loads_toml(text: str, where: str) -> dict[str, Any]:
    """``tomllib.loads``, with what it raises besides ``TOMLDecodeError`` for text a user
    wrote (nesting deeper than Python's recursion limit, an integer of thousands of digits)
    as the ``ConfigError`` naming ``where``."""
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise ConfigError(
            f"{where}: arrays or tables nested too deeply to read; no setting nests like that"
        ) from None
    except tomllib.TOMLDecodeError:
        raise
    except ValueError:  # int() past sys.get_int_max_str_digits()
        raise ConfigError(
            f"{where}: an integer of more than {sys.get_int_max_str_digits()} digits; no "
            "setting takes such a number"
        ) from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    try:
        data = _loads_toml(text, str(path))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    for name, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(
                f"{path}: top-level key {name!r} must be a table like [{name}]; "
                f"tables are {', '.join(STATIONS)}"
            )
    return data


def _env_overrides(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    tables: dict[str, dict[str, Any]] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        station, _, option = name[len(ENV_PREFIX) :].lower().partition("__")
        tables.setdefault(station, {})[option] = _parse_value(raw, name)
    return tables


def _merge(tables: dict[str, Any], extra: Mapping[str, Mapping[str, Any]], origin: str) -> None:
    for station, values in extra.items():
        if station not in STATIONS:
            raise ConfigError(
                f"{origin}: unknown station {station!r}; stations are {', '.join(STATIONS)}"
            )
        tables.setdefault(station, {}).update(values)


_MOVED = {
    ("sampler", "xgrammar"): (
        "the 'xgrammar' sampler is gone (Brigade 2.0): structured output is its own station now, "
        '[grammar] plugin = "xgrammar", on by default next to any sampler; use [sampler] '
        'plugin = "standard" and move max_whitespace, compile_threads and cache_size to [grammar]'
    ),
}
"""Components that moved in a release, by (station, name): what to write instead."""


def _build_station(
    station: Station,
    table: Mapping[str, Any],
    registry: Registry,
    source: str,
    machine_default: str | None = None,
) -> StationConfig:
    """``machine_default``: the plugin this machine gives the station when the table names
    none, instead of its static default (``machine_defaults``)."""
    where = f"{source} [{station.name}]"
    values = dict(table)
    plugin = values.pop("plugin", machine_default or station.default_plugin)
    chain_options = values.pop(station.chain_options_key, {}) if station.chain_options_key else {}
    if not station.kind and "plugin" in table:
        raise ConfigError(f"{where}: this table selects no plugin; remove 'plugin'")
    if plugin is not None and not isinstance(plugin, str):
        raise ConfigError(f"{where} plugin: expected a plugin name (str), got {plugin!r}")
    setting_keys = {f.name for f in dataclasses.fields(station.settings_type)}
    settings = build_options(
        station.settings_type, {k: v for k, v in values.items() if k in setting_keys}, where
    )
    plugin_values = {k: v for k, v in values.items() if k not in setting_keys}
    chain = _build_chain(station, settings, chain_options, registry, source)
    if plugin is None:
        for key in plugin_values:
            raise unknown_key_error(where, key, sorted(setting_keys))
        return StationConfig(plugin=None, settings=settings, options=None)
    try:
        component = registry.get(station.kind or "", plugin)
    except UnknownComponentError as exc:
        moved = _MOVED.get((station.name, plugin))
        raise ConfigError(f"{where} plugin: {moved or exc}") from None
    plugin_keys = [f.name for f in dataclasses.fields(component.options_type)]
    for key in plugin_values:
        if key not in plugin_keys:
            chain_keys = [station.chain_options_key] if station.chain_options_key else []
            allowed = ["plugin", *sorted(setting_keys), *chain_keys, *plugin_keys]
            error = unknown_key_error(f"{where} ({plugin})", key, allowed)
            takers = _plugins_taking(registry, station, key)
            if takers:
                names = " or ".join(repr(name) for name in takers)
                error = ConfigError(f"{error}; it is an option of {station.name} plugin {names}")
            raise error
    options = build_options(component.options_type, plugin_values, f"{where} ({plugin})")
    return StationConfig(plugin=plugin, settings=settings, options=options, chain=chain)


def _plugins_taking(registry: Registry, station: Station, key: str) -> list[str]:
    """The installed plugins of ``station`` whose options include ``key`` (a key that moved
    between plugins, e.g. ``native_decode`` from ``sdpa`` to ``cpu``)."""
    if not station.kind:
        return []
    return [
        name
        for name in registry.names(station.kind)
        if key
        in {f.name for f in dataclasses.fields(registry.get(station.kind, name).options_type)}
    ]


def _build_chain(
    station: Station, settings: Any, tables: Any, registry: Registry, source: str
) -> tuple[ChainEntry, ...]:
    """The components a station's chain setting names, each with its validated options."""
    kind, key, options_key = station.chain_kind, station.chain_key, station.chain_options_key
    if kind is None or key is None or options_key is None:
        return ()
    where = f"{source} [{station.name}]"
    names: tuple[str, ...] = getattr(settings, key)
    if not isinstance(tables, Mapping):
        raise ConfigError(
            f"{where} {options_key}: expected a table of option tables, one per {kind} "
            f"([{station.name}.{options_key}.<name>]), got {type(tables).__name__} {tables!r}"
        )
    components = []
    for index, name in enumerate(names):
        if name in names[:index]:
            raise ConfigError(f"{where} {key}: {name!r} is listed twice; list each {kind} once")
        try:
            components.append(registry.get(kind, name))
        except UnknownComponentError as exc:
            raise ConfigError(f"{where} {key}[{index}]: {exc}") from None
    unlisted = sorted(set(tables) - set(names))
    if unlisted:
        listed = ", ".join(names) or "(none)"
        raise ConfigError(
            f"{where} {options_key}.{unlisted[0]}: options for a {kind} that {key} does not "
            f"list (listed: {listed}); add it to {key} or remove the table"
        )
    chain = []
    for name, component in zip(names, components, strict=True):
        table = tables.get(name, {})
        table_where = f"{source} [{station.name}.{options_key}.{name}]"
        if not isinstance(table, Mapping):
            raise ConfigError(
                f"{table_where}: expected a table of {name}'s options, got "
                f"{type(table).__name__} {table!r}"
            )
        chain.append(ChainEntry(name, build_options(component.options_type, table, table_where)))
    return tuple(chain)
