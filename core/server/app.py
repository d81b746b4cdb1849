"""The OpenAI-compatible HTTP API on Litestar."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any, Literal

import msgspec
import structlog
from litestar import Litestar, Request, Response, get, post, route
from litestar.exceptions import HTTPException
from litestar.response import Stream

from brigade.errors import RequestError
from brigade.interfaces import SamplingParams
from brigade.models.tokenizer_loading import render_chat_prompt
from brigade.server import protocol as proto
from brigade.server import responses as out
from brigade.server import streaming
from brigade.server.async_engine import AsyncEngine, EngineOverloadedError
from brigade.server.errors import (
    APIError,
    AuthenticationError,
    InternalServerError,
    NotFoundError,
    ProtocolError,
    RateLimitError,
    RequestTooLargeError,
    ServerOverloadedError,
)
from brigade.server.frontend import ChoiceDelta, Frontend
from brigade.server.metrics import ServerMetrics
from brigade.server.ratelimit import RateLimiter
from brigade.stations import ServerSettings
from brigade.version import installed_version

__all__ = ["ServerState", "create_app"]

OPEN_PATHS = ("/health", "/metrics", "/ping", "/version")
"""Reachable without an API key (probes and scrapers)."""
JSON = "application/json"


@dataclasses.dataclass(slots=True)
class ServerState:
    """Everything the handlers share."""

    async_engine: AsyncEngine
    frontend: Frontend
    tokenizer: Any
    settings: ServerSettings
    model_name: str
    metrics: ServerMetrics
    limiter: RateLimiter
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False

    @property
    def max_model_len(self) -> int:
        return self.async_engine.engine.max_model_len


def create_app(state: ServerState) -> Litestar:
    """The Litestar application serving ``state``'s engine."""

    async def check_request(request: Request[Any, Any, Any]) -> None:
        if request.url.path in OPEN_PATHS:
            return
        if state.settings.api_keys:
            header = request.headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            # compare_digest against every key: timing does not reveal which prefix matched
            matches = [
                hmac.compare_digest(token.encode(), k.encode()) for k in state.settings.api_keys
            ]
            if not any(matches):
                raise AuthenticationError()
        length = request.headers.get("content-length")
        if (
            length is not None
            and length.isdigit()
            and int(length) > state.settings.max_request_bytes
        ):
            raise RequestTooLargeError(int(length), state.settings.max_request_bytes)

    return Litestar(
        route_handlers=_handlers(state),
        before_request=check_request,
        exception_handlers={Exception: _error_response},
        request_max_body_size=None,  # our own limit, answered in OpenAI's error shape
    )


def _handlers(state: ServerState) -> list[Any]:
    @get("/health", sync_to_thread=False)
    def health() -> Response[dict[str, Any]]:
        """Liveness plus the engine's latest counters (503 while shutting down)."""
        snapshot = state.async_engine.snapshot
        body = {
            "status": "shutting down" if state.shutting_down else "ok",
            "num_steps": snapshot.num_steps,
            "num_running": snapshot.num_running,
            "num_waiting": snapshot.num_waiting,
            "num_pages": snapshot.num_pages,
            "num_free_pages": snapshot.num_free_pages,
        }
        return _json(body, status=503 if state.shutting_down else 200)

    @get("/metrics", sync_to_thread=False)
    def metrics() -> Response[bytes]:
        stats = state.async_engine.snapshot
        state.metrics.observe_engine(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_usage=1.0 - stats.num_free_pages / max(1, stats.num_pages),
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            num_preemptions=stats.num_preemptions,
        )
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @route("/ping", http_method=["GET", "POST"], sync_to_thread=False)
    def ping() -> Response[bytes]:
        """vLLM's and SageMaker's liveness probe: 200 while serving, 503 while shutting down."""
        return Response(
            b"", status_code=503 if state.shutting_down else 200, media_type="text/plain"
        )

    @get("/version", sync_to_thread=False)
    def version() -> Response[dict[str, str]]:
        """The ``brigade-llm`` distribution's version, in vLLM's shape."""
        return _json({"version": installed_version()})

    @get("/v1/models", sync_to_thread=False)
    def models() -> Response[out.ModelList]:
        return _json(_served_models(state))

    @get("/v1/models/{model_id:path}", sync_to_thread=False)
    def model(request: Request[Any, Any, Any]) -> Response[out.ModelCard]:
        """One served model's card, as ``/v1/models`` lists it; 404 for any other id."""
        # The id may hold slashes ("org/name"); a path parameter keeps them.
        wanted = str(request.path_params["model_id"]).removeprefix("/")
        for card in _served_models(state).data:
            if card.id == wanted:
                return _json(card)
        raise NotFoundError(
            f"The model {wanted!r} does not exist; this server serves {state.model_name!r}."
        )

    @post("/tokenize")
    async def tokenize(request: Request[Any, Any, Any]) -> Response[out.TokenizeResponse]:
        body = proto.decode_json(await _body(request, state), proto.TokenizeRequest)
        _check_model(state, body.model)
        if body.messages is not None:
            tokens = _chat_prompt(state, body.messages, body.add_generation_prompt)
        else:
            tokens = state.tokenizer.encode(
                body.prompt or "", add_special_tokens=body.adds_special_tokens
            )
        return _json(out.TokenizeResponse(list(tokens), len(tokens), state.max_model_len))

    @post("/detokenize")
    async def detokenize(request: Request[Any, Any, Any]) -> Response[out.DetokenizeResponse]:
        body = proto.decode_json(await _body(request, state), proto.DetokenizeRequest)
        _check_model(state, body.model)
        vocab = state.async_engine.engine.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise ProtocolError(
                f"token ids must be below the vocabulary size {vocab}", param="tokens"
            )
        return _json(out.DetokenizeResponse(state.tokenizer.decode(body.tokens)))

    @post("/v1/chat/completions")
    async def chat(request: Request[Any, Any, Any]) -> Response[out.ChatCompletion] | Stream:
        body = proto.decode_json(await _body(request, state), proto.ChatCompletionRequest)
        _check_model(state, body.model)
        prompt = _chat_prompt(state, body.messages, True, tools=body.tools)
        params = proto.sampling_params(
            body,
            default_max_tokens=max(1, state.max_model_len - len(prompt)),
            defaults=state.async_engine.engine.sampling_defaults,
        )
        calls_tools = body.tool_choice_spec() is not None
        _admit(state, request, [prompt], params.max_tokens * params.n)
        await _prepare_grammar(state, params, "tools" if calls_tools else "response_format")
        response_id = out.new_chat_id()
        deltas = await _first(
            state.frontend.generate(response_id, prompt, params, priority=body.priority or 0)
        )
        want_logprobs = params.logprobs is not None
        if body.stream:
            return _sse(
                streaming.chat_events(
                    deltas,
                    response_id=response_id,
                    model=state.model_name,
                    created=int(time.time()),
                    tokenizer=state.tokenizer,
                    prompt_tokens=len(prompt),
                    want_logprobs=want_logprobs,
                    include_usage=bool(body.stream_options and body.stream_options.include_usage),
                    tool_calls=calls_tools,
                )
            )
        collected = await streaming.collect(deltas, want_logprobs=want_logprobs)
        usage = out.usage(len(prompt), sum(c.num_tokens for c in collected))
        return _json(
            out.chat_response(
                response_id,
                state.model_name,
                int(time.time()),
                collected,
                usage,
                tokenizer=state.tokenizer,
                tool_calls=calls_tools,
            )
        )

    @post("/v1/completions")
    async def completions(request: Request[Any, Any, Any]) -> Response[out.Completion] | Stream:
        body = proto.decode_json(await _body(request, state), proto.CompletionRequest)
        _check_model(state, body.model)
        prompts = [_encode(state, p) for p in body.prompts()]
        params = proto.sampling_params(
            body, default_max_tokens=16, defaults=state.async_engine.engine.sampling_defaults
        )
        for index, prompt in enumerate(prompts):
            try:
                state.async_engine.engine.validate(prompt, params)
            except RequestError as exc:
                raise ProtocolError(f"prompt {index}: {exc}", param="prompt") from None
        _admit(state, request, prompts, params.max_tokens * params.n * len(prompts))
        await _prepare_grammar(state, params, "response_format")
        response_id = out.new_completion_id()
        priority = body.priority or 0
        deltas = await _first(
            streaming.merge(
                [
                    state.frontend.generate(
                        f"{response_id}-{i}",
                        p,
                        params,
                        priority=priority,
                        index_offset=i * params.n,
                    )
                    for i, p in enumerate(prompts)
                ]
            )
        )
        prompt_tokens = sum(len(p) for p in prompts)
        want_logprobs = params.logprobs is not None
        if body.stream:
            return _sse(
                streaming.completion_events(
                    deltas,
                    response_id=response_id,
                    model=state.model_name,
                    created=int(time.time()),
                    tokenizer=state.tokenizer,
                    prompt_tokens=prompt_tokens,
                    want_logprobs=want_logprobs,
                    include_usage=bool(body.stream_options and body.stream_options.include_usage),
                )
            )
        collected = await streaming.collect(deltas, want_logprobs=want_logprobs)
        usage = out.usage(prompt_tokens, sum(c.num_tokens for c in collected))
        return _json(
            out.completion_response(
                response_id,
                state.model_name,
                int(time.time()),
                collected,
                usage,
                tokenizer=state.tokenizer,
            )
        )

    return [health, ping, version, metrics, models, model, tokenize, detokenize, chat, completions]


def _served_models(state: ServerState) -> out.ModelList:
    return out.model_list([state.model_name], created=state.created)


def _json(payload: Any, status: int = 200) -> Response[Any]:
    return Response(msgspec.json.encode(payload), status_code=status, media_type=JSON)


def _sse(events: AsyncGenerator[bytes, None]) -> Stream:
    return Stream(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _body(request: Request[Any, Any, Any], state: ServerState) -> bytes:
    body = await request.body()
    if len(body) > state.settings.max_request_bytes:
        raise RequestTooLargeError(len(body), state.settings.max_request_bytes)
    return body


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise NotFoundError(
            f"The model {model!r} does not exist; this server serves {state.model_name!r}."
        )


def _chat_prompt(
    state: ServerState, messages: Sequence[Any], generation_prompt: bool, *, tools: Any = None
) -> list[int]:
    try:
        return render_chat_prompt(
            state.tokenizer,
            proto.template_messages(messages),
            tools=tools or None,
            add_generation_prompt=generation_prompt,
        )
    except Exception as exc:  # a template may reject a conversation (role order, ...)
        raise ProtocolError(
            f"the chat template rejected the messages: {exc}", param="messages"
        ) from None


def _encode(state: ServerState, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return [int(t) for t in state.tokenizer.encode(prompt)]
    return list(prompt)


def _admit(
    state: ServerState, request: Request[Any, Any, Any], prompts: Sequence[list[int]], budget: int
) -> None:
    """Validate prompt lengths and charge the rate limiter (prompt + requested tokens)."""
    if state.shutting_down:
        raise ServerOverloadedError("The server is shutting down.")
    if not state.limiter.enabled:
        return
    header = request.headers.get("authorization", "")
    key = header or (request.client.host if request.client else "unknown")
    tokens = sum(len(p) for p in prompts) + budget
    retry_after = state.limiter.acquire(key, tokens)
    if retry_after is not None:
        limit: Literal["requests", "tokens"] = (
            "requests" if state.settings.requests_per_minute else "tokens"
        )
        raise RateLimitError(
            f"Rate limit reached ({limit} per minute); retry in {retry_after:.0f} s.",
            retry_after=retry_after,
            limit=limit,
        )


async def _prepare_grammar(state: ServerState, params: SamplingParams, param: str) -> None:
    """Compile the request's grammar before answering (off the engine's step loop): an
    invalid one is a 400 naming ``param``, before any token is generated."""
    spec = params.structured_output
    if spec is None:
        return
    engine = state.async_engine.engine
    started = time.monotonic()
    try:
        gate = engine.prepare(params)
        if gate is not None:
            await asyncio.wrap_future(gate)
    except (RequestError, ValueError) as exc:
        state.metrics.observe_grammar(spec.kind, time.monotonic() - started, valid=False)
        raise ProtocolError(str(exc), param=param) from None
    state.metrics.observe_grammar(spec.kind, time.monotonic() - started, valid=True)


async def _first(stream: AsyncGenerator[ChoiceDelta, None]) -> AsyncGenerator[ChoiceDelta, None]:
    """Wait for the first delta, so a refused request becomes an HTTP error, not a stream."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        raise InternalServerError("the engine produced no output") from None
    except EngineOverloadedError as exc:
        await stream.aclose()
        raise ServerOverloadedError(str(exc)) from None
    except RequestError as exc:
        await stream.aclose()
        raise ProtocolError(str(exc), param="messages") from None
    return streaming.prepend(first, stream)


def _error_response(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    if isinstance(exc, APIError):
        error = exc
    elif isinstance(exc, RequestError):
        error = ProtocolError(str(exc))
    elif isinstance(exc, EngineOverloadedError):
        error = ServerOverloadedError(str(exc))
    elif isinstance(exc, HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = APIError(exc.status_code, str(exc.detail), type=kind)
    else:
        structlog.get_logger("brigade.server").exception("unhandled error", path=request.url.path)
        error = InternalServerError()
    return Response(
        error.to_body(), status_code=error.status, media_type=JSON, headers=error.headers()
    )
