"""The wire protocol between front ends and the engine process: every message survives a
round trip, and every field of the sampling parameters arrives as sent."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import msgspec
import pytest

from brigade.engine import EngineStats
from brigade.interfaces import PoolingParams, SamplingParams, StructuredOutput
from brigade.server import engine_protocol as wire
from brigade.speculative import SpeculativeStats

STATS = EngineStats(7, 2, 3, 1, 10, 4, 50, 64, 0.25)
INFO = wire.EngineInfo(
    vocab_size=256,
    max_model_len=64,
    sampling_defaults={"temperature": 0.7},
    model_dir="/models/tiny",
    hidden_size=64,
    page_size=8,
    num_pages=64,
    load_time_s=1.5,
    embeddings=True,
    structured_output=False,
    executor="torch",
    pid=1234,
)


def every_field_set() -> SamplingParams:
    """Sampling parameters with no field at its default."""
    params = SamplingParams(
        max_tokens=33,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias=MappingProxyType({3: 1.5, 200: -100.0}),
        seed=42,
        stop=("END", "\n\n"),
        stop_token_ids=(1, 2),
        ignore_eos=True,
        min_tokens=2,
        logprobs=5,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        n=3,
        structured_output=StructuredOutput("json_schema", '{"type": "object"}'),
    )
    defaults = SamplingParams()
    unchanged = [
        f.name
        for f in dataclasses.fields(params)
        if getattr(params, f.name) == getattr(defaults, f.name)
    ]
    assert not unchanged, f"fields left at their default: {unchanged}"
    return params


def test_add_request_round_trips_every_sampling_field_and_the_extra_data() -> None:
    params = every_field_set()
    sent = wire.AddRequest(
        "req-1",
        [5, 6, 7],
        params,
        priority=-3,
        extra={"tenant": "a", "tags": ("x", "y"), "limits": MappingProxyType({"n": 1})},
        pooling=PoolingParams("mean", normalize=False),
    )
    received = wire.decode_to_engine(wire.encode(sent))
    assert isinstance(received, wire.AddRequest)
    assert received.params == params
    assert dict(received.params.logit_bias or {}) == {3: 1.5, 200: -100.0}
    assert received.params.structured_output == params.structured_output
    assert received.pooling == PoolingParams("mean", normalize=False)
    assert received.extra == {"tenant": "a", "tags": ["x", "y"], "limits": {"n": 1}}
    assert (received.request_id, received.prompt_token_ids, received.priority) == (
        "req-1",
        [5, 6, 7],
        -3,
    )


@pytest.mark.parametrize(
    ("kind", "spec"), [("json", ""), ("regex", "a+b"), ("ebnf", 'root ::= "x"')]
)
def test_structured_output_kinds_round_trip(kind: str, spec: str) -> None:
    params = SamplingParams(structured_output=StructuredOutput(kind, spec))
    received = wire.decode_to_engine(wire.encode(wire.AddRequest("r", [1], params)))
    assert isinstance(received, wire.AddRequest)
    assert received.params.structured_output == StructuredOutput(kind, spec)


def test_parameters_are_validated_again_on_arrival() -> None:
    """A message carrying a value the constructor refuses does not decode."""
    raw = msgspec.msgpack.decode(wire.encode(wire.AddRequest("r", [1], SamplingParams())))
    raw["params"]["max_tokens"] = 0
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):
        wire.decode_to_engine(msgspec.msgpack.encode(raw))


def test_commands_round_trip() -> None:
    for command in (wire.Hello(2), wire.Abort(["a", "b"]), wire.AbortAll(), wire.Goodbye()):
        assert wire.decode_to_engine(wire.encode(command)) == command


def test_engine_messages_round_trip() -> None:
    updates = [
        wire.RequestUpdate(
            "a", [17], False, "running", 12.5, logprobs=[(17, -0.25, [(17, -0.25), (9, -2.0)])]
        ),
        wire.RequestUpdate(
            "b",
            [],
            True,
            "abort",
            error="invalid regular expression",
            invalid=True,
            error_param="structured_output",
        ),
        wire.RequestUpdate("c", [], True, "stop", 3.0, embedding=[0.5, -0.5]),
    ]
    speculating = dataclasses.replace(
        STATS, speculative=SpeculativeStats(9, 5, 4, (3, 2, 0), (4, 3, 2))
    )
    for message in (
        wire.StepOutputs(updates, STATS),
        wire.StepOutputs([], speculating),
        wire.Ready(INFO, STATS),
        wire.EngineFailed("the scheduler broke"),
    ):
        assert wire.decode_from_engine(wire.encode(message)) == message


def test_a_front_end_message_is_not_an_engine_message() -> None:
    with pytest.raises(msgspec.ValidationError):
        wire.decode_from_engine(wire.encode(wire.AbortAll()))
