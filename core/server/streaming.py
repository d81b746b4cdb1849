"""Turning a request's choice deltas into OpenAI responses: collected or as SSE events."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

import structlog

from brigade.engine import TokenLogprob
from brigade.output import ChoiceDelta
from brigade.server import responses as out
from brigade.server.errors import (
    APIError,
    InternalServerError,
    ServerOverloadedError,
    api_error,
)
from brigade.server.tools import ToolCallStream, tool_call_dicts

__all__ = [
    "Collected",
    "chat_events",
    "client_error",
    "collect",
    "completion_events",
    "delta_failure",
    "error_event",
    "merge",
    "prepend",
]


@dataclasses.dataclass(slots=True)
class Collected:
    """One choice's whole output (fits ``responses.ChoiceOutput``)."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob | None] | None = None
    num_tokens: int = 0
    error: APIError | None = None
    """Why the choice failed (``finish_reason`` "error")."""


async def collect(
    deltas: AsyncGenerator[ChoiceDelta, None], *, want_logprobs: bool
) -> list[Collected]:
    """Drain ``deltas`` into one :class:`Collected` per choice, ordered by index."""
    choices: dict[int, Collected] = {}
    async for delta in deltas:
        choice = choices.setdefault(delta.index, Collected(delta.index))
        choice.text += delta.text
        choice.num_tokens += len(delta.token_ids)
        if want_logprobs:
            choice.logprobs = (choice.logprobs or []) + list(delta.logprobs or [])
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
        if delta.error is not None:
            choice.error = client_error(delta.error)
    return [choices[i] for i in sorted(choices)]


def error_event(error: APIError) -> bytes:
    """The SSE event that tells a streaming client why its request failed (OpenAI's shape,
    which the ``openai`` client raises as an ``APIError``)."""
    return b"data: " + error.to_body() + b"\n\n"


def delta_failure(delta: ChoiceDelta) -> APIError | None:
    """What a stream must tell its client after ``delta``: why its choice failed, or that
    the server stopped it (finish reason "abort": the shutdown timeout ended it, the only
    abort a client still reading can see); None when it goes on or ended normally."""
    if delta.error is not None:
        return client_error(delta.error)
    if delta.finish_reason == "abort":
        return ServerOverloadedError(
            "The server is shutting down: it stopped this request before it finished; retry it."
        )
    return None


def client_error(exc: BaseException) -> APIError:
    """The error a streaming client is told for ``exc``; one nobody expected is logged with
    its traceback and told as a bare 500."""
    error = api_error(exc)
    if error is None:
        structlog.get_logger("brigade.server").error(
            "stream_failed", error=type(exc).__name__, exc_info=exc
        )
        return InternalServerError()
    return error


async def chat_events(
    deltas: AsyncGenerator[ChoiceDelta, None],
    *,
    response_id: str,
    model: str,
    created: int,
    tokenizer: Any,
    prompt_tokens: int,
    want_logprobs: bool,
    include_usage: bool,
    tool_calls: bool = False,
) -> AsyncGenerator[bytes, None]:
    """SSE events of a streamed chat completion, ending with ``data: [DONE]``.

    With ``tool_calls``, text is streamed as content until a ``<tool_call>`` opens; each call
    is sent as one ``tool_calls`` delta once it is complete, and a choice that made calls
    finishes with ``tool_calls``. A failure ends the stream with an error event (OpenAI's
    error body) before ``[DONE]``: at once when the request as a whole failed, after the
    other choices when one choice failed (its last chunk has ``finish_reason`` "error") or
    the server stopped it (``finish_reason`` "abort": :func:`delta_failure`).
    """
    started: set[int] = set()
    parsers: dict[int, ToolCallStream] = {}
    completion_tokens = 0
    failure: APIError | None = None
    try:
        async with aclosing(deltas):
            async for delta in deltas:
                if failure is None:
                    failure = delta_failure(delta)
                role = None if delta.index in started else "assistant"
                started.add(delta.index)
                completion_tokens += len(delta.token_ids)
                logprobs = None
                if want_logprobs and delta.logprobs:
                    logprobs = out.chat_logprobs(delta.logprobs, tokenizer)
                if tool_calls:
                    content, calls, finish_reason = _split_tool_calls(parsers, delta)
                else:
                    content, calls, finish_reason = delta.text, None, delta.finish_reason
                chunk = out.chat_chunk(
                    response_id,
                    model,
                    created,
                    index=delta.index,
                    role=role,
                    content=content,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    tool_calls=calls,
                )
                yield out.sse_event(chunk)
    except Exception as exc:  # the request as a whole failed (the engine died, ...)
        failure = client_error(exc)
    if include_usage:
        usage = out.usage(prompt_tokens, completion_tokens)
        yield out.sse_event(out.chat_usage_chunk(response_id, model, created, usage))
    if failure is not None:
        yield error_event(failure)
    yield out.SSE_DONE


def _split_tool_calls(
    parsers: dict[int, ToolCallStream], delta: ChoiceDelta
) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
    """A tool-calling choice's delta as its content (None when it only completes calls), the
    calls it completes, and its finish reason ("tool_calls" for a choice that made calls);
    ``parsers`` holds each choice's parser, made on its first delta."""
    parser = parsers.setdefault(delta.index, ToolCallStream())
    finish_reason = delta.finish_reason
    first = parser.num_calls
    content, parsed = parser.feed(delta.text, final=finish_reason is not None)
    calls = tool_call_dicts(parsed, first_index=first) or None
    if finish_reason == "stop" and parser.num_calls:
        finish_reason = "tool_calls"
    return (None if calls and not content else content), calls, finish_reason


async def completion_events(
    deltas: AsyncGenerator[ChoiceDelta, None],
    *,
    response_id: str,
    model: str,
    created: int,
    tokenizer: Any,
    prompt_tokens: int,
    want_logprobs: bool,
    include_usage: bool,
) -> AsyncGenerator[bytes, None]:
    """SSE events of a streamed text completion, ending with ``data: [DONE]`` (failures as
    in :func:`chat_events`)."""
    offsets: dict[int, int] = {}
    completion_tokens = 0
    failure: APIError | None = None
    try:
        async with aclosing(deltas):
            async for delta in deltas:
                if failure is None:
                    failure = delta_failure(delta)
                completion_tokens += len(delta.token_ids)
                logprobs = None
                if want_logprobs and delta.logprobs:
                    start = offsets.get(delta.index, 0)
                    logprobs = out.completion_logprobs(delta.logprobs, tokenizer, start)
                offsets[delta.index] = offsets.get(delta.index, 0) + len(delta.text)
                chunk = out.completion_chunk(
                    response_id,
                    model,
                    created,
                    index=delta.index,
                    text=delta.text,
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                )
                yield out.sse_event(chunk)
    except Exception as exc:  # the request as a whole failed (the engine died, ...)
        failure = client_error(exc)
    if include_usage:
        usage = out.usage(prompt_tokens, completion_tokens)
        yield out.sse_event(out.completion_usage_chunk(response_id, model, created, usage))
    if failure is not None:
        yield error_event(failure)
    yield out.SSE_DONE


async def prepend(
    first: Sequence[ChoiceDelta], rest: AsyncGenerator[ChoiceDelta, None]
) -> AsyncGenerator[ChoiceDelta, None]:
    """The deltas of ``first`` followed by ``rest`` (closing ``rest`` when closed early)."""
    async with aclosing(rest):
        for delta in first:
            yield delta
        async for delta in rest:
            yield delta


async def merge(
    streams: Sequence[AsyncGenerator[ChoiceDelta, None]],
) -> AsyncGenerator[ChoiceDelta, None]:
    """Interleave several delta streams as items arrive; closing it closes them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]):
            async for delta in streams[0]:
                yield delta
        return
    queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[ChoiceDelta, None]) -> None:
        try:
            async with aclosing(stream):
                async for delta in stream:
                    queue.put_nowait(delta)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            queue.put_nowait(exc)
            return
        queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
