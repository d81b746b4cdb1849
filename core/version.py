"""The installed Brigade's version (the ``brigade-llm`` distribution's)."""

from __future__ import annotations

import importlib.metadata

__all__ = ["DISTRIBUTION", "installed_version"]

DISTRIBUTION = "brigade-llm"


def installed_version() -> str:
    """The version pip installed, or ``"unknown"`` when running from an uninstalled tree."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
