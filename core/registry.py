"""The component registry: every scheduler, KV manager, executor ... that plugins provide.

Components arrive through pluggy: each distribution's entry point in the ``brigade`` group
implements ``brigade_register(registry)``. Brigade's built-ins use the same path.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pluggy

from brigade.errors import (
    DuplicateComponentError,
    IncompatiblePluginError,
    UnknownComponentError,
)
from brigade.interfaces import API_VERSION, COMPONENT_KINDS, FACTORY_ARGUMENTS, NoOptions
from brigade.interfaces.hookspecs import PROJECT_NAME, BrigadeHookSpec

__all__ = ["MIGRATION_DOC", "Component", "Registry", "default_registry", "load_registry"]

MIGRATION_DOC = 'docs/plugins.md, "Migrating a 1.x plugin to 2.0"'
"""Where a plugin author reads what changed between API majors."""

_REPLACED = frozenset({"scheduler"})
"""Kinds whose contract API 2.0 replaced (1.x schedulers subclassed core's BatchScheduler)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Component:
    """One registered implementation of a contract."""

    kind: str
    name: str
    factory: Callable[..., Any]
    options_type: type
    distribution: str
    """'name version' of the distribution whose plugin registered it."""
    api_version: str | None = None
    """The plugin API version it declared it was built for (None: undeclared)."""


class Registry:
    """Components by kind and name. Implements the ``ComponentRegistry`` protocol."""

    def __init__(self, hook: Any = None) -> None:
        self._components: dict[str, dict[str, Component]] = {k: {} for k in COMPONENT_KINDS}
        self._source = "(registered directly)"
        self.hook = hook
        """The plugin manager's hook relay, for event hooks (None when built by hand)."""

    def add(
        self,
        kind: str,
        name: str,
        factory: Any,
        *,
        options: type | None = None,
        api_version: str | None = None,
    ) -> None:
        """Register ``factory`` as ``name`` of ``kind``; see ``ComponentRegistry.add``."""
        if kind not in self._components:
            raise ValueError(
                f"cannot register {name!r}: unknown component kind {kind!r}; "
                f"kinds are {', '.join(sorted(self._components))}"
            )
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"component names must be non-empty strings, got {name!r}")
        if api_version is not None:
            self._check_api_version(kind, name, api_version)
        if not callable(factory):
            raise TypeError(f"{kind} {name!r}: factory {factory!r} is not callable")
        _check_factory(kind, name, factory)
        options_type = NoOptions if options is None else options
        _check_options_type(kind, name, options_type)
        existing = self._components[kind].get(name)
        if existing is not None:
            raise DuplicateComponentError(
                f"{kind} {name!r} is registered twice: by {existing.distribution} and by "
                f"{self._source}; uninstall one of them or rename the component"
            )
        self._components[kind][name] = Component(
            kind, name, factory, options_type, self._source, api_version
        )

    def get(self, kind: str, name: str) -> Component:
        """The component, or ``UnknownComponentError`` listing the registered names."""
        if kind not in self._components:
            raise UnknownComponentError(f"unknown component kind {kind!r}")
        try:
            return self._components[kind][name]
        except KeyError:
            known = ", ".join(sorted(self._components[kind])) or "(none registered)"
            raise UnknownComponentError(
                f"no {kind} plugin named {name!r}; registered {kind} plugins: {known}"
            ) from None

    def names(self, kind: str) -> list[str]:
        """Sorted names registered for ``kind``."""
        return sorted(self._components[kind])

    def __iter__(self) -> Iterator[Component]:
        for kind in self._components:
            yield from (self._components[kind][n] for n in sorted(self._components[kind]))

    def _check_api_version(self, kind: str, name: str, api_version: str) -> None:
        try:
            wanted = _parse_api_version(api_version)
        except ValueError:
            raise ValueError(
                f"{kind} {name!r} from {self._source}: api_version must be 'MAJOR.MINOR' "
                f"(e.g. {API_VERSION!r}), got {api_version!r}"
            ) from None
        ours = _parse_api_version(API_VERSION)
        if wanted[0] == ours[0] and wanted[1] <= ours[1]:
            return
        if wanted[0] != ours[0]:
            advice = (
                f"install a release of {self._source.split()[0]} built for API {ours[0]}.x, "
                f"or a Brigade that provides API {wanted[0]}.x"
            )
            if wanted[0] < ours[0]:
                advice += f"; to port it, see {MIGRATION_DOC}"
        else:
            advice = f"upgrade Brigade to one that provides API {api_version} or newer"
        raise IncompatiblePluginError(
            f"{kind} plugin {name!r} from {self._source} needs Brigade plugin API "
            f"{api_version}, but this Brigade provides API {API_VERSION}; {advice}"
        )

    def _register_from(self, source: str, register: Callable[..., object]) -> None:
        previous, self._source = self._source, source
        try:
            register(registry=self)
        finally:
            self._source = previous


def load_registry(*, entry_points: bool = True, plugins: Iterable[object] = ()) -> Registry:
    """Discover plugins (entry point group ``brigade``, plus ``plugins`` given directly).

    Each call builds a fresh registry, so loading is repeatable in any process.
    """
    manager = pluggy.PluginManager(PROJECT_NAME)
    manager.add_hookspecs(BrigadeHookSpec)
    if entry_points:
        manager.load_setuptools_entrypoints(PROJECT_NAME)
    for plugin in plugins:
        manager.register(plugin)
    distributions = {
        id(plugin): f"{dist.project_name} {dist.version}"
        for plugin, dist in manager.list_plugin_distinfo()
    }
    registry = Registry(manager.hook)
    # Registration order: pluggy calls later registrations first; we want discovery order.
    for impl in reversed(manager.hook.brigade_register.get_hookimpls()):
        source = distributions.get(id(impl.plugin), f"plugin {impl.plugin_name}")
        registry._register_from(source, impl.function)
    return registry


@functools.cache
def default_registry() -> Registry:
    """The registry of everything installed, loaded once per process."""
    return load_registry()


def _parse_api_version(version: object) -> tuple[int, int]:
    """(MAJOR, MINOR) of a "MAJOR.MINOR" string; ValueError if it is not one."""
    match = re.fullmatch(r"(\d+)\.(\d+)", version) if isinstance(version, str) else None
    if match is None:
        raise ValueError(f"not a 'MAJOR.MINOR' version: {version!r}")
    return int(match[1]), int(match[2])


def _check_factory(kind: str, name: str, factory: Callable[..., Any]) -> None:
    """``TypeError`` saying what is missing when ``factory`` cannot make a ``kind``: a class
    that is not a subclass of the kind's contract or leaves abstract methods unimplemented, or
    any factory that cannot be called with the kind's factory arguments."""
    contract = COMPONENT_KINDS[kind]
    if isinstance(factory, type):
        abstract = sorted(getattr(contract, "__abstractmethods__", ()))
        if not issubclass(factory, contract):
            missing = [method for method in abstract if not hasattr(factory, method)]
            raise TypeError(
                f"{kind} {name!r}: {factory.__qualname__} does not implement the "
                f"{contract.__name__} contract: subclass brigade.interfaces.{contract.__name__}"
                + (f" and define {', '.join(missing)}" if missing else "")
                + (f" (written for API 1.x? see {MIGRATION_DOC})" if kind in _REPLACED else "")
            )
        if inspect.isabstract(factory):
            left = ", ".join(sorted(getattr(factory, "__abstractmethods__", ())))
            raise TypeError(
                f"{kind} {name!r}: {factory.__qualname__} leaves {contract.__name__} methods "
                f"unimplemented: {left}"
            )
    arguments = FACTORY_ARGUMENTS[kind]
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    try:
        signature.bind(*arguments)
    except TypeError:
        taken = ", ".join(str(p).split(":")[0] for p in signature.parameters.values())
        raise TypeError(
            f"{kind} {name!r}: core calls the factory as factory({', '.join(arguments)}), but "
            f"{getattr(factory, '__qualname__', factory)!r} takes ({taken})"
        ) from None


def _check_options_type(kind: str, name: str, options_type: type) -> None:
    if not dataclasses.is_dataclass(options_type) or not isinstance(options_type, type):
        raise TypeError(f"{kind} {name!r}: options must be a dataclass type, got {options_type!r}")
    missing = [
        f.name
        for f in dataclasses.fields(options_type)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise TypeError(
            f"{kind} {name!r}: every option needs a default; missing for {', '.join(missing)}"
        )
