"""Pluggy hook specifications: the way plugins reach Brigade.

Every distribution that ships Brigade components declares an entry point in the group
``brigade`` pointing at a module (or object) with ``@hookimpl``-decorated functions::

    [project.entry-points.brigade]
    my_scheduler = "my_package.plugin"

    # my_package/plugin.py
    from brigade.interfaces import hookimpl

    @hookimpl
    def brigade_register(registry):
        registry.add(
            "scheduler", "shortest-first", ShortestFirst,
            options=ShortestFirstOptions, api_version="1.0",
        )

Brigade's own built-ins are registered through the same entry point group.
Event hooks are observers (1:N); none is called on the per-token hot path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import pluggy

if TYPE_CHECKING:
    from brigade.interfaces.request import Request

__all__ = ["PROJECT_NAME", "BrigadeHookSpec", "ComponentRegistry", "hookimpl", "hookspec"]

PROJECT_NAME = "brigade"
"""Pluggy project name and entry point group."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class ComponentRegistry(Protocol):
    """What ``brigade_register`` receives: the one place components are added."""

    def add(
        self,
        kind: str,
        name: str,
        factory: Any,
        *,
        options: type | None = None,
        api_version: str | None = None,
    ) -> None:
        """Register ``factory`` (a class or callable) as component ``name`` of ``kind``.

        ``kind`` is one of ``brigade.interfaces.COMPONENT_KINDS``. ``options`` is a dataclass
        whose fields all have defaults (see :func:`brigade.interfaces.option`); the config
        loader validates the user's table against it and passes an instance to the factory.
        A name already registered for that kind raises ``DuplicateComponentError``.

        ``api_version`` ("MAJOR.MINOR") is the ``brigade.interfaces.API_VERSION`` the component
        was built for; None declares nothing and is always accepted. A different MAJOR, or a
        MINOR newer than the running Brigade's, raises ``IncompatiblePluginError``.
        """
        ...


class BrigadeHookSpec:
    """The hooks a plugin may implement."""

    @hookspec
    def brigade_register(self, registry: ComponentRegistry) -> None:
        """Add this distribution's components to ``registry``.

        Called once per registry, in every process that assembles an engine. Must only call
        ``registry.add``; heavy work (loading weights, compiling kernels) belongs in the
        factories, which run when a config selects the component.
        """

    @hookspec
    def brigade_engine_started(self, components: dict[str, str]) -> None:
        """Observe an engine start; ``components`` maps each station to its plugin name."""

    @hookspec
    def brigade_request_finished(self, request: Request) -> None:
        """Observe a finished request (metrics exporters, audit logs).

        Called once per request after it leaves the engine (finished, aborted or failed), off
        the step's hot path. The request must not be mutated. An implementation that raises
        is logged with its plugin's name; the request, the other implementations and the
        engine go on as if it had not.
        """
