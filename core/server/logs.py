"""Structured logging for the server, through structlog.

One JSON object per line when the output is not a terminal (what log collectors want), a
coloured console line on a terminal. Context bound with
``structlog.contextvars.bound_contextvars(request_id=...)`` is merged into every event logged
inside it, so the server binds the request id once per request and every line carries it.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO, cast

import structlog
from structlog.processors import ExceptionRenderer
from structlog.tracebacks import ExceptionDictTransformer
from structlog.typing import EventDict, FilteringBoundLogger, Processor

__all__ = ["LEVELS", "configure_logging", "get_logger", "log_request_finished"]

LEVELS = ("debug", "info", "warning", "error", "critical")
"""Accepted values of ``configure_logging(level=...)``."""

_SECONDS_DIGITS = 4
"""Seconds are logged to 0.1 ms: finer digits are noise in a request log."""


def configure_logging(
    *, json_output: bool | None = None, level: str = "info", stream: TextIO | None = None
) -> None:
    """Configure structlog for the process.

    ``json_output=None`` picks JSON lines unless ``stream`` (default ``sys.stderr``) is a
    terminal; ``True``/``False`` force one or the other. ``level`` is one of :data:`LEVELS`
    (case-insensitive). Calling it again replaces the previous configuration, including for
    loggers already obtained from :func:`get_logger` (they are not cached on first use), so it
    is safe to call twice.
    """
    if level.lower() not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; expected one of {', '.join(LEVELS)}")
    level_number = logging.getLevelNamesMapping()[level.upper()]
    output = sys.stderr if stream is None else stream
    if json_output is None:
        json_output = not _is_terminal(output)
    processors: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        _add_logger_name,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    # Tracebacks never show local variables: they hold prompts, completions and API keys.
    if json_output:
        tracebacks = ExceptionDictTransformer(show_locals=False)
        processors += [ExceptionRenderer(tracebacks), structlog.processors.JSONRenderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer(exception_formatter=_console_traceback()))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level_number),
        logger_factory=_NamedPrintLoggerFactory(output),
        # Not cached: a reconfiguration (tests, the CLI after reading its config) must reach
        # loggers created at import time. The cost is one bind per log call, and the server logs
        # per request, not per token.
        cache_logger_on_first_use=False,
    )


def get_logger(name: str = "brigade") -> FilteringBoundLogger:
    """A logger whose events carry ``logger=name``."""
    # The name travels as a logger-factory argument, not as bound context, so that the proxy
    # stays lazy and follows a later configure_logging.
    return cast(FilteringBoundLogger, structlog.get_logger(name))


def log_request_finished(
    logger: FilteringBoundLogger,
    *,
    request_id: str,
    prompt_tokens: int,
    output_tokens: int,
    ttft_s: float | None,
    duration_s: float,
    finish_reason: str,
) -> None:
    """Emit the one ``request_finished`` event of a request.

    ``ttft_s`` is None for a request that ended before its first token (an early abort).
    """
    logger.info(
        "request_finished",
        request_id=request_id,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        ttft_s=None if ttft_s is None else round(ttft_s, _SECONDS_DIGITS),
        duration_s=round(duration_s, _SECONDS_DIGITS),
        finish_reason=finish_reason,
    )


class _NamedPrintLogger(structlog.PrintLogger):
    def __init__(self, file: TextIO, name: str | None) -> None:
        super().__init__(file)
        self.name = name
        self._stream = file

    def msg(self, message: str) -> None:
        """One write per line: the server's processes share one stream, and ``print`` writes
        the newline apart (unbuffered, as under PYTHONUNBUFFERED, two processes' lines would
        run together)."""
        with self._lock:
            self._stream.write(message + "\n")
            self._stream.flush()

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


class _NamedPrintLoggerFactory:
    """Print loggers on one stream, named after ``structlog.get_logger``'s first argument."""

    def __init__(self, file: TextIO) -> None:
        self._file = file

    def __call__(self, *args: object) -> _NamedPrintLogger:
        return _NamedPrintLogger(self._file, str(args[0]) if args else None)


def _add_logger_name(logger: object, method_name: str, event_dict: EventDict) -> EventDict:
    name = getattr(logger, "name", None)
    if name is not None:
        event_dict.setdefault("logger", name)
    return event_dict


def _console_traceback() -> structlog.typing.ExceptionRenderer:
    if structlog.dev.rich is None:
        return structlog.dev.plain_traceback
    return structlog.dev.RichTracebackFormatter(show_locals=False)


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())
