"""Errors the API answers with: an HTTP status and OpenAI's error body.

Every error is ``{"error": {"message", "type", "param", "code"}}``, the shape the official
``openai`` client turns into its ``APIStatusError`` subclasses (chosen by status code).
"""

from __future__ import annotations

import math
import re
from typing import Literal

import msgspec

from brigade.errors import BrigadeError, EngineDeadError, RequestError, RequestFailedError

__all__ = [
    "APIError",
    "AuthenticationError",
    "EngineOverloadedError",
    "EngineUnavailableError",
    "ErrorDetail",
    "ErrorResponse",
    "InternalServerError",
    "NotFoundError",
    "ProtocolError",
    "RateLimitError",
    "RequestTimeoutError",
    "RequestTooLargeError",
    "ServerOverloadedError",
    "api_error",
]

_AT_PATH = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
"""msgspec's validation messages end with the field's path: "... - at `$.messages[0].role`"."""
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")


class ErrorDetail(msgspec.Struct):
    """The inside of an OpenAI error body; ``param`` names the offending request field."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    """OpenAI's error body: ``{"error": {...}}``."""

    error: ErrorDetail


class APIError(BrigadeError):
    """An error answered to the client with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,  # noqa: A002 - the OpenAI field is called "type"
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_response(self) -> ErrorResponse:
        """The error body as a struct (for handlers that return structs)."""
        return ErrorResponse(ErrorDetail(self.message, self.type, self.param, self.code))

    def to_body(self) -> bytes:
        """The error body as JSON bytes."""
        return msgspec.json.encode(self.to_response())

    def headers(self) -> dict[str, str]:
        """Extra HTTP headers the response must carry (e.g. ``Retry-After``)."""
        return {}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(status={self.status}, message={self.message!r}, "
            f"param={self.param!r}, code={self.code!r})"
        )


class ProtocolError(APIError):
    """400: the request is malformed, has a wrong type or value, or asks for what we lack."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(400, message, type="invalid_request_error", param=param, code=code)

    @classmethod
    def from_decode_error(cls, exc: msgspec.DecodeError) -> ProtocolError:
        """Translate msgspec's error; ``param`` is the offending field's path, taken from
        messages such as "Expected `int`, got `str` - at `$.messages[0].role`"."""
        if not isinstance(exc, msgspec.ValidationError):
            return cls(f"request body is not valid JSON: {exc}.")
        match = _AT_PATH.match(str(exc))
        what = match["what"] if match else str(exc)
        # "$.logit_bias[...]": msgspec writes a mapping's key as "[...]"
        path = (match["path"] or "").removeprefix(".").replace("[...]", "") if match else ""
        missing = _MISSING_FIELD.match(what)
        if missing:
            param = f"{path}.{missing['field']}" if path else missing["field"]
            return cls(f"missing required field '{param}'.", param=param)
        what = what[:1].lower() + what[1:]
        if not path:
            return cls(f"invalid request body: {what}.")
        return cls(f"invalid '{path}': {what}.", param=path)


class AuthenticationError(APIError):
    """401: the API key is missing or not one of the configured keys."""

    def __init__(self, message: str = "Missing or invalid API key.") -> None:
        super().__init__(401, message, type="authentication_error", code="invalid_api_key")

    def headers(self) -> dict[str, str]:
        """RFC 6750: tell the client which scheme to use."""
        return {"WWW-Authenticate": "Bearer"}


class NotFoundError(APIError):
    """404: the request names a model this server does not serve."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = "model",
        code: str | None = "model_not_found",
    ) -> None:
        super().__init__(404, message, type="invalid_request_error", param=param, code=code)


class RequestTooLargeError(APIError):
    """413: the request body is larger than ``[server] max_request_bytes``."""

    def __init__(self, size: int | None, limit: int) -> None:
        got = "" if size is None else f" ({size} bytes)"
        super().__init__(
            413,
            f"Request body too large{got}: this server accepts at most {limit} bytes.",
            type="invalid_request_error",
            code="request_too_large",
        )


class RateLimitError(APIError):
    """429: an API key went over its requests- or tokens-per-minute limit.

    ``type`` is the limit that was hit ("requests" or "tokens"), as OpenAI reports it;
    ``retry_after`` is whole seconds (rounded up) for the ``Retry-After`` header.
    """

    def __init__(
        self, message: str, *, retry_after: float, limit: Literal["requests", "tokens"]
    ) -> None:
        super().__init__(429, message, type=limit, code="rate_limit_exceeded")
        self.retry_after = max(1, math.ceil(retry_after))

    def headers(self) -> dict[str, str]:
        """``Retry-After`` in whole seconds."""
        return {"Retry-After": str(self.retry_after)}


class RequestTimeoutError(APIError):
    """408: the request body did not arrive within ``[server] body_timeout_s``."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            408,
            f"The request body did not arrive within {timeout_s:g} s.",
            type="invalid_request_error",
            code="request_timeout",
        )


class ServerOverloadedError(APIError):
    """503: nothing was queued; the waiting queue is full, the server is shutting down, or
    its engine has failed (``code`` "engine_unavailable"; the server is restarting)."""

    def __init__(
        self,
        message: str = "The server is overloaded (waiting queue full); please retry later.",
        *,
        retry_after: float | None = None,
        code: str = "server_overloaded",
    ) -> None:
        super().__init__(503, message, type="server_error", code=code)
        self.retry_after = None if retry_after is None else max(1, math.ceil(retry_after))

    def headers(self) -> dict[str, str]:
        """``Retry-After`` when a wait was given."""
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


class InternalServerError(APIError):
    """500: a bug or an engine failure; the message must not leak internals."""

    def __init__(self, message: str = "Internal server error.") -> None:
        super().__init__(500, message, type="server_error", code="internal_error")


class EngineOverloadedError(BrigadeError):
    """The bounded waiting queue is full (or the server is stopping); nothing was queued."""


class EngineUnavailableError(EngineOverloadedError):
    """The engine has died; nothing was queued and the server is about to exit."""


def api_error(exc: BaseException) -> APIError | None:
    """The error a client gets for ``exc``; None for an exception nobody expected (the
    caller logs it and answers a bare 500, never its text)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return ProtocolError(str(exc), param=exc.param)
    if isinstance(exc, RequestFailedError):
        return InternalServerError(_sentence(str(exc)))
    if isinstance(exc, EngineDeadError):
        return InternalServerError(_sentence(f"{exc}; the server is restarting"))
    if isinstance(exc, EngineUnavailableError):
        return ServerOverloadedError(_sentence(str(exc)), code="engine_unavailable")
    if isinstance(exc, EngineOverloadedError):
        return ServerOverloadedError(_sentence(str(exc)))
    return None


def _sentence(text: str) -> str:
    text = text[:1].upper() + text[1:]
    return text if text.endswith(".") else text + "."
