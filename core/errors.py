"""Errors a user can cause: each says what was wrong and what is allowed."""

from __future__ import annotations

__all__ = [
    "BrigadeError",
    "ConfigError",
    "DuplicateComponentError",
    "EngineDeadError",
    "IncompatiblePluginError",
    "ModelLoadError",
    "RequestError",
    "RequestFailedError",
    "UnknownComponentError",
]


class BrigadeError(Exception):
    """Base class of every error Brigade raises on purpose."""


class ConfigError(BrigadeError, ValueError):
    """A config file, table, key or value is not allowed."""


class DuplicateComponentError(BrigadeError):
    """Two plugins registered the same name for the same kind."""


class IncompatiblePluginError(BrigadeError):
    """A plugin was built for a plugin API version this Brigade does not provide."""


class UnknownComponentError(BrigadeError, KeyError):
    """A config names a component that no installed plugin registered."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class RequestError(BrigadeError, ValueError):
    """A request the engine cannot serve (bad prompt, parameters out of range, too long).

    ``param`` names the request field at fault (``prompt``, ``temperature``, ...) when one is.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestFailedError(BrigadeError):
    """A request the engine accepted failed on its own: a plugin raised for it, or its
    sampling was undefined. The message names the cause; other requests were not affected."""


class EngineDeadError(BrigadeError):
    """The engine can no longer run steps (a failure no single request explains, twice in a
    row); every request in it has failed. The server exits so that a supervisor restarts it."""


class ModelLoadError(BrigadeError, ValueError):
    """A model directory is missing, incomplete, corrupt or of an unsupported architecture."""
