"""The OpenAI wire protocol: request decoding, SamplingParams mapping, response and error bodies.

Response bodies are checked the way clients read them: parsed by the official ``openai``
package's types.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgspec
import openai.types
import openai.types.chat
import pytest
from protocol_helpers import USER, chat_body, completion_body, protocol_error

from brigade.engine import TokenLogprob
from brigade.server import responses
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
from brigade.server.generation_inputs import sampling_params, template_messages
from brigade.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    decode_json,
)


def chat_params(**fields: Any) -> Any:
    return sampling_params(
        decode_json(chat_body(**fields), ChatCompletionRequest), default_max_tokens=99
    )


def completion_params(**fields: Any) -> Any:
    request = decode_json(completion_body(**fields), CompletionRequest)
    return sampling_params(request, default_max_tokens=99)


# --- decoding ------------------------------------------------------------------------------


def test_valid_chat_body_decodes_and_ignores_unknown_fields() -> None:
    body = chat_body(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None, "name": "bot"},
        ],
        stream=True,
        stream_options={"include_usage": True},
        store=True,
        metadata={"k": "v"},
    )
    request = decode_json(body, ChatCompletionRequest)
    assert request.stream
    assert request.stream_options is not None
    assert request.stream_options.include_usage
    assert template_messages(request.messages) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "name": "bot"},
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat_body(max_tokens="ten"), "max_tokens"),
        (chat_body(temperature="hot"), "temperature"),
        (chat_body(stop=[1]), "stop[0]"),
        (chat_body(logit_bias={"5": "high"}), "logit_bias"),
        (chat_body(messages=[{"content": "no role"}]), "messages[0].role"),
        (chat_body(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
        (json.dumps({"model": "m"}).encode(), "messages"),
        (chat_body(top_logprobs=21, logprobs=True), "top_logprobs"),
        (chat_body(stop_token_ids=[-1]), "stop_token_ids[0]"),
        (chat_body(seed=2**64), "seed"),
        (chat_body(n=129), "n"),
    ],
)
def test_wrong_type_names_the_field(body: bytes, param: str) -> None:
    error = protocol_error(body)
    assert error.param == param
    assert param in error.message


@pytest.mark.parametrize("body", [b"{not json", b"", b'{"model": "m",}', b"[1, 2]", b'"text"'])
def test_malformed_or_non_object_body_has_no_param(body: bytes) -> None:
    assert protocol_error(body).param is None


@pytest.mark.parametrize(
    ("type_", "field", "value"),
    [
        (ChatCompletionRequest, "functions", [{"name": "f"}]),
        (ChatCompletionRequest, "function_call", "auto"),
        (ChatCompletionRequest, "modalities", ["text", "audio"]),
        (ChatCompletionRequest, "audio", {"voice": "alloy", "format": "wav"}),
        (CompletionRequest, "best_of", 3),
        (CompletionRequest, "echo", True),
        (CompletionRequest, "suffix", "tail"),
    ],
)
def test_unsupported_semantic_fields_are_rejected(type_: type, field: str, value: Any) -> None:
    body = (chat_body if type_ is ChatCompletionRequest else completion_body)(**{field: value})
    error = protocol_error(body, type_)
    assert error.param == field
    assert error.code == "unsupported_parameter"
    assert "not supported" in error.message


@pytest.mark.parametrize(
    ("type_", "fields"),
    [
        (ChatCompletionRequest, {"tools": [], "tool_choice": "none"}),
        (ChatCompletionRequest, {"response_format": {"type": "text"}, "modalities": ["text"]}),
        (CompletionRequest, {"best_of": 2, "n": 2, "echo": False, "suffix": None}),
        (CompletionRequest, {"n": None, "stream": None, "echo": None, "best_of": 1}),
    ],
)
def test_unsupported_fields_at_their_neutral_value_are_accepted(
    type_: type, fields: dict[str, Any]
) -> None:
    body = (chat_body if type_ is ChatCompletionRequest else completion_body)(**fields)
    decode_json(body, type_)


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "function", "content": "42", "name": "f"}], "messages[0].role"),
        ([{"role": "tool", "content": "42"}], "messages[0].tool_call_id"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            ],
            "messages[1].content[0]",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}],
            "messages[0].tool_calls[0]",
        ),
    ],
)
def test_bad_messages_are_rejected(messages: list[Any], param: str) -> None:
    assert protocol_error(chat_body(messages=messages)).param == param


def test_stream_options_need_stream() -> None:
    error = protocol_error(chat_body(stream_options={"include_usage": True}))
    assert error.param == "stream_options"


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("text", ["text"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_shapes(prompt: Any, expected: list[Any]) -> None:
    assert decode_json(completion_body(prompt=prompt), CompletionRequest).prompts() == expected


@pytest.mark.parametrize(
    ("prompt", "param"),
    [([], "prompt"), (["a", 1], "prompt"), ([[1], []], "prompt[1]"), ([3, -1], "prompt[1]")],
)
def test_bad_completion_prompts_are_rejected(prompt: Any, param: str) -> None:
    assert protocol_error(completion_body(prompt=prompt), CompletionRequest).param == param


def test_tokenize_and_detokenize_requests() -> None:
    by_prompt = decode_json(b'{"prompt": "hi"}', TokenizeRequest)
    by_messages = decode_json(json.dumps({"messages": USER}).encode(), TokenizeRequest)
    assert by_prompt.adds_special_tokens
    assert not by_messages.adds_special_tokens
    explicit = decode_json(b'{"prompt": "hi", "add_special_tokens": false}', TokenizeRequest)
    assert not explicit.adds_special_tokens
    assert protocol_error(b"{}", TokenizeRequest).param == "prompt"
    both = json.dumps({"prompt": "x", "messages": USER}).encode()
    assert protocol_error(both, TokenizeRequest).param == "prompt"
    assert decode_json(b'{"tokens": [1, 2]}', DetokenizeRequest).tokens == [1, 2]
    assert protocol_error(b'{"tokens": [1, "a"]}', DetokenizeRequest).param == "tokens[1]"


# --- SamplingParams ------------------------------------------------------------------------


def test_openai_defaults() -> None:
    params = chat_params()
    assert (params.temperature, params.top_p, params.top_k, params.n) == (1.0, 1.0, 0, 1)
    assert params.max_tokens == 99  # neither max field given: the server's default
    assert params.logprobs is None
    assert completion_params().max_tokens == 16  # OpenAI's completions default
    assert completion_params(max_tokens=None).max_tokens == 99


def test_the_model_s_recommended_sampling_fills_only_unset_fields() -> None:
    model = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "min_p": 0.05}
    request = decode_json(chat_body(), ChatCompletionRequest)
    params = sampling_params(request, default_max_tokens=99, defaults=model)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.2, 0.9, 40, 0.05)
    request = decode_json(chat_body(temperature=0, top_k=-1), ChatCompletionRequest)
    params = sampling_params(request, default_max_tokens=99, defaults=model)
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.9, 0)
    completion = decode_json(completion_body(), CompletionRequest)
    assert sampling_params(completion, default_max_tokens=9, defaults=model).temperature == 0.2
    assert sampling_params(completion, default_max_tokens=9, defaults={"top_k": -1}).top_k == 0


def test_max_completion_tokens_takes_precedence() -> None:
    assert chat_params(max_tokens=5, max_completion_tokens=7).max_tokens == 7
    assert chat_params(max_tokens=5).max_tokens == 5


def test_fields_map_through() -> None:
    params = chat_params(
        temperature=0,
        top_p=0.5,
        top_k=-1,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        seed=7,
        stop_token_ids=[3],
        n=3,
        ignore_eos=True,
        min_tokens=2,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
    )
    assert params.is_greedy
    assert params.n == 3
    assert (params.top_p, params.top_k, params.min_p) == (0.5, 0, 0.1)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert (params.repetition_penalty, params.seed, params.stop_token_ids) == (1.2, 7, (3,))
    assert params.ignore_eos
    assert params.min_tokens == 2
    assert not params.skip_special_tokens
    assert params.include_stop_str_in_output


def test_stop_string_or_list() -> None:
    assert chat_params(stop="\n").stop == ("\n",)
    assert chat_params(stop=["a", "b"]).stop == ("a", "b")
    assert chat_params(stop=None).stop == ()


def test_logit_bias_keys_must_be_integer_strings() -> None:
    assert chat_params(logit_bias={"5": 10, "12": -100}).logit_bias == {5: 10.0, 12: -100.0}
    for key in ("a", "-1", "1.5", " 7"):
        with pytest.raises(ProtocolError) as info:
            chat_params(logit_bias={key: 1})
        assert info.value.param == "logit_bias"
    with pytest.raises(ProtocolError) as info:
        chat_params(logit_bias={"5": 500})
    assert info.value.param == "logit_bias"


def test_logprobs_mapping() -> None:
    assert chat_params(logprobs=True).logprobs == 0
    assert chat_params(logprobs=True, top_logprobs=5).logprobs == 5
    assert chat_params(logprobs=False).logprobs is None
    with pytest.raises(ProtocolError) as info:
        chat_params(top_logprobs=2)
    assert info.value.param == "top_logprobs"
    assert completion_params(logprobs=3).logprobs == 3
    assert completion_params(logprobs=0).logprobs == 0
    assert protocol_error(completion_body(logprobs=6), CompletionRequest).param == "logprobs"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"max_tokens": 2, "min_tokens": 5}, "min_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_out_of_range_values_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ProtocolError) as info:
        chat_params(**fields)
    assert info.value.param == param
    assert info.value.message.startswith(f"{param}=")


# --- responses -----------------------------------------------------------------------------


class FakeTokenizer:
    """Token i is VOCAB[i]; byte-level-BPE-like raw tokens ("Ġ" marks a space)."""

    VOCAB = ("Hello", "Ġworld", "!", "Ġcafé", "\n")

    def convert_ids_to_tokens(self, ids: int) -> str:
        return self.VOCAB[ids]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens).replace("Ġ", " ")


@dataclasses.dataclass
class Output:
    index: int
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


LOGPROBS = [
    TokenLogprob(0, -0.1, ((0, -0.1), (2, -2.5))),
    TokenLogprob(3, -1.5, ((1, -0.9), (3, -1.5))),
]


def parse(struct: msgspec.Struct) -> dict[str, Any]:
    return json.loads(msgspec.json.encode(struct))


def test_chat_response_parses_as_openai_chat_completion() -> None:
    response_id = responses.new_chat_id()
    body = responses.chat_response(
        response_id,
        "tiny",
        1700000000,
        [Output(0, "Hello café", "stop", LOGPROBS), Output(1, "Hello", "length")],
        responses.usage(4, 3),
        tokenizer=FakeTokenizer(),
    )
    parsed = openai.types.chat.ChatCompletion.model_validate(parse(body))
    assert parsed.id.startswith("chatcmpl-")
    assert parsed.object == "chat.completion"
    assert parsed.usage is not None
    assert parsed.usage.total_tokens == 7
    first, second = parsed.choices
    assert first.message.role == "assistant"
    assert first.message.content == "Hello café"
    assert first.finish_reason == "stop"
    assert second.finish_reason == "length"
    assert second.logprobs is None
    assert first.logprobs is not None
    assert first.logprobs.content is not None
    tokens = first.logprobs.content
    assert [t.token for t in tokens] == ["Hello", " café"]
    assert tokens[1].bytes == list(" café".encode())
    assert [(t.token, t.logprob) for t in tokens[1].top_logprobs] == [
        (" world", -0.9),
        (" café", -1.5),
    ]


def test_chat_chunks_parse_as_openai_chunks() -> None:
    first = responses.chat_chunk("chatcmpl-1", "tiny", 1, role="assistant", content="")
    middle = responses.chat_chunk(
        "chatcmpl-1",
        "tiny",
        1,
        index=1,
        content="Hello",
        logprobs=responses.chat_logprobs(LOGPROBS[:1], FakeTokenizer()),
    )
    last = responses.chat_chunk("chatcmpl-1", "tiny", 1, finish_reason="length")
    final = responses.chat_usage_chunk("chatcmpl-1", "tiny", 1, responses.usage(2, 3))
    raw = [parse(chunk) for chunk in (first, middle, last, final)]
    assert raw[2]["choices"][0]["delta"] == {}  # nothing new: an empty delta, as OpenAI sends
    assert raw[0]["usage"] is None
    assert raw[0]["choices"][0]["finish_reason"] is None
    chunks = [openai.types.chat.ChatCompletionChunk.model_validate(item) for item in raw]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].index == 1
    assert chunks[1].choices[0].delta.content == "Hello"
    assert chunks[2].choices[0].finish_reason == "length"
    assert chunks[3].choices == []
    assert chunks[3].usage is not None
    assert chunks[3].usage.completion_tokens == 3


def test_completion_response_and_chunks_parse_as_openai_completion() -> None:
    body = responses.completion_response(
        responses.new_completion_id(),
        "tiny",
        1,
        [Output(0, "Hello café", "length", LOGPROBS)],
        responses.usage(1, 2),
        tokenizer=FakeTokenizer(),
    )
    parsed = openai.types.Completion.model_validate(parse(body))
    assert parsed.id.startswith("cmpl-")
    assert parsed.object == "text_completion"
    logprobs = parsed.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == ["Hello", " café"]
    assert logprobs.token_logprobs == [-0.1, -1.5]
    assert logprobs.text_offset == [0, 5]
    # the sampled token is always listed, so up to N + 1 entries, as OpenAI
    assert logprobs.top_logprobs == [{"Hello": -0.1, "!": -2.5}, {" world": -0.9, " café": -1.5}]
    middle = parse(responses.completion_chunk("cmpl-1", "tiny", 1, index=0, text="a"))
    assert middle["choices"][0]["finish_reason"] is None  # null until the last (as OpenAI)
    assert middle["usage"] is None
    chunk = responses.completion_chunk(
        "cmpl-1",
        "tiny",
        1,
        index=2,
        text="!",
        finish_reason="stop",
        logprobs=responses.completion_logprobs(
            [TokenLogprob(2, -0.3, ())], FakeTokenizer(), text_offset_start=10
        ),
    )
    streamed = openai.types.Completion.model_validate(parse(chunk))
    assert streamed.choices[0].index == 2
    assert streamed.usage is None
    assert streamed.choices[0].logprobs is not None
    assert streamed.choices[0].logprobs.text_offset == [10]
    final = responses.completion_usage_chunk("cmpl-1", "tiny", 1, responses.usage(1, 2))
    assert openai.types.Completion.model_validate(parse(final)).choices == []


def test_logprobs_need_a_tokenizer() -> None:
    with pytest.raises(TypeError):
        responses.chat_response(
            "c", "m", 1, [Output(0, "x", "stop", LOGPROBS)], responses.usage(1, 1)
        )


def test_models_and_tokenize_responses() -> None:
    listing = parse(responses.model_list(["tiny"], created=5))
    assert listing["object"] == "list"
    model = openai.types.Model.model_validate(listing["data"][0])
    assert (model.id, model.object, model.owned_by, model.created) == (
        "tiny",
        "model",
        "brigade",
        5,
    )
    assert parse(responses.TokenizeResponse([1, 2], 2, 128)) == {
        "tokens": [1, 2],
        "count": 2,
        "max_model_len": 128,
    }
    assert parse(responses.DetokenizeResponse("hi")) == {"prompt": "hi"}


def test_sse_framing() -> None:
    event = responses.sse_event(responses.chat_chunk("chatcmpl-1", "m", 1, content="x"))
    assert event.startswith(b"data: {")
    assert event.endswith(b"}\n\n")
    assert json.loads(event.removeprefix(b"data: "))["choices"][0]["delta"] == {"content": "x"}
    assert responses.SSE_DONE == b"data: [DONE]\n\n"


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "status", "type_", "code"),
    [
        (ProtocolError("bad", param="n"), 400, "invalid_request_error", None),
        (AuthenticationError(), 401, "authentication_error", "invalid_api_key"),
        (NotFoundError("no model `x`"), 404, "invalid_request_error", "model_not_found"),
        (RequestTooLargeError(2000, 1000), 413, "invalid_request_error", "request_too_large"),
        (
            RateLimitError("slow", retry_after=1.2, limit="tokens"),
            429,
            "tokens",
            "rate_limit_exceeded",
        ),
        (ServerOverloadedError(), 503, "server_error", "server_overloaded"),
        (InternalServerError(), 500, "server_error", "internal_error"),
    ],
)
def test_error_bodies_have_openai_shape(
    error: APIError, status: int, type_: str, code: str | None
) -> None:
    body = json.loads(error.to_body())
    assert list(body) == ["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    parsed = openai.types.ErrorObject.model_validate(body["error"])
    assert error.status == status
    assert parsed.type == type_
    assert parsed.code == code
    assert parsed.message == error.message


def test_error_headers() -> None:
    assert RateLimitError("x", retry_after=1.2, limit="requests").headers() == {"Retry-After": "2"}
    assert RateLimitError("x", retry_after=0.0, limit="requests").headers() == {"Retry-After": "1"}
    assert ServerOverloadedError().headers() == {}
    assert ServerOverloadedError(retry_after=3).headers() == {"Retry-After": "3"}
    assert AuthenticationError().headers()["WWW-Authenticate"] == "Bearer"
    assert ProtocolError("x").headers() == {}
    assert "2000 bytes" in RequestTooLargeError(2000, 1000).message


def test_a_logprob_of_minus_infinity_is_sent_as_openai_s_floor_not_null() -> None:
    from brigade.engine import TokenLogprob
    from brigade.server.responses import LOGPROB_FLOOR, chat_logprobs, completion_logprobs

    class Tokenizer:
        def convert_ids_to_tokens(self, token_id: int) -> str:
            return f"t{token_id}"

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            return "".join(tokens)

    masked = [TokenLogprob(1, float("-inf"), ((2, float("-inf")), (3, float("nan"))))]
    chat = msgspec.json.decode(msgspec.json.encode(chat_logprobs(masked, Tokenizer())))
    assert chat["content"][0]["logprob"] == LOGPROB_FLOOR
    assert [top["logprob"] for top in chat["content"][0]["top_logprobs"]] == [LOGPROB_FLOOR] * 2
    legacy = completion_logprobs(masked, Tokenizer(), 0)
    assert legacy["token_logprobs"] == [LOGPROB_FLOOR]
    assert set(legacy["top_logprobs"][0].values()) == {LOGPROB_FLOOR}
