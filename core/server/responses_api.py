"""OpenAI's Responses API (``POST /v1/responses``) on the chat pipeline.

A request is translated into a chat completion request (``instructions`` and ``input`` into
messages, function tools into chat tools, ``text.format`` into ``response_format``,
``max_output_tokens`` into ``max_completion_tokens``), so it is checked, admitted, constrained
and generated exactly as chat is; the answer is shaped as a ``response`` object (message and
``function_call`` output items), or streamed as the Responses API's typed events
(``response.created`` ... ``response.completed``). Nothing is stored: ``previous_response_id``,
``conversation``, ``background`` and server-side tools are refused with a 400 naming them.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.response import Stream

from brigade.output import ChoiceDelta
from brigade.server import protocol as proto
from brigade.server import streaming
from brigade.server.errors import APIError, ProtocolError
from brigade.server.generation import ChatRun, start_chat
from brigade.server.state import ServerState, json_response
from brigade.server.tools import ToolCall, ToolCallStream, parse_tool_calls

__all__ = ["ResponsesRequest", "create_response"]

_PARAMS = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
}
"""Chat fields -> the Responses fields they came from (for error messages' ``param``)."""
_REFUSED = {
    "previous_response_id": "stored responses (nothing is stored: send the whole input)",
    "conversation": "stored conversations",
    "background": "background responses",
    "prompt": "stored prompt templates",
    "top_logprobs": "log probabilities in the Responses API (use chat completions)",
}


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """Body of ``POST /v1/responses`` (the fields Brigade reads; others are ignored)."""

    input: str | list[Any]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: Any = None
    stream: bool | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    top_logprobs: int | None = None

    def __post_init__(self) -> None:
        for name, feature in _REFUSED.items():
            if getattr(self, name) not in (None, False, 0):
                raise ProtocolError(
                    f"{name} is not supported by this server ({feature}).",
                    param=name,
                    code="unsupported_parameter",
                )

    def chat_request(self) -> proto.ChatCompletionRequest:
        """The chat completion request this one asks for (validated as chat is)."""
        body: dict[str, Any] = {"model": self.model, "messages": self._messages()}
        for name in ("temperature", "top_p", "parallel_tool_calls", "user"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        format_ = _text_format(self.text)
        if format_ is not None:
            body["response_format"] = format_
        try:
            return msgspec.convert(body, proto.ChatCompletionRequest)
        except ProtocolError as exc:
            raise ProtocolError(
                str(exc).replace("messages", "input"),
                param=_PARAMS.get(exc.param or "", exc.param),
            ) from None
        except msgspec.ValidationError as exc:
            error = ProtocolError.from_decode_error(exc)
            param = _PARAMS.get(error.param or "", error.param)
            raise ProtocolError(str(error), param=param) from None

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for index, item in enumerate(self.input):
            messages.extend(_input_item(item, f"input[{index}]", messages))
        return messages


def _input_item(item: Any, at: str, before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat message(s) of one input item (a message, a function call or its output)."""
    if not isinstance(item, dict):
        raise ProtocolError(f"{at} must be an object.", param=at)
    kind = item.get("type", "message")
    if kind == "message":
        return [{"role": item.get("role"), "content": _text(item.get("content"), at)}]
    if kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
        }
        last = before[-1] if before else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
            last["tool_calls"].append(call)  # parallel calls: one assistant turn
            return []
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]
    if kind == "function_call_output":
        output = item.get("output")
        content = output if isinstance(output, str) else _text(output, at)
        return [{"role": "tool", "tool_call_id": item.get("call_id"), "content": content}]
    raise ProtocolError(
        f"{at}: input items of type {kind!r} are not supported (message, function_call, "
        "function_call_output).",
        param=at,
    )


def _text(content: Any, at: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in (
                "input_text",
                "output_text",
                "text",
            ):
                raise ProtocolError(
                    f"{at}: only text content is supported (input_text, output_text).",
                    param=f"{at}.content",
                )
            parts.append(str(part.get("text", "")))
        return "\n".join(parts)
    raise ProtocolError(f"{at}.content must be a string or a list of parts.", param=at)


def _chat_tool(tool: Any, index: int) -> dict[str, Any]:
    at = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise ProtocolError(
            f"{at}: only function tools are supported, not {kind!r}.",
            param=at,
            code="unsupported_parameter",
        )
    function = {"name": tool.get("name")}
    for key in ("description", "parameters"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _text_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ProtocolError("text.format must be an object.", param="text.format")
    if fmt.get("type") == "json_schema":
        schema = {"name": fmt.get("name", "response"), "schema": fmt.get("schema")}
        return {"type": "json_schema", "json_schema": schema}
    return {key: value for key, value in fmt.items() if key != "strict"}


# -- the response -------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _call_item(item_id: str, call: ToolCall, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def _response(
    body: ResponsesRequest,
    response_id: str,
    created: float,
    model: str,
    output: list[dict[str, Any]],
    *,
    status: str,
    usage: Mapping[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": status,
        "output": output,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": body.tools or [],
        "text": body.text or {"format": {"type": "text"}},
        "usage": usage,
    }


def _usage(prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


async def create_response(
    state: ServerState, request: Request[Any, Any, Any], body: ResponsesRequest
) -> Response[Any] | Stream:
    """Answer a decoded Responses request, whole or as its event stream."""
    chat = body.chat_request()
    try:
        run = await start_chat(state, request, chat)
    except ProtocolError as exc:  # name the Responses field, not the chat one it became
        param = _PARAMS.get(exc.param or "", exc.param)
        if param == exc.param:
            raise
        message = str(exc).replace(exc.param or "", param or "")
        raise ProtocolError(message, param=param, code=exc.code) from None
    response_id = _new_id("resp")
    created = time.time()
    if body.stream:
        events = _events(body, run, response_id, created, state.model_name)
        return Stream(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    (collected,) = await streaming.collect(run.deltas, want_logprobs=False)
    if collected.error is not None:
        raise collected.error
    status = _status(collected.finish_reason)
    text, calls = collected.text, list[ToolCall]()
    if run.calls_tools:
        content, calls = parse_tool_calls(text)
        text = content or ""
    output = []
    if text:
        output.append(_message_item(_new_id("msg"), text, status))
    output.extend(_call_item(_new_id("fc"), call, "completed") for call in calls)
    usage = _usage(len(run.prompt), collected.num_tokens)
    return json_response(
        _response(body, response_id, created, state.model_name, output, status=status, usage=usage)
    )


async def _events(
    body: ResponsesRequest, run: ChatRun, response_id: str, created: float, model: str
) -> AsyncGenerator[bytes, None]:
    """The Responses API's stream: typed events with sequence numbers, then the whole
    response in ``response.completed`` (``response.incomplete`` when cut by length)."""
    event = _EventWriter()
    response = functools.partial(_response, body, response_id, created, model)
    shell = response([], status="in_progress", usage=None)
    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)
    output: list[dict[str, Any]] = []
    parser = ToolCallStream() if run.calls_tools else None
    message: dict[str, Any] | None = None
    text = ""
    num_tokens = 0
    finish: str | None = None
    async for delta in _deltas_until_failure(run.deltas):
        if isinstance(delta, APIError):  # the request failed, or the server stopped it
            failed = response(output, status="failed", usage=None)
            failed["error"] = {"code": "server_error", "message": delta.message}
            yield event("response.failed", response=failed)
            return
        num_tokens += len(delta.token_ids)
        finish = delta.finish_reason or finish
        content, calls = _split(parser, delta)
        if content:
            if message is None:
                message = _message_item(_new_id("msg"), "", "in_progress")
                message["content"] = []
                for opening in _open_message(event, message, len(output)):
                    yield opening
            text += content
            yield event(
                "response.output_text.delta",
                item_id=message["id"],
                output_index=len(output),
                content_index=0,
                delta=content,
                logprobs=[],
            )
        for call in calls:
            if message is not None:  # text before a call: close the message first
                for closing in _close_message(event, message, len(output), text):
                    yield closing
                output.append(_message_item(message["id"], text, "completed"))
                message, text = None, ""
            item_id = _new_id("fc")
            for call_event in _call_events(event, item_id, call, len(output)):
                yield call_event
            output.append(_call_item(item_id, call, "completed"))
    status = _status(finish)
    if message is not None:
        for closing in _close_message(event, message, len(output), text, status):
            yield closing
        output.append(_message_item(message["id"], text, status))
    final = response(output, status=status, usage=_usage(len(run.prompt), num_tokens))
    yield event(
        "response.incomplete" if status == "incomplete" else "response.completed", response=final
    )


class _EventWriter:
    """Encodes the stream's typed events as SSE, numbering them in the order written."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + msgspec.json.encode(payload) + b"\n\n"


async def _deltas_until_failure(
    deltas: AsyncGenerator[ChoiceDelta, None],
) -> AsyncGenerator[ChoiceDelta | APIError, None]:
    """``deltas`` up to the first failure the client must hear of, which comes last, as an
    error: a choice's or the server's stop (``streaming.delta_failure``), or the request's
    as a whole (the engine died, a forced stop), never a stream cut without a word."""
    try:
        async with aclosing(deltas):
            async for delta in deltas:
                failure = streaming.delta_failure(delta)
                if failure is not None:
                    yield failure
                    return
                yield delta
    except Exception as exc:
        yield streaming.client_error(exc)


def _split(parser: ToolCallStream | None, delta: ChoiceDelta) -> tuple[str, list[ToolCall]]:
    if parser is None:
        return delta.text, []
    return parser.feed(delta.text, final=delta.finish_reason is not None)


def _open_message(event: _EventWriter, message: dict[str, Any], index: int) -> list[bytes]:
    """The events that start output item ``index``, an assistant message, and its text part."""
    return [
        event("response.output_item.added", output_index=index, item=message),
        event(
            "response.content_part.added",
            item_id=message["id"],
            output_index=index,
            content_index=0,
            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
        ),
    ]


def _call_events(event: _EventWriter, item_id: str, call: ToolCall, index: int) -> list[bytes]:
    """The events of output item ``index``, a whole function call: added, its arguments in
    one delta, done."""
    item = _call_item(item_id, call, "in_progress")
    item["arguments"] = ""
    return [
        event("response.output_item.added", output_index=index, item=item),
        event(
            "response.function_call_arguments.delta",
            item_id=item_id,
            output_index=index,
            delta=call.arguments,
        ),
        event(
            "response.function_call_arguments.done",
            item_id=item_id,
            output_index=index,
            name=call.name,
            arguments=call.arguments,
        ),
        event(
            "response.output_item.done",
            output_index=index,
            item=_call_item(item_id, call, "completed"),
        ),
    ]


def _close_message(
    event: _EventWriter, message: dict[str, Any], index: int, text: str, status: str = "completed"
) -> list[bytes]:
    """The events that end output item ``index``, an assistant message of ``text``."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return [
        event(
            "response.output_text.done",
            item_id=message["id"],
            output_index=index,
            content_index=0,
            text=text,
            logprobs=[],
        ),
        event(
            "response.content_part.done",
            item_id=message["id"],
            output_index=index,
            content_index=0,
            part=part,
        ),
        event(
            "response.output_item.done",
            output_index=index,
            item=_message_item(message["id"], text, status),
        ),
    ]
