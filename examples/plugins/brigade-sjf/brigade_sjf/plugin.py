"""The entry point Brigade loads (``[project.entry-points.brigade]`` in pyproject.toml)."""

from __future__ import annotations

from brigade.interfaces import ComponentRegistry, hookimpl

from brigade_sjf.scheduler import SjfOptions, SjfPolicy

API_VERSION = "2.0"
"""The ``brigade.interfaces.API_VERSION`` this plugin was written against."""


@hookimpl
def brigade_register(registry: ComponentRegistry) -> None:
    """Register the ``sjf`` scheduler; select it with ``[scheduler] plugin = "sjf"``."""
    registry.add("scheduler", "sjf", SjfPolicy, options=SjfOptions, api_version=API_VERSION)
