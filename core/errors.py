"""Errors a user can cause: each says what was wrong and what is allowed.

The ones plugins raise too (``BrigadeError``, ``ConfigError``, ``ModelLoadError``,
``RequestError``) are defined in ``brigade.interfaces.errors`` and are the same classes here.
"""

from __future__ import annotations

from brigade.interfaces.errors import BrigadeError, ConfigError, ModelLoadError, RequestError

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
    "describe",
]

_MAX_MESSAGE = 300
"""Characters of a plugin's exception message kept in a request's error."""


def describe(exc: BaseException) -> str:
    """``ExceptionType: message`` on one line, shortened: what a request's error names."""
    message = " ".join(str(exc).split())
    if len(message) > _MAX_MESSAGE:
        message = message[: _MAX_MESSAGE - 3] + "..."
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


class DuplicateComponentError(BrigadeError):
    """Two plugins registered the same name for the same kind."""


class IncompatiblePluginError(BrigadeError):
    """A plugin was built for a plugin API version this Brigade does not provide."""


class UnknownComponentError(BrigadeError, KeyError):
    """A config names a component that no installed plugin registered."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class RequestFailedError(BrigadeError):
    """A request the engine accepted failed on its own: a plugin raised for it, or its
    sampling was undefined. The message names the cause; other requests were not affected."""


class EngineDeadError(BrigadeError):
    """The engine can no longer run steps (a failure no single request explains, twice in a
    row); every request in it has failed. The server exits so that a supervisor restarts it."""
