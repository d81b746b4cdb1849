"""What the HTTP handlers share: the engine, the frontend, the settings, the limiter."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from litestar import Response

from brigade.server.frontend import Frontend
from brigade.server.health import FrontendRoster
from brigade.server.metrics import ServerMetrics
from brigade.server.ratelimit import RateLimiter
from brigade.server.request_streams import RequestStreams
from brigade.stations import ServerSettings

__all__ = ["JSON", "TOKENIZER_THREADS", "ServerState", "json_response"]

JSON = "application/json"
TOKENIZER_THREADS = 2
"""Threads that tokenize and render chat templates, off the event loop."""
T = TypeVar("T")


def _tokenizer_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(
        TOKENIZER_THREADS, thread_name_prefix="brigade-tokenize"
    )


@dataclasses.dataclass(slots=True)
class ServerState:
    """Everything the handlers share."""

    async_engine: RequestStreams
    """The engine: on a thread of this process (``AsyncEngine``) or in its own process
    (``EngineClient``); its ``info`` is what the handlers know about it."""
    frontend: Frontend
    tokenizer: Any
    settings: ServerSettings
    model_name: str
    metrics: ServerMetrics
    limiter: RateLimiter
    frontends: FrontendRoster = dataclasses.field(default_factory=FrontendRoster)
    """The server's front-end processes (this one alone unless ``api_server_count`` > 1)."""
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False
    blocking: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=_tokenizer_pool
    )
    """Where tokenization and chat templating run, so a long prompt never stalls the loop."""

    @property
    def max_model_len(self) -> int:
        return self.async_engine.info.max_model_len

    async def run_blocking(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` on the tokenizer threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.blocking, functools.partial(function, *args))


def json_response(payload: Any, status: int = 200) -> Response[Any]:
    """``payload`` encoded by msgspec as a JSON response."""
    return Response(msgspec.json.encode(payload), status_code=status, media_type=JSON)
