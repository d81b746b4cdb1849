"""A decoded generation request as its generation's inputs: the messages the chat template
renders, and the ``SamplingParams`` (the model's recommended defaults filling what the request
leaves unset; a rejected value named by the request's own field)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from brigade.interfaces import SamplingParams
from brigade.server.errors import ProtocolError
from brigade.server.protocol import (
    MAX_TOKEN_ID_DIGITS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)

__all__ = ["sampling_params", "template_messages"]


def sampling_params(
    request: ChatCompletionRequest | CompletionRequest,
    *,
    default_max_tokens: int,
    defaults: Mapping[str, float] | None = None,
) -> SamplingParams:
    """Map a generation request to ``SamplingParams``.

    A field the request leaves unset takes the model's recommendation from ``defaults``
    (temperature, top_p, top_k, min_p, repetition_penalty), else OpenAI's default.
    ``default_max_tokens`` applies when the request sets neither ``max_completion_tokens`` nor
    ``max_tokens`` (the server passes what fits in the context after the prompt).
    """
    model = defaults or {}
    max_tokens_field, max_tokens = _max_tokens(request)
    logprobs_field, num_logprobs = _logprobs(request)
    stop = request.stop
    try:
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=_default(request.temperature, model.get("temperature", 1.0)),
            top_p=_default(request.top_p, model.get("top_p", 1.0)),
            top_k=_top_k(request.top_k, model.get("top_k", 0)),
            min_p=_default(request.min_p, model.get("min_p", 0.0)),
            presence_penalty=_default(request.presence_penalty, 0.0),
            frequency_penalty=_default(request.frequency_penalty, 0.0),
            repetition_penalty=_default(
                request.repetition_penalty, model.get("repetition_penalty", 1.0)
            ),
            logit_bias=_logit_bias(request.logit_bias),
            seed=request.seed,
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens,
            logprobs=num_logprobs,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            n=1 if request.n is None else request.n,
            structured_output=request.structured_output(),
        )
    except ValueError as exc:
        raise _request_error(
            exc,
            {
                "max_tokens": max_tokens_field,
                "logprobs": logprobs_field,
                "structured_output": "response_format",
            },
        ) from None


def _max_tokens(request: ChatCompletionRequest | CompletionRequest) -> tuple[str, int | None]:
    """The request's token limit and the field that set it (a chat request's
    ``max_completion_tokens`` wins over its deprecated ``max_tokens``)."""
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return "max_completion_tokens", request.max_completion_tokens
    return "max_tokens", request.max_tokens


def _logprobs(request: ChatCompletionRequest | CompletionRequest) -> tuple[str, int | None]:
    """How many top log-probabilities the request asks for (None: none at all), and the
    field that says so: a chat request's ``top_logprobs``, a completion's ``logprobs``."""
    if not isinstance(request, ChatCompletionRequest):
        return "logprobs", request.logprobs
    if request.top_logprobs and not request.logprobs:
        raise ProtocolError("top_logprobs requires logprobs: true.", param="top_logprobs")
    return "top_logprobs", (request.top_logprobs or 0) if request.logprobs else None


def _request_error(exc: ValueError, renamed_fields: Mapping[str, str]) -> ProtocolError:
    """``SamplingParams``' complaint about a value, naming the request's field that set it."""
    message = str(exc).removeprefix("sampling parameter ")
    name = re.match(r"\w+", message)
    field = name[0] if name else None
    renamed = renamed_fields.get(field or "")
    if renamed is not None and field is not None:
        message = renamed + message[len(field) :]
    return ProtocolError(f"{message}.", param=renamed or field)


def _top_k(value: int | None, default: float) -> int:
    """-1 and 0 both mean off, in a request and in a model's recommendation."""
    chosen = int(default) if value is None else value
    return 0 if chosen == -1 else chosen


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    for key in bias:
        if not (key.isascii() and key.isdigit()):
            raise ProtocolError(
                f'logit_bias keys must be token ids written as integer strings (e.g. "42"); '
                f"got {key[:40]!r}.",
                param="logit_bias",
            )
        if len(key.lstrip("0")) > MAX_TOKEN_ID_DIGITS:
            raise ProtocolError(
                f"logit_bias key {key[:24]}... is no token id of this model's vocabulary.",
                param="logit_bias",
            )
    return {int(key): value for key, value in bias.items()}


def _default(value: float | None, default: float) -> float:
    return default if value is None else value


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the plain dicts a chat template reads: role, content, name, tool calls.

    A ``developer`` message becomes a ``system`` one: OpenAI's new name for the same turn,
    which chat templates do not know. Tool-call arguments arrive as JSON text and are handed
    to the template parsed (the Hugging Face convention).
    """
    out = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        item: dict[str, Any] = {"role": role, "content": message.text()}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": call.get("id"),
                    "type": "function",
                    "function": {
                        "name": call["function"]["name"],
                        "arguments": _json_or_text(call["function"].get("arguments", "{}")),
                    },
                }
                for call in message.tool_calls
            ]
        out.append(item)
    return out


def _json_or_text(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
