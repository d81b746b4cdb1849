"""The entry point Brigade loads (``[project.entry-points.brigade]`` in pyproject.toml)."""

from __future__ import annotations

from brigade.interfaces import ComponentRegistry, hookimpl

from brigade_sjf.scheduler import SjfOptions, SjfScheduler

API_VERSION = "1.0"
"""The ``brigade.interfaces.API_VERSION`` this plugin was written against."""


@hookimpl
def brigade_register(registry: ComponentRegistry) -> None:
    """Register the ``sjf`` scheduler; select it with ``[scheduler] plugin = "sjf"``."""
    registry.add("scheduler", "sjf", SjfScheduler, options=SjfOptions, api_version=API_VERSION)
