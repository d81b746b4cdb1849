"""The served OpenAPI document: Litestar's, completed with what it cannot see.

The handlers read and validate their bodies themselves (OpenAI's error shape, a size limit
enforced while reading), so Litestar sees neither the request bodies nor the answers'
status codes. This module writes them in: each POST's request body (the JSON schema of its
msgspec struct), every answer an operation may give (200 with its schema, plus ``text/
event-stream`` where it can stream, and each error status with OpenAI's error body), so a
client generator or a fuzzer (``scripts/fuzz.sh``) works from the truth.
"""

from __future__ import annotations

from typing import Any, cast

import msgspec
from litestar import Litestar
from litestar.openapi.spec import (
    OpenAPIMediaType,
    OpenAPIResponse,
    Operation,
    Reference,
    RequestBody,
    Schema,
)

from brigade.admission import FLOAT32_MAX
from brigade.server import protocol as proto
from brigade.server import responses as out
from brigade.server.embeddings import EmbeddingList, EmbeddingRequest
from brigade.server.errors import ErrorResponse
from brigade.server.responses_api import ResponsesRequest

__all__ = ["document_api"]

_REF = "#/components/schemas/{name}"

_BODIES: dict[str, type] = {
    "/v1/chat/completions": proto.ChatCompletionRequest,
    "/v1/completions": proto.CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/tokenize": proto.TokenizeRequest,
    "/detokenize": proto.DetokenizeRequest,
}
_ANSWERS: dict[str, type] = {
    "/v1/chat/completions": out.ChatCompletion,
    "/v1/completions": out.Completion,
    "/v1/embeddings": EmbeddingList,
    "/tokenize": out.TokenizeResponse,
    "/detokenize": out.DetokenizeResponse,
    "/v1/models": out.ModelList,
    "/v1/models/{model_id}": out.ModelCard,
}
_STREAMING = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
_QUEUED = (*_STREAMING, "/v1/embeddings")
"""Endpoints that queue engine requests (rate limits, a full queue: 429, 503)."""

_ERRORS = {
    400: "Invalid request: malformed JSON, a wrong type or value (`param` names the field)",
    401: "Missing or wrong API key",
    404: "Not the served model",
    408: "The request body did not arrive in time",
    413: "The request body is too large",
    429: "Over the rate limit (see Retry-After)",
    500: "Internal failure (the message names the cause)",
    503: "The queue is full, the server is shutting down, or its engine has failed",
}

_EVENT = {
    "description": "One Server-Sent Event: a chunk (chat.completion.chunk or text_completion) "
    "as JSON, an error body (OpenAI's shape) when the request failed, or [DONE] last",
    "type": "object",
    "properties": {"data": {"type": "string"}},
    "required": ["data"],
}
_HEALTH = {
    "type": "object",
    "properties": {
        "status": {"enum": ["ok", "degraded", "stalled", "shutting down", "engine failed"]},
        **{
            name: {"type": "integer"}
            for name in (
                "num_steps",
                "num_running",
                "num_waiting",
                "num_pages",
                "num_free_pages",
                "engines_alive",
                "engines_total",
                "frontends_alive",
                "frontends_total",
            )
        },
        "no_progress_s": {"type": "number"},
    },
    "required": ["status"],
}
_RESPONSE = {
    "description": "A Responses API `response` object (id, object, created_at, model, status, "
    "output items, usage, ...), as OpenAI's",
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "object": {"enum": ["response"]},
        "status": {"enum": ["completed", "incomplete"]},
        "output": {"type": "array", "items": {"type": "object"}},
    },
    "required": ["id", "object", "status", "output"],
}
_UNTYPED_ANSWERS: dict[str, dict[str, Any]] = {"/v1/responses": _RESPONSE}
"""Answers built as plain JSON (no msgspec struct), documented by hand."""
_VERSION = {
    "type": "object",
    "properties": {"version": {"type": "string"}},
    "required": ["version"],
}


_BOUNDS: dict[str, dict[str, float]] = {
    "temperature": {"minimum": 0, "maximum": FLOAT32_MAX},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1},
    "min_p": {"minimum": 0, "maximum": 1},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": FLOAT32_MAX},
    "n": {"minimum": 1},
    "min_tokens": {"minimum": 0},
}
"""What the server checks beyond the types (protocol.py, SamplingParams), written into the
document so that generated requests are valid as often as the document can say."""


def document_api(app: Litestar, *, model_name: str, vocab_size: int, max_model_len: int) -> None:
    """Complete ``app``'s OpenAPI document in place (before it is first served), with the
    served model: its name, token ids below ``vocab_size``, ``max_tokens`` below
    ``max_model_len``."""
    document = app.openapi_schema
    types = [*_BODIES.values(), *_ANSWERS.values(), ErrorResponse]
    _, components = msgspec.json.schema_components(types, ref_template=_REF)
    _constrain(components, vocab_size=vocab_size, max_model_len=max_model_len)
    for struct in _BODIES.values():
        components[struct.__name__]["properties"]["model"] = {
            "anyOf": [{"enum": [model_name]}, {"type": "null"}]
        }
    if document.components.schemas is None:
        document.components.schemas = {}
    document.components.schemas.update(cast(dict[str, Schema], components))
    for path, item in (document.paths or {}).items():
        for method in ("get", "post"):
            operation = getattr(item, method, None)
            if operation is not None:
                _complete(path, method, operation)


def _constrain(components: dict[str, Any], *, vocab_size: int, max_model_len: int) -> None:
    stack: list[Any] = list(components.values())
    while stack:  # token ids (the only integers >= 0 without a maximum yet): below the vocab
        item = stack.pop()
        if isinstance(item, dict):
            if item.get("type") == "integer" and item.get("minimum") == 0 and "maximum" not in item:
                item["maximum"] = vocab_size - 1
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    bounds = {
        **_BOUNDS,
        "max_tokens": {"minimum": 1, "maximum": max_model_len - 1},
        "max_completion_tokens": {"minimum": 1, "maximum": max_model_len - 1},
    }
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        properties = components[name]["properties"]
        for field, limits in bounds.items():
            if field not in properties:
                continue
            for branch in properties[field].get("anyOf", [properties[field]]):
                if branch.get("type") in ("integer", "number"):
                    branch.update(limits)
        for branch in properties["logit_bias"]["anyOf"]:
            if branch.get("type") == "object":
                branch["additionalProperties"] = {"type": "number", "minimum": -100, "maximum": 100}
                branch["propertyNames"] = {"pattern": f"^[0-9]{{1,{proto.MAX_TOKEN_ID_DIGITS}}}$"}
    components["ChatMessage"]["properties"]["role"] = {"enum": list(proto.ROLES)}


def _complete(path: str, method: str, operation: Operation) -> None:
    body = _BODIES.get(path) if method == "post" else None
    if body is not None:
        operation.request_body = RequestBody(
            content={"application/json": _media(_ref(body))}, required=True
        )
    if path == "/v1/models/{model_id}":  # the id may hold slashes; it is not a URI
        for parameter in operation.parameters or ():
            if not isinstance(parameter, Reference):
                parameter.schema = Schema(type=cast(Any, "string"))
    operation.responses = {
        str(status): response for status, response in _responses(path, body is not None).items()
    }


def _responses(path: str, has_body: bool) -> dict[int, OpenAPIResponse]:
    if path == "/health":
        return {
            200: _json("Serving (ok, or degraded: a process lost)", _HEALTH),
            503: _json("Stalled, shutting down or failed", _HEALTH),
        }
    if path == "/ping":
        return {200: _text("Serving"), 503: _text("Shutting down or failed")}
    if path == "/metrics":
        return {200: _text("Prometheus text format")}
    if path == "/version":
        return {200: _json("The brigade-llm version", _VERSION)}
    answer = _ANSWERS.get(path)
    success = OpenAPIResponse(description="Success", content={})
    if answer is not None:
        cast(dict[str, OpenAPIMediaType], success.content)[JSON] = _media(_ref(answer))
    elif path in _UNTYPED_ANSWERS:
        untyped = _media(cast(Any, _UNTYPED_ANSWERS[path]))
        cast(dict[str, OpenAPIMediaType], success.content)[JSON] = untyped
    if path in _STREAMING:
        events = _media(cast(Any, _EVENT))
        cast(dict[str, OpenAPIMediaType], success.content)["text/event-stream"] = events
    statuses = {401, 500}
    if path.startswith("/v1/models/"):
        statuses |= {404}
    if has_body:
        statuses |= {400, 404, 408, 413}
    if path in _QUEUED:
        statuses |= {429, 503}
    errors = {status: _json(_ERRORS[status], _ref(ErrorResponse)) for status in sorted(statuses)}
    return {200: success, **errors}


JSON = "application/json"


def _ref(struct: type) -> Reference:
    return Reference(ref=_REF.format(name=struct.__name__))


def _media(schema: Any) -> OpenAPIMediaType:
    return OpenAPIMediaType(schema=schema)


def _json(description: str, schema: Any) -> OpenAPIResponse:
    return OpenAPIResponse(description=description, content={JSON: _media(schema)})


def _text(description: str) -> OpenAPIResponse:
    content = {"text/plain": _media(cast(Any, {"type": "string"}))}
    return OpenAPIResponse(description=description, content=content)
