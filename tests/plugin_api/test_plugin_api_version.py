"""Plugin API versioning: a plugin built for an API this Brigade lacks is refused at load."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from plugin_fakes import install_fake_plugin

from brigade.errors import IncompatiblePluginError
from brigade.interfaces import API_VERSION
from brigade.registry import Registry, load_registry

MAJOR, MINOR = (int(part) for part in API_VERSION.split("."))


def shortest_first(*args: object) -> tuple[object, ...]:
    """A factory that accepts any kind's arguments (these tests never build it)."""
    return args


def register_for(version: str | None) -> Callable[[Any], None]:
    return lambda registry: registry.add(
        "scheduler", "versioned", shortest_first, api_version=version
    )


def test_api_version_is_major_dot_minor() -> None:
    assert re.fullmatch(r"\d+\.\d+", API_VERSION), API_VERSION


@pytest.mark.parametrize(
    "version", [None, API_VERSION, f"{MAJOR}.0"] + ([f"{MAJOR}.{MINOR - 1}"] if MINOR else [])
)
def test_compatible_or_undeclared_versions_load(
    monkeypatch: pytest.MonkeyPatch, version: str | None
) -> None:
    install_fake_plugin(monkeypatch, "brigade-versioned", register_for(version))
    component = load_registry().get("scheduler", "versioned")
    assert component.factory is shortest_first
    assert component.api_version == version


@pytest.mark.parametrize(
    ("version", "advice"),
    [
        (f"{MAJOR + 1}.0", f"built for API {MAJOR}.x"),
        (f"{MAJOR}.{MINOR + 1}", "upgrade Brigade"),
        *([(f"{MAJOR - 1}.9", f"built for API {MAJOR}.x")] if MAJOR else []),
    ],
)
def test_incompatible_version_is_refused_naming_plugin_distribution_and_versions(
    monkeypatch: pytest.MonkeyPatch, version: str, advice: str
) -> None:
    install_fake_plugin(monkeypatch, "brigade-versioned", register_for(version))
    with pytest.raises(IncompatiblePluginError) as excinfo:
        load_registry()
    message = str(excinfo.value)
    assert "scheduler plugin 'versioned'" in message
    assert "brigade-versioned 1.2.3" in message
    assert f"needs Brigade plugin API {version}" in message
    assert f"provides API {API_VERSION}" in message
    assert advice in message


@pytest.mark.parametrize("version", ["1", "1.0.0", "v1.0", "", "one.zero"])
def test_malformed_version_is_a_registration_error(version: str) -> None:
    with pytest.raises(ValueError, match=r"api_version must be 'MAJOR\.MINOR'"):
        Registry().add("scheduler", "versioned", shortest_first, api_version=version)


def test_builtins_load_under_the_current_version() -> None:
    assert "fcfs" in load_registry().names("scheduler")


def test_a_1x_plugin_is_refused_with_a_pointer_to_the_migration_guide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert MAJOR >= 2
    install_fake_plugin(monkeypatch, "brigade-versioned", register_for("1.3"))
    with pytest.raises(IncompatiblePluginError) as excinfo:
        load_registry()
    message = str(excinfo.value)
    assert "needs Brigade plugin API 1.3" in message
    assert 'docs/plugins.md, "Migrating a 1.x plugin to 2.0"' in message
    guide = (Path(__file__).parents[2] / "docs" / "plugins.md").read_text(encoding="utf-8")
    assert "\n## Migrating a 1.x plugin to 2.0\n" in guide
