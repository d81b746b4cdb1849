"""What a request passes before the engine sees it: its API key, its body (size and time),
its rate limit, the context window and the waiting queue.

Each check raises the ``APIError`` the client gets, so the handlers read as a list of checks.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Sequence
from typing import Any, Literal, TypeVar

from litestar import Request

from brigade.interfaces import SamplingParams
from brigade.server.errors import (
    AuthenticationError,
    ProtocolError,
    RateLimitError,
    RequestTimeoutError,
    RequestTooLargeError,
)
from brigade.server.ratelimit import RateLimiter
from brigade.stations import ServerSettings

__all__ = [
    "ClientDisconnectedError",
    "authenticate",
    "charge_rate_limit",
    "check_batch_size",
    "check_context",
    "read_body",
    "unless_disconnected",
]

T = TypeVar("T")

CLIENT_KEY = "brigade_client"
"""``request.state`` entry: who the rate limiter charges (set by :func:`authenticate`)."""


class ClientDisconnectedError(Exception):
    """The client closed its connection before its answer was ready."""


def authenticate(request: Request[Any, Any, Any], settings: ServerSettings) -> None:
    """Check the API key; remember whom to charge: the configured key presented (whatever
    the spelling of ``Bearer``), or the client's address when no keys are configured.

    Keys are compared as UTF-8 bytes against the header's raw bytes, in constant time and
    against every key, so timing tells neither which key nor which prefix matched. More
    than one ``Authorization`` header is refused rather than guessed between.
    """
    if not settings.api_keys:
        host = request.client.host if request.client else "unknown"
        request.state[CLIENT_KEY] = f"address:{host}"
        return
    headers = request.headers.getall("authorization", [])
    if len(headers) > 1:
        raise AuthenticationError(
            f"Send one Authorization header; this request has {len(headers)}."
        )
    scheme, _, token = (headers[0] if headers else "").strip().partition(" ")
    # The server decodes header bytes as latin-1: encoding back gives the bytes as sent.
    presented = token.strip().encode("latin-1") if scheme.lower() == "bearer" else b""
    matched = None
    for index, key in enumerate(settings.api_keys):
        if hmac.compare_digest(presented, key.encode()):
            matched = index
    # An empty token opens nothing, even beside an empty key: the settings refuse such a
    # key, and this holds where they were bypassed.
    if matched is None or not presented:
        raise AuthenticationError()
    request.state[CLIENT_KEY] = f"key:{matched}"


async def read_body(request: Request[Any, Any, Any], settings: ServerSettings) -> bytes:
    """The body, read chunk by chunk: 413 as soon as it passes ``max_request_bytes`` (with
    or without a Content-Length), 408 when it takes longer than ``body_timeout_s``."""
    limit = settings.max_request_bytes
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(settings.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise RequestTooLargeError(None, limit)
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeoutError(settings.body_timeout_s) from None
    return b"".join(chunks)


def charge_rate_limit(
    request: Request[Any, Any, Any],
    limiter: RateLimiter,
    settings: ServerSettings,
    prompts: Sequence[Sequence[int]],
    budget: int,
) -> None:
    """Charge one request and its tokens (prompts + ``budget`` generated) to its client."""
    if not limiter.enabled:
        return
    key = str(request.state.get(CLIENT_KEY, "unknown"))
    tokens = sum(len(p) for p in prompts) + budget
    retry_after = limiter.acquire(key, tokens)
    if retry_after is not None:
        limit: Literal["requests", "tokens"] = (
            "requests" if settings.requests_per_minute else "tokens"
        )
        raise RateLimitError(
            f"Rate limit reached ({limit} per minute); retry in {retry_after:.0f} s.",
            retry_after=retry_after,
            limit=limit,
        )


def check_context(
    prompt_tokens: int, params: SamplingParams, max_model_len: int, param: str | None
) -> None:
    """400 when an explicit ``max_tokens`` (named ``param``) cannot fit after the prompt;
    None for ``param`` means the server chose it (it stops at the context's end)."""
    if param is None or prompt_tokens + params.max_tokens <= max_model_len:
        return
    room = max(0, max_model_len - prompt_tokens)
    raise ProtocolError(
        f"{param}={params.max_tokens} is too large: the prompt has {prompt_tokens} tokens and "
        f"the context {max_model_len}, so at most {room} can be generated.",
        param=param,
    )


def check_batch_size(num_prompts: int, settings: ServerSettings) -> None:
    """400 for a batch that could never wait in the queue at once (retrying cannot help)."""
    if num_prompts > settings.max_waiting_requests:
        raise ProtocolError(
            f"prompt holds {num_prompts} prompts; this server queues at most "
            f"{settings.max_waiting_requests} at once (max_waiting_requests): send smaller "
            "batches.",
            param="prompt",
        )


async def unless_disconnected(request: Request[Any, Any, Any], work: Awaitable[T]) -> T:
    """Await ``work``; cancel it (which aborts its engine requests) if the client leaves.

    For use once the body is read: the server then only has a disconnect left to report.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself is cancelled (shutdown)
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnectedError()


async def _until_disconnected(request: Request[Any, Any, Any]) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
