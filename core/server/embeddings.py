"""``POST /v1/embeddings``: the served decoder's final hidden states, pooled per input.

Each input runs through the engine as an embedding request (``PoolingParams``): a prefill
batched with whatever else is running, on the same weights and KV pool, that samples nothing.
Pooling is the server's (``[server] embedding_pooling``, the last token by default, as vLLM
pools decoder models), normalized to unit length unless the request says ``normalize: false``
(vLLM's extension).
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
from litestar import Request, Response

from brigade.errors import RequestError, RequestFailedError
from brigade.interfaces import PoolingParams, SamplingParams
from brigade.server.errors import InternalServerError, ProtocolError, api_error
from brigade.server.guards import charge_rate_limit, check_batch_size
from brigade.server.state import ServerState, json_response

__all__ = ["Embedding", "EmbeddingList", "EmbeddingRequest", "EmbeddingUsage", "embed"]

TokenId = Annotated[int, msgspec.Meta(ge=0)]
_PARAMS = SamplingParams(max_tokens=1)
"""What an embedding request carries as sampling parameters (it samples nothing)."""


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """Body of ``POST /v1/embeddings`` (OpenAI's fields plus vLLM's extensions)."""

    input: str | list[str | TokenId | list[TokenId]]
    """Text, token ids, or a batch of either (OpenAI's four shapes)."""
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    """``base64``: each vector as little-endian float32 bytes, base64-encoded (what the openai
    client asks for by default and decodes)."""
    dimensions: int | None = None
    """Only the model's own size: a decoder's vectors cannot be shortened (no Matryoshka)."""
    user: str | None = None
    """Ignored (OpenAI's end-user id for abuse monitoring)."""
    add_special_tokens: bool = True
    """vLLM extension: false encodes text without the tokenizer's special tokens."""
    normalize: bool | None = None
    """vLLM extension: false returns the pooled vector as is (default: unit length)."""
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    """vLLM extension: keep only the last N tokens of each input (-1: max_model_len)."""
    priority: int = 0
    """vLLM extension: lower runs first under the ``priority`` scheduler."""

    def __post_init__(self) -> None:
        self.inputs()  # validates the shape

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list: each one a string or a list of token ids."""
        given = self.input
        if isinstance(given, str):
            return [given]
        if not given:
            raise ProtocolError("input must not be an empty list.", param="input")
        if all(isinstance(item, int) for item in given):
            return [list(given)]  # type: ignore[arg-type]
        if all(isinstance(item, str) for item in given):
            return list(given)  # type: ignore[arg-type]
        if all(isinstance(item, list) for item in given):
            return list(given)  # type: ignore[arg-type]
        raise ProtocolError(
            "input must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists; it mixes those.",
            param="input",
        )


class Embedding(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    """OpenAI's ``CreateEmbeddingResponse`` (plus vLLM's ``id`` and ``created``)."""

    id: str
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
    object: str = "list"


async def embed(
    state: ServerState, request: Request[Any, Any, Any], body: EmbeddingRequest
) -> Response[EmbeddingList]:
    """Embed every input of a decoded request; all of them, or an error for the request."""
    inputs = body.inputs()
    check_batch_size(len(inputs), state.settings)
    _check_dimensions(state, body.dimensions)
    prompts = await state.run_blocking(_encode, state, inputs, body.add_special_tokens)
    prompts = [_truncate(p, body.truncate_prompt_tokens, state.max_model_len) for p in prompts]
    admissions = _admit(state, prompts, body.normalize)
    if state.shutting_down:
        raise ProtocolError("The server is shutting down.")
    state.async_engine.check_capacity(len(prompts))
    charge_rate_limit(request, state.limiter, state.settings, prompts, 0)
    response_id = f"embd-{uuid.uuid4().hex}"
    started = time.monotonic()
    vectors = await _embed_all(state, response_id, admissions, body.priority)
    elapsed = time.monotonic() - started
    for prompt in prompts:
        state.metrics.observe_finished(len(prompt), 0, elapsed, "stop")
    num_tokens = sum(len(p) for p in prompts)
    data = [
        Embedding(index, _encoded(vector, body.encoding_format))
        for index, vector in enumerate(vectors)
    ]
    return json_response(
        EmbeddingList(
            id=response_id,
            created=int(time.time()),
            model=state.model_name,
            data=data,
            usage=EmbeddingUsage(num_tokens, num_tokens),
        )
    )


def _check_dimensions(state: ServerState, dimensions: int | None) -> None:
    """Refuse ``dimensions`` other than the model's own size."""
    hidden_size = _hidden_size(state)
    if dimensions is not None and dimensions != hidden_size:
        raise ProtocolError(
            f"dimensions {dimensions} is not supported: this model's embeddings have "
            f"{hidden_size} dimensions and cannot be shortened.",
            param="dimensions",
        )


def _admit(state: ServerState, prompts: list[list[int]], normalize: bool | None) -> list[Any]:
    """Each prompt admitted as an embedding request, pooled as the server says; the first
    one the engine refuses fails the request, naming the input."""
    settings = state.settings
    if normalize is None:
        normalize = settings.embedding_normalize
    pooling = PoolingParams(mode=settings.embedding_pooling, normalize=normalize)
    admissions = []
    for index, prompt in enumerate(prompts):
        try:
            admissions.append(state.async_engine.admit(prompt, _PARAMS, pooling=pooling))
        except RequestError as exc:
            message = str(exc) if len(prompts) == 1 else f"input {index}: {exc}"
            param = "input" if exc.param in (None, "prompt") else exc.param
            raise ProtocolError(message, param=param) from None
    return admissions


async def _embed_all(
    state: ServerState, response_id: str, admissions: list[Any], priority: int
) -> list[list[float]]:
    """Every admitted input's vector, run concurrently; the first failure cancels the rest."""
    tasks = [
        asyncio.create_task(_one(state, f"{response_id}-{index}", admission, priority))
        for index, admission in enumerate(admissions)
    ]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()  # leaving their streams aborts their engine requests
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _one(state: ServerState, request_id: str, admission: Any, priority: int) -> list[float]:
    """One input's vector; its failure raises the HTTP error."""
    try:
        async for update in state.async_engine.generate(
            request_id, admission, _PARAMS, priority=priority, check_queue=False
        ):
            if update.error is not None:
                raise RequestFailedError(update.error)
            if update.embedding is not None:
                return update.embedding
    except (RequestError, RequestFailedError) as exc:
        raise api_error(exc) or InternalServerError() from None
    raise InternalServerError("The engine finished an embedding request without its vector.")


def _encode(
    state: ServerState, inputs: Sequence[str | list[int]], add_special_tokens: bool
) -> list[list[int]]:
    return [
        [int(t) for t in state.tokenizer.encode(item, add_special_tokens=add_special_tokens)]
        if isinstance(item, str)
        else list(item)
        for item in inputs
    ]


def _truncate(prompt: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``keep`` tokens (-1: as many as fit)."""
    if keep is None:
        return prompt
    limit = max_model_len - 1 if keep == -1 else keep
    return prompt[-limit:] if limit else []


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _hidden_size(state: ServerState) -> int:
    size = state.async_engine.info.hidden_size
    if size is None:
        raise ProtocolError("embeddings are not available: the model has no hidden_size.")
    return size
