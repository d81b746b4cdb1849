"""The OpenAI-compatible HTTP API on Litestar: routes, the checks every request passes, and
the errors' shape (the generation endpoints' work is in ``generation``)."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import structlog
from litestar import Litestar, Request, Response, get, post, route
from litestar.exceptions import HTTPException
from litestar.response import Stream

from brigade.server import protocol as proto
from brigade.server import responses as out
from brigade.server.embeddings import EmbeddingRequest, embed
from brigade.server.errors import (
    APIError,
    InternalServerError,
    NotFoundError,
    ProtocolError,
    RequestTooLargeError,
    api_error,
)
from brigade.server.generation import chat_completion, chat_prompt, completion, encode_text
from brigade.server.guards import (
    ClientDisconnectedError,
    authenticate,
    read_body,
    unless_disconnected,
)
from brigade.server.health import can_serve, server_health
from brigade.server.openapi import document_api
from brigade.server.responses_api import ResponsesRequest, create_response
from brigade.server.state import JSON, ServerState, json_response
from brigade.version import installed_version

__all__ = ["ServerState", "create_app"]

OPEN_PATHS = ("/health", "/metrics", "/ping", "/version")
"""Reachable without an API key (probes and scrapers)."""


def create_app(state: ServerState) -> Litestar:
    """The Litestar application serving ``state``'s engine."""

    async def check_request(request: Request[Any, Any, Any]) -> None:
        if request.url.path in OPEN_PATHS:
            return
        authenticate(request, state.settings)
        length = request.headers.get("content-length")
        limit = state.settings.max_request_bytes
        if length is not None and length.isdigit() and (len(length) > 18 or int(length) > limit):
            raise RequestTooLargeError(int(length) if len(length) <= 18 else None, limit)

    app = Litestar(
        route_handlers=_handlers(state),
        before_request=check_request,
        exception_handlers={Exception: _error_response},
        request_max_body_size=None,  # our own limit, answered in OpenAI's error shape
    )
    info = state.async_engine.info
    document_api(
        app,
        model_name=state.model_name,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
    )
    return app


def _handlers(state: ServerState) -> list[Any]:
    return [*_probe_handlers(state), *_model_handlers(state), *_generation_handlers(state)]


def _probe_handlers(state: ServerState) -> list[Any]:
    """What probes and scrapers reach without an API key (:data:`OPEN_PATHS`)."""

    @get("/health", sync_to_thread=False)
    def health() -> Response[dict[str, Any]]:
        """Readiness: the server's status and process counts, the engine's latest counters
        (``brigade.server.health`` says which status answers 503)."""
        snapshot = state.async_engine.snapshot
        report = server_health(state)
        body = {
            "status": report.status,
            "num_steps": snapshot.num_steps,
            "num_running": snapshot.num_running,
            "num_waiting": snapshot.num_waiting,
            "num_pages": snapshot.num_pages,
            "num_free_pages": snapshot.num_free_pages,
            "no_progress_s": round(report.no_progress_s, 3),
            "engines_alive": report.engines_alive,
            "engines_total": report.engines_total,
            "frontends_alive": report.frontends_alive,
            "frontends_total": report.frontends_total,
        }
        return json_response(body, status=report.http_status)

    @get("/metrics", sync_to_thread=False)
    def metrics() -> Response[bytes]:
        state.metrics.observe_snapshot(state.async_engine.snapshot)
        report = server_health(state)
        state.metrics.observe_processes(
            engines_alive=report.engines_alive,
            engines_total=report.engines_total,
            frontends_alive=report.frontends_alive,
            frontends_total=report.frontends_total,
        )
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @route("/ping", http_method=["GET", "POST"], status_code=200, sync_to_thread=False)
    def ping() -> Response[bytes]:
        """vLLM's and SageMaker's liveness probe: 200 while the server can serve, else 503."""
        code = 200 if can_serve(state) else 503
        return Response(b"", status_code=code, media_type="text/plain")

    @get("/version", sync_to_thread=False)
    def version() -> Response[dict[str, str]]:
        """The ``brigade-llm`` distribution's version, in vLLM's shape."""
        return json_response({"version": installed_version()})

    return [health, ping, version, metrics]


def _model_handlers(state: ServerState) -> list[Any]:
    """The served model's cards, and its tokenizer."""

    @get("/v1/models", sync_to_thread=False)
    def models() -> Response[out.ModelList]:
        return json_response(_served_models(state))

    @get("/v1/models/{model_id:path}", sync_to_thread=False)
    def model(request: Request[Any, Any, Any]) -> Response[out.ModelCard]:
        """One served model's card, as ``/v1/models`` lists it; 404 for any other id."""
        # The id may hold slashes ("org/name"); a path parameter keeps them.
        wanted = str(request.path_params["model_id"]).removeprefix("/")
        for card in _served_models(state).data:
            if card.id == wanted:
                return json_response(card)
        raise NotFoundError(
            f"The model {wanted!r} does not exist; this server serves {state.model_name!r}."
        )

    @post("/tokenize", status_code=200)
    async def tokenize(request: Request[Any, Any, Any]) -> Response[out.TokenizeResponse]:
        body = await _read_request(state, request, proto.TokenizeRequest)
        if body.messages is not None:
            tokens = await state.run_blocking(
                chat_prompt, state, body.messages, body.add_generation_prompt, None
            )
        else:
            tokens = await state.run_blocking(
                encode_text, state, body.prompt or "", body.adds_special_tokens
            )
        return json_response(out.TokenizeResponse(list(tokens), len(tokens), state.max_model_len))

    @post("/detokenize", status_code=200)
    async def detokenize(request: Request[Any, Any, Any]) -> Response[out.DetokenizeResponse]:
        body = await _read_request(state, request, proto.DetokenizeRequest)
        vocab = state.async_engine.info.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise ProtocolError(
                f"token ids must be below the vocabulary size {vocab}", param="tokens"
            )
        text = await state.run_blocking(state.tokenizer.decode, body.tokens)
        return json_response(out.DetokenizeResponse(text))

    return [models, model, tokenize, detokenize]


def _generation_handlers(state: ServerState) -> list[Any]:
    """The generation endpoints; each answers nothing to a client that has gone."""

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request[Any, Any, Any]) -> Response[out.ChatCompletion] | Stream:
        body = await _read_request(state, request, proto.ChatCompletionRequest)
        return await unless_disconnected(request, chat_completion(state, request, body))

    @post("/v1/completions", status_code=200)
    async def completions(request: Request[Any, Any, Any]) -> Response[out.Completion] | Stream:
        body = await _read_request(state, request, proto.CompletionRequest)
        return await unless_disconnected(request, completion(state, request, body))

    @post("/v1/embeddings", status_code=200)
    async def embeddings(request: Request[Any, Any, Any]) -> Response[Any]:
        body = await _read_request(state, request, EmbeddingRequest)
        return await unless_disconnected(request, embed(state, request, body))

    @post("/v1/responses", status_code=200)
    async def responses(request: Request[Any, Any, Any]) -> Response[Any] | Stream:
        body = await _read_request(state, request, ResponsesRequest)
        return await unless_disconnected(request, create_response(state, request, body))

    return [chat, completions, embeddings, responses]


class _ModelRequest(Protocol):
    """A request body that may name the model it is for."""

    @property
    def model(self) -> str | None: ...


_Body = TypeVar("_Body", bound=_ModelRequest)


async def _read_request(
    state: ServerState, request: Request[Any, Any, Any], type_: type[_Body]
) -> _Body:
    """The request's body decoded as ``type_``, checked to be for the served model."""
    body = proto.decode_json(await read_body(request, state.settings), type_)
    _check_model(state, body.model)
    return body


def _served_models(state: ServerState) -> out.ModelList:
    return out.model_list([state.model_name], created=state.created)


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise NotFoundError(
            f"The model {model!r} does not exist; this server serves {state.model_name!r}."
        )


def _error_response(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    if isinstance(exc, ClientDisconnectedError):  # nobody is left to read an answer
        return Response(b"", status_code=499, media_type="text/plain")
    error = api_error(exc)
    headers: dict[str, str] = {}
    if error is None and isinstance(exc, HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = APIError(exc.status_code, str(exc.detail), type=kind)
        headers = dict(exc.headers or {})  # e.g. a 405's Allow
    if error is None:
        structlog.get_logger("brigade.server").exception("unhandled error", path=request.url.path)
        error = InternalServerError()
    return Response(
        error.to_body(),
        status_code=error.status,
        media_type=JSON,
        headers={**headers, **error.headers()},
    )
