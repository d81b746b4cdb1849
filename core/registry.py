"""The component registry: every scheduler, KV manager, executor ... that plugins provide.

Components arrive through pluggy: each distribution's entry point in the ``brigade`` group
implements ``brigade_register(registry)``. Brigade's built-ins use the same path.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pluggy

from brigade.errors import DuplicateComponentError, UnknownComponentError
from brigade.interfaces import COMPONENT_KINDS, NoOptions
from brigade.interfaces.hookspecs import PROJECT_NAME, BrigadeHookSpec

__all__ = ["Component", "Registry", "default_registry", "load_registry"]


@dataclasses.dataclass(frozen=True, slots=True)
class Component:
    """One registered implementation of a contract."""

    kind: str
    name: str
    factory: Callable[..., Any]
    options_type: type
    distribution: str
    """'name version' of the distribution whose plugin registered it."""


class Registry:
    """Components by kind and name. Implements the ``ComponentRegistry`` protocol."""

    def __init__(self, hook: Any = None) -> None:
        self._components: dict[str, dict[str, Component]] = {k: {} for k in COMPONENT_KINDS}
        self._source = "(registered directly)"
        self.hook = hook
        """The plugin manager's hook relay, for event hooks (None when built by hand)."""

    def add(self, kind: str, name: str, factory: Any, *, options: type | None = None) -> None:
        """Register ``factory`` as ``name`` of ``kind``; see ``ComponentRegistry.add``."""
        if kind not in self._components:
            raise ValueError(
                f"cannot register {name!r}: unknown component kind {kind!r}; "
                f"kinds are {', '.join(sorted(self._components))}"
            )
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"component names must be non-empty strings, got {name!r}")
        if not callable(factory):
            raise TypeError(f"{kind} {name!r}: factory {factory!r} is not callable")
        options_type = NoOptions if options is None else options
        _check_options_type(kind, name, options_type)
        existing = self._components[kind].get(name)
        if existing is not None:
            raise DuplicateComponentError(
                f"{kind} {name!r} is registered twice: by {existing.distribution} and by "
                f"{self._source}; uninstall one of them or rename the component"
            )
        self._components[kind][name] = Component(kind, name, factory, options_type, self._source)

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
