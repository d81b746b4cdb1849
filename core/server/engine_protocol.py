"""The wire protocol between API front ends and the engine process (msgspec over ZMQ).

A front end is a ZMQ DEALER with its own identity; the engine process is the ROUTER they all
connect to. Front end -> engine: :class:`Hello` (register, answered by :class:`Ready`),
:class:`AddRequest`, :class:`Abort`, :class:`AbortAll`, :class:`Goodbye`. Engine -> front
end: :class:`Ready` once, then one :class:`StepOutputs` per engine step carrying every update
of that front end's requests in the step plus the engine's counters (sent to every front end,
so each one's ``/health`` and ``/metrics`` gauges are current), and :class:`EngineFailed`
when the engine dies on its own terms.

``SamplingParams``, ``StructuredOutput`` and ``PoolingParams`` are the interfaces'
dataclasses: msgspec encodes them field by field and decodes them back through their
constructors, so a value the front end accepted is validated again on arrival (the
round-trip test in tests/server/test_engine_protocol.py covers every field).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from brigade.engine import EngineStats  # decoded from the wire: needed at run time
from brigade.interfaces import PoolingParams, SamplingParams

if TYPE_CHECKING:
    from brigade.engine import EngineCore, StepUpdate

__all__ = [
    "Abort",
    "AbortAll",
    "AddRequest",
    "EngineFailed",
    "EngineInfo",
    "FromEngine",
    "Goodbye",
    "Hello",
    "Ready",
    "RequestUpdate",
    "StepOutputs",
    "ToEngine",
    "decode_from_engine",
    "decode_to_engine",
    "encode",
    "engine_info",
    "request_update",
]


class EngineInfo(msgspec.Struct, frozen=True):
    """What a front end needs to know about the engine, fixed for its life (the handshake)."""

    vocab_size: int
    max_model_len: int
    sampling_defaults: dict[str, float]
    model_dir: str
    hidden_size: int | None
    page_size: int
    num_pages: int
    load_time_s: float
    embeddings: bool
    """The executor returns hidden states (``/v1/embeddings`` works)."""
    structured_output: bool
    """The engine has a grammar station (the executor returns logits)."""
    executor: str
    """The executor's plugin name, for error messages."""
    pid: int
    """The engine's process id (front ends watch it to notice its death)."""


class RequestUpdate(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's part of a step (``StepUpdate`` less the engine-side ``Request``)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    status: str
    """``RequestStatus`` value after the step."""
    first_scheduled_time: float | None = None
    """On ``time.monotonic``'s clock, which every process of one machine shares."""
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    """Per new token: (token id, logprob, top alternatives as (token id, logprob))."""
    error: str | None = None
    invalid: bool = False
    error_param: str | None = None
    """The request field an ``invalid`` error is about (``structured_output``), if known."""
    embedding: list[float] | None = None


class Hello(msgspec.Struct, tag="hello"):
    """A front end announces itself; the engine answers :class:`Ready`."""

    frontend: int


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    extra: dict[str, Any] = {}
    pooling: PoolingParams | None = None


class Abort(msgspec.Struct, tag="abort"):
    """Stop these requests (no answer; unknown ids are ignored)."""

    request_ids: list[str]


class AbortAll(msgspec.Struct, tag="abort_all"):
    """End every request of this front end now; each gets a last update (reason ``abort``)."""


class Goodbye(msgspec.Struct, tag="goodbye"):
    """The front end is leaving: abort its requests and send it nothing more."""


class Ready(msgspec.Struct, tag="ready"):
    info: EngineInfo
    stats: EngineStats


class StepOutputs(msgspec.Struct, tag="step"):
    updates: list[RequestUpdate]
    stats: EngineStats


class EngineFailed(msgspec.Struct, tag="failed"):
    """The engine died (``EngineDeadError``); the process exits after sending this."""

    reason: str


ToEngine = Hello | AddRequest | Abort | AbortAll | Goodbye
FromEngine = Ready | StepOutputs | EngineFailed


def _enc_hook(value: Any) -> Any:
    if isinstance(value, Mapping):  # frozen extra / logit_bias mappings (MappingProxyType)
        return dict(value)
    raise NotImplementedError(f"cannot send {type(value).__name__} to the engine process")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(message: ToEngine | FromEngine) -> bytes:
    return _encoder.encode(message)


def decode_to_engine(data: bytes) -> ToEngine:
    """A front end's message; ``msgspec.ValidationError`` if it is not one (a bad
    ``SamplingParams`` value raises it too, with the constructor's message)."""
    return _to_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine.decode(data)


def request_update(update: StepUpdate) -> RequestUpdate:
    request = update.request
    logprobs = (
        None
        if update.logprobs is None
        else [(lp.token_id, lp.logprob, [tuple(t) for t in lp.top]) for lp in update.logprobs]
    )
    return RequestUpdate(
        request.request_id,
        update.new_token_ids,
        update.finished,
        request.status.value,
        request.first_scheduled_time,
        logprobs,  # type: ignore[arg-type]
        update.error,
        update.invalid,
        update.error_param,
        update.embedding,
    )


def engine_info(engine: EngineCore, pid: int) -> EngineInfo:
    """``engine``'s :class:`EngineInfo` (``pid``: the process it runs in)."""
    hidden_size = engine.checkpoint.config.get("hidden_size")
    return EngineInfo(
        vocab_size=engine.vocab_size,
        max_model_len=engine.max_model_len,
        sampling_defaults=dict(engine.sampling_defaults),
        model_dir=str(engine.model_dir),
        hidden_size=hidden_size if isinstance(hidden_size, int) else None,
        page_size=engine.batch.page_size,
        num_pages=engine.kv.stats().num_pages,
        load_time_s=engine.load_time_s,
        embeddings=type(engine.executor).returns_hidden_states,
        structured_output=engine.grammar is not None,
        executor=engine.config.plugin("executor"),
        pid=pid,
    )
