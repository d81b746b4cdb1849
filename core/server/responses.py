"""The OpenAI wire protocol, response side: structs, builders, logprob formatting, SSE framing.

The structs encode (``msgspec.json.encode``) to exactly the JSON of OpenAI's schema, which the
official ``openai`` package's types parse. Fields OpenAI sends as null (``logprobs``,
``finish_reason`` of a chunk, ``usage`` of a chunk) are sent as null, not left out.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import msgspec

from brigade.server.tools import parse_tool_calls, tool_call_dicts

if TYPE_CHECKING:  # brigade.engine imports torch; the wire protocol does not need it
    from brigade.engine import TokenLogprob

__all__ = [
    "LOGPROB_FLOOR",
    "SSE_DONE",
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatLogprobs",
    "ChatMessageOut",
    "ChatTokenLogprob",
    "ChoiceOutput",
    "Completion",
    "CompletionChoice",
    "CompletionLogprobs",
    "Delta",
    "DetokenizeResponse",
    "ModelCard",
    "ModelList",
    "TokenizeResponse",
    "TokenizerLike",
    "TopLogprob",
    "Usage",
    "chat_chunk",
    "chat_logprobs",
    "chat_response",
    "chat_usage_chunk",
    "completion_chunk",
    "completion_logprobs",
    "completion_response",
    "completion_usage_chunk",
    "model_list",
    "new_chat_id",
    "new_completion_id",
    "sse_event",
    "usage",
]

SSE_DONE = b"data: [DONE]\n\n"
"""The last Server-Sent Event of every stream."""
LOGPROB_FLOOR = -9999.0
"""What a token its constraints exclude (log probability -inf) shows, as OpenAI does: JSON
has no -inf, and null would break the schema."""


class TokenizerLike(Protocol):
    """The two tokenizer methods logprob formatting needs (a transformers tokenizer has both)."""

    def convert_ids_to_tokens(self, ids: int) -> str: ...
    def convert_tokens_to_string(self, tokens: list[str]) -> str: ...


class ChoiceOutput(Protocol):
    """What a builder reads from one generated choice (``brigade.llm.CompletionOutput`` and
    the server frontend's ``ChoiceDelta`` both fit)."""

    @property
    def index(self) -> int: ...
    @property
    def text(self) -> str: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def logprobs(self) -> Sequence[TokenLogprob | None] | None: ...


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(TypedDict):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    """The top-N alternatives and the sampled token (so up to N + 1 entries, as OpenAI)."""
    text_offset: list[int]


class ChatMessageOut(msgspec.Struct, omit_defaults=True):
    content: str | None
    """Null when the answer is only tool calls (sent as null, as OpenAI does)."""
    role: str
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    """'stop', 'length', 'tool_calls', or 'abort' (Brigade's: the request was cancelled)."""


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(msgspec.Struct, kw_only=True):
    """A completions response, and also each of its streaming chunks (same object type)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "brigade"


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(msgspec.Struct):
    prompt: str


def new_chat_id() -> str:
    """A fresh chat completion id, ``chatcmpl-<32 hex digits>``."""
    return f"chatcmpl-{uuid.uuid4().hex}"


def new_completion_id() -> str:
    """A fresh completion id, ``cmpl-<32 hex digits>``."""
    return f"cmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    """Token counts of a response (completion tokens summed over its choices)."""
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


def chat_response(
    response_id: str,
    model: str,
    created: int,
    outputs: Sequence[ChoiceOutput],
    usage: Usage,
    *,
    tokenizer: TokenizerLike | None = None,
    tool_calls: bool = False,
) -> ChatCompletion:
    """A whole chat completion; ``tokenizer`` is needed when an output carries logprobs.

    With ``tool_calls``, each answer's ``<tool_call>`` blocks become the message's
    ``tool_calls`` (finish reason ``tool_calls``) and the rest its content.
    """
    choices = []
    for output in outputs:
        message = ChatMessageOut(output.text, "assistant")
        finish_reason = output.finish_reason
        if tool_calls:
            content, calls = parse_tool_calls(output.text)
            message = ChatMessageOut(content, "assistant", tool_call_dicts(calls) or None)
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        logprobs = output.logprobs
        choices.append(
            ChatChoice(
                output.index,
                message,
                None if logprobs is None else chat_logprobs(logprobs, _need(tokenizer)),
                finish_reason,
            )
        )
    return ChatCompletion(
        id=response_id, created=created, model=model, choices=choices, usage=usage
    )


def chat_chunk(
    response_id: str,
    model: str,
    created: int,
    *,
    index: int = 0,
    role: str | None = None,
    content: str | None = None,
    logprobs: ChatLogprobs | None = None,
    finish_reason: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> ChatCompletionChunk:
    """One streaming chunk of one choice; the first of a choice sets ``role='assistant'``."""
    choice = ChatChunkChoice(index, Delta(role, content, tool_calls), logprobs, finish_reason)
    return ChatCompletionChunk(id=response_id, created=created, model=model, choices=[choice])


def chat_usage_chunk(
    response_id: str, model: str, created: int, usage: Usage
) -> ChatCompletionChunk:
    """The last chunk when ``stream_options.include_usage``: usage, and no choices."""
    return ChatCompletionChunk(
        id=response_id, created=created, model=model, choices=[], usage=usage
    )


def completion_response(
    response_id: str,
    model: str,
    created: int,
    outputs: Sequence[ChoiceOutput],
    usage: Usage,
    *,
    tokenizer: TokenizerLike | None = None,
) -> Completion:
    """A whole completions response; a batch numbers its choices prompt * n + child."""
    choices = [
        CompletionChoice(
            output.index,
            output.text,
            None
            if output.logprobs is None
            else completion_logprobs(output.logprobs, _need(tokenizer), 0),
            output.finish_reason,
        )
        for output in outputs
    ]
    return Completion(id=response_id, created=created, model=model, choices=choices, usage=usage)


def completion_chunk(
    response_id: str,
    model: str,
    created: int,
    *,
    index: int,
    text: str,
    logprobs: CompletionLogprobs | None = None,
    finish_reason: str | None = None,
) -> Completion:
    """One streaming chunk of one choice."""
    choice = CompletionChoice(index, text, logprobs, finish_reason)
    return Completion(id=response_id, created=created, model=model, choices=[choice])


def completion_usage_chunk(response_id: str, model: str, created: int, usage: Usage) -> Completion:
    """The last chunk when ``stream_options.include_usage``: usage, and no choices."""
    return Completion(id=response_id, created=created, model=model, choices=[], usage=usage)


def model_list(model_ids: Sequence[str], *, created: int) -> ModelList:
    """``GET /v1/models``: one card per served model name."""
    return ModelList(data=[ModelCard(id=model_id, created=created) for model_id in model_ids])


def sse_event(payload: msgspec.Struct) -> bytes:
    """One Server-Sent Event carrying ``payload`` as JSON."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def chat_logprobs(
    token_logprobs: Sequence[TokenLogprob | None], tokenizer: TokenizerLike
) -> ChatLogprobs:
    """OpenAI chat logprobs: each sampled token with its top alternatives (None entries skipped)."""
    texts: dict[int, str] = {}
    content: list[ChatTokenLogprob] = []
    for entry in token_logprobs:
        if entry is None:
            continue
        token = _token_text(tokenizer, entry.token_id, texts)
        top: list[TopLogprob] = []
        for token_id, logprob in entry.top:
            text = _token_text(tokenizer, token_id, texts)
            top.append({"token": text, "logprob": _floor(logprob), "bytes": list(text.encode())})
        content.append(
            {
                "token": token,
                "logprob": _floor(entry.logprob),
                "bytes": list(token.encode()),
                "top_logprobs": top,
            }
        )
    return {"content": content}


def completion_logprobs(
    token_logprobs: Sequence[TokenLogprob | None],
    tokenizer: TokenizerLike,
    text_offset_start: int,
) -> CompletionLogprobs:
    """Legacy completions logprobs; ``text_offset`` counts characters of the choice's text
    from ``text_offset_start`` (the length of the text already sent, when streaming)."""
    texts: dict[int, str] = {}
    result: CompletionLogprobs = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    offset = text_offset_start
    for entry in token_logprobs:
        if entry is None:
            continue
        token = _token_text(tokenizer, entry.token_id, texts)
        top = {_token_text(tokenizer, token_id, texts): _floor(lp) for token_id, lp in entry.top}
        top.setdefault(token, _floor(entry.logprob))
        result["tokens"].append(token)
        result["token_logprobs"].append(_floor(entry.logprob))
        result["top_logprobs"].append(top)
        result["text_offset"].append(offset)
        offset += len(token)
    return result


def _token_text(tokenizer: TokenizerLike, token_id: int, cache: dict[int, str]) -> str:
    """The text of one token on its own (a partial UTF-8 character shows as U+FFFD)."""
    text = cache.get(token_id)
    if text is None:
        text = tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token_id)])
        cache[token_id] = text
    return text


def _floor(logprob: float) -> float:
    """``logprob``, or :data:`LOGPROB_FLOOR` for -inf (and NaN, which fails every comparison)."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _need(tokenizer: TokenizerLike | None) -> TokenizerLike:
    if tokenizer is None:
        raise TypeError("formatting logprobs needs the tokenizer")
    return tokenizer
