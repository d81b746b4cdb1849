"""Errors a plugin raises for what a user caused: each says what was wrong and what is allowed.

Core raises them too and re-exports them from ``brigade.errors`` (the same classes, so
``except brigade.errors.ConfigError`` catches a plugin's ``brigade.interfaces.ConfigError``).
"""

from __future__ import annotations

__all__ = ["BrigadeError", "ConfigError", "ModelLoadError", "RequestError"]


class BrigadeError(Exception):
    """Base class of every error Brigade raises on purpose."""


class ConfigError(BrigadeError, ValueError):
    """A config file, table, key or value is not allowed (a plugin raises it for its own
    options, naming the key and what is allowed)."""


class ModelLoadError(BrigadeError, ValueError):
    """A model directory is missing, incomplete, corrupt or of an unsupported architecture."""


class RequestError(BrigadeError, ValueError):
    """A request the engine cannot serve (bad prompt, parameters out of range, too long).

    ``param`` names the request field at fault (``prompt``, ``temperature``, ...) when one is.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
