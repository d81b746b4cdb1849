"""Helpers that make fake third-party plugin distributions visible to pluggy."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest


class FakeDistribution:
    """Just enough of ``importlib.metadata.Distribution`` for pluggy's entry point loading."""

    def __init__(self, name: str, version: str, entry_points: list[importlib.metadata.EntryPoint]):
        self.metadata = {"name": name}
        self.version = version
        self.entry_points = entry_points


def install_fake_plugin(
    monkeypatch: pytest.MonkeyPatch,
    dist_name: str,
    register: Callable[[Any], None],
    *,
    entry_point_name: str | None = None,
) -> None:
    """Make ``register`` discoverable as distribution ``dist_name``'s ``brigade`` entry point."""
    from brigade.interfaces import hookimpl

    module_name = f"fake_brigade_plugin_{dist_name.replace('-', '_')}"
    module = types.ModuleType(module_name)

    @hookimpl
    def brigade_register(registry: Any) -> None:
        register(registry)

    module.brigade_register = brigade_register  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module_name, module)
    entry_point = importlib.metadata.EntryPoint(
        name=entry_point_name or dist_name, value=module_name, group="brigade"
    )
    fake = FakeDistribution(dist_name, "1.2.3", [entry_point])
    real = importlib.metadata.distributions
    current = list(real())

    def distributions(**kwargs: Any) -> list[Any]:
        return [*current, fake] if not kwargs else list(real(**kwargs))

    monkeypatch.setattr(importlib.metadata, "distributions", distributions)
