"""Structured logs: JSON lines off a terminal, request ids from context, one finish event."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import structlog

from brigade.server.logs import configure_logging, get_logger, log_request_finished


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_request_finished_is_one_json_line_with_the_bound_request_id() -> None:
    stream = io.StringIO()
    configure_logging(stream=stream)  # a StringIO is not a terminal: JSON
    logger = get_logger()
    with structlog.contextvars.bound_contextvars(request_id="chatcmpl-42"):
        log_request_finished(
            logger,
            request_id="chatcmpl-42",
            prompt_tokens=12,
            output_tokens=30,
            ttft_s=0.0123456,
            duration_s=1.23456789,
            finish_reason="length",
        )
    [event] = lines(stream)
    assert event["event"] == "request_finished"
    assert event["request_id"] == "chatcmpl-42"
    assert event["prompt_tokens"] == 12
    assert event["output_tokens"] == 30
    assert event["ttft_s"] == 0.0123
    assert event["duration_s"] == 1.2346
    assert event["finish_reason"] == "length"
    assert event["level"] == "info"
    assert event["logger"] == "brigade"
    assert datetime.fromisoformat(event["timestamp"]).tzinfo is not None  # ISO 8601, UTC


def test_context_binds_the_request_id_to_every_event_inside_it_only() -> None:
    stream = io.StringIO()
    configure_logging(json_output=True, stream=stream)
    logger = get_logger("brigade.server")
    with structlog.contextvars.bound_contextvars(request_id="cmpl-7"):
        logger.info("tokenized", num_tokens=5)
    logger.info("idle")
    inside, outside = lines(stream)
    assert inside["request_id"] == "cmpl-7"
    assert inside["logger"] == "brigade.server"
    assert "request_id" not in outside


def test_request_aborted_before_its_first_token_logs_no_ttft() -> None:
    stream = io.StringIO()
    configure_logging(json_output=True, stream=stream)
    log_request_finished(
        get_logger(),
        request_id="r",
        prompt_tokens=3,
        output_tokens=0,
        ttft_s=None,
        duration_s=0.5,
        finish_reason="abort",
    )
    [event] = lines(stream)
    assert event["ttft_s"] is None
    assert event["finish_reason"] == "abort"


def test_configuring_twice_is_safe_and_the_latest_call_wins() -> None:
    first, second = io.StringIO(), io.StringIO()
    logger = get_logger()  # obtained before configuration, as module-level loggers are
    configure_logging(json_output=True, stream=first)
    configure_logging(json_output=True, stream=second)
    logger.info("hello")
    assert first.getvalue() == ""
    [event] = lines(second)
    assert event["event"] == "hello"


def test_a_terminal_gets_console_lines_not_json() -> None:
    terminal = FakeTerminal()
    configure_logging(stream=terminal)
    get_logger().info("request_finished", request_id="abc")
    text = terminal.getvalue()
    assert "request_finished" in text
    assert "abc" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])


def test_level_filters_and_unknown_levels_are_refused() -> None:
    stream = io.StringIO()
    configure_logging(json_output=True, level="WARNING", stream=stream)
    logger = get_logger()
    logger.info("dropped")
    logger.warning("kept")
    assert [event["event"] for event in lines(stream)] == ["kept"]
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        configure_logging(level="loud")


def test_tracebacks_do_not_leak_local_variables() -> None:
    stream = io.StringIO()
    configure_logging(json_output=True, stream=stream)
    api_key = "sk-secret-123"
    try:
        raise RuntimeError("engine died")
    except RuntimeError:
        get_logger().exception("step_failed")
    assert api_key not in stream.getvalue()
    [event] = lines(stream)
    assert event["exception"][0]["exc_value"] == "engine died"
