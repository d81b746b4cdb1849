"""The two generation endpoints' work once their body is decoded: the prompt (tokenized off
the event loop), admission, the grammar, the engine's first answer, then the response or the
stream."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

from litestar import Request, Response
from litestar.response import Stream

from brigade.admission import Admission
from brigade.errors import RequestError
from brigade.interfaces import SamplingParams
from brigade.models.tokenizer_loading import render_chat_prompt
from brigade.output import ChoiceDelta
from brigade.server import protocol as proto
from brigade.server import responses as out
from brigade.server import streaming
from brigade.server.errors import (
    APIError,
    InternalServerError,
    ProtocolError,
    ServerOverloadedError,
    api_error,
)
from brigade.server.generation_inputs import sampling_params, template_messages
from brigade.server.guards import charge_rate_limit, check_batch_size, check_context
from brigade.server.state import ServerState, json_response

__all__ = ["ChatRun", "chat_completion", "chat_prompt", "completion", "encode_text", "start_chat"]


@dataclasses.dataclass(frozen=True, slots=True)
class ChatRun:
    """A chat request admitted and started: its prompt, its parameters and its deltas."""

    prompt: list[int]
    params: SamplingParams
    deltas: AsyncGenerator[ChoiceDelta, None]
    calls_tools: bool
    """The answer may hold ``<tool_call>`` blocks (the request has tools)."""
    response_id: str


async def start_chat(
    state: ServerState, request: Request[Any, Any, Any], body: proto.ChatCompletionRequest
) -> ChatRun:
    """Render, admit and start a decoded chat request (for chat completions and for the
    Responses API); errors are HTTP errors, raised before any token is generated."""
    prompt = await state.run_blocking(
        chat_prompt,
        state,
        body.messages,
        body.add_generation_prompt,
        body.tools,
        body.template_kwargs(),
    )
    params = sampling_params(
        body,
        default_max_tokens=max(1, state.max_model_len - len(prompt)),
        defaults=state.async_engine.info.sampling_defaults,
    )
    calls_tools = body.tool_choice_spec() is not None
    grammar_param = "tools" if calls_tools else body.grammar_param()
    admission = _admission(
        state, prompt, params, prompt_param="messages", grammar_param=grammar_param
    )
    if body.max_completion_tokens is not None:
        check_context(len(prompt), params, state.max_model_len, "max_completion_tokens")
    elif body.max_tokens is not None:
        check_context(len(prompt), params, state.max_model_len, "max_tokens")
    _charge(state, request, [prompt], params)
    await _await_grammar(state, [admission], grammar_param)
    response_id = out.new_chat_id()
    deltas = await _first_output(
        state,
        [admission],
        state.frontend.generate(
            response_id, admission, priority=body.priority or 0, extra=body.extra()
        ),
        prompt_param="messages",
        grammar_param=grammar_param,
    )
    return ChatRun(prompt, params, deltas, calls_tools, response_id)


async def chat_completion(
    state: ServerState, request: Request[Any, Any, Any], body: proto.ChatCompletionRequest
) -> Response[out.ChatCompletion] | Stream:
    """Answer a decoded chat request: a ``chat.completion``, or the SSE stream of its chunks."""
    run = await start_chat(state, request, body)
    prompt, params, deltas, calls_tools = run.prompt, run.params, run.deltas, run.calls_tools
    response_id = run.response_id
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
    return json_response(
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


async def completion(
    state: ServerState, request: Request[Any, Any, Any], body: proto.CompletionRequest
) -> Response[out.Completion] | Stream:
    """Answer a decoded completions request (one prompt or a batch): a ``text_completion``,
    or the SSE stream of its chunks."""
    texts = body.prompts()
    check_batch_size(len(texts), state.settings)
    prompts = await state.run_blocking(_encode_prompts, state, texts, body.add_special_tokens)
    longest = max(len(p) for p in prompts)
    params = sampling_params(
        body,
        default_max_tokens=max(1, state.max_model_len - longest),  # an explicit null
        defaults=state.async_engine.info.sampling_defaults,
    )
    admissions = _admit_prompts(state, body, prompts, params)
    _charge(state, request, prompts, params)
    await _await_grammar(state, admissions, body.grammar_param())
    response_id = out.new_completion_id()
    deltas = await _first_output(
        state,
        admissions,
        _generate_all(state, body, admissions, response_id, params.n),
        prompt_param="prompt",
        grammar_param=body.grammar_param(),
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
    return json_response(
        out.completion_response(
            response_id,
            state.model_name,
            int(time.time()),
            collected,
            usage,
            tokenizer=state.tokenizer,
        )
    )


def _admit_prompts(
    state: ServerState,
    body: proto.CompletionRequest,
    prompts: Sequence[list[int]],
    params: SamplingParams,
) -> list[Admission]:
    """Admit each prompt of a batch in turn; the first one refused, or too long for an
    explicit ``max_tokens``, fails the request naming its index."""
    admissions = []
    for index, prompt in enumerate(prompts):
        admissions.append(
            _admission(
                state,
                prompt,
                params,
                prompt_param="prompt",
                grammar_param=body.grammar_param(),
                index=index,
            )
        )
        if body.max_tokens is not None:
            check_context(len(prompt), params, state.max_model_len, "max_tokens")
    return admissions


def _generate_all(
    state: ServerState,
    body: proto.CompletionRequest,
    admissions: Sequence[Admission],
    response_id: str,
    n: int,
) -> AsyncGenerator[ChoiceDelta, None]:
    """The deltas of every prompt's ``n`` choices, as one stream; prompt ``i``'s choices are
    numbered from ``i * n``."""
    priority = body.priority or 0
    return streaming.merge(
        [
            state.frontend.generate(
                f"{response_id}-{i}",
                admission,
                priority=priority,
                index_offset=i * n,
                extra=body.extra(),
            )
            for i, admission in enumerate(admissions)
        ]
    )


def _sse(events: AsyncGenerator[bytes, None]) -> Stream:
    return Stream(
        events,
        status_code=200,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


def chat_prompt(
    state: ServerState,
    messages: Sequence[Any],
    generation_prompt: bool,
    tools: Any,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """The conversation through the chat template (runs on the tokenizer threads);
    ``template_kwargs`` are the request's extra template arguments."""
    try:
        return render_chat_prompt(
            state.tokenizer,
            template_messages(messages),
            tools=tools or None,
            add_generation_prompt=generation_prompt,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # a template may reject a conversation (role order, ...)
        raise ProtocolError(_template_error(exc), param="messages") from None


def _template_error(exc: Exception) -> str:
    """What the template said, when it said it on purpose (jinja's raise_exception); a
    template that crashed gets no internals in the answer."""
    import jinja2

    if isinstance(exc, jinja2.TemplateError) and str(exc):
        return f"the chat template rejected the messages: {exc}"
    return (
        "the chat template could not render these messages (check the roles, their order and "
        "the tool calls)"
    )


def encode_text(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    return [int(t) for t in state.tokenizer.encode(text, add_special_tokens=add_special_tokens)]


def _encode_prompts(
    state: ServerState, prompts: Sequence[str | list[int]], add_special_tokens: bool = True
) -> list[list[int]]:
    """Token ids of each prompt (text is encoded; runs on the tokenizer threads)."""
    return [
        encode_text(state, p, add_special_tokens) if isinstance(p, str) else list(p)
        for p in prompts
    ]


def _admission(
    state: ServerState,
    prompt: list[int],
    params: SamplingParams,
    *,
    prompt_param: str,
    grammar_param: str,
    index: int | None = None,
) -> Admission:
    """The engine's admission of one prompt (checked, its grammar compiling), or a 400
    naming the field (``prompt_param`` for the prompt, ``grammar_param`` for the grammar; a
    batch's message names the prompt's ``index``)."""
    try:
        return state.async_engine.admit(prompt, params)
    except RequestError as exc:
        param = {None: prompt_param, "prompt": prompt_param, "structured_output": grammar_param}
        message = str(exc) if index is None else f"prompt {index}: {exc}"
        raise ProtocolError(message, param=param.get(exc.param, exc.param)) from None


def _charge(
    state: ServerState,
    request: Request[Any, Any, Any],
    prompts: Sequence[list[int]],
    params: SamplingParams,
) -> None:
    """Refuse when stopping or when the queue is full, else charge the rate limiter
    (prompts + requested tokens)."""
    if state.shutting_down:
        raise ServerOverloadedError("The server is shutting down.")
    state.async_engine.check_capacity(len(prompts))
    budget = params.max_tokens * params.n * len(prompts)
    charge_rate_limit(request, state.limiter, state.settings, prompts, budget)


async def _await_grammar(state: ServerState, admissions: Sequence[Admission], param: str) -> None:
    """Wait for the grammar the admission started compiling (off the engine's step loop):
    an invalid one is a 400 naming ``param``, before any token is generated."""
    spec = admissions[0].params.structured_output
    if spec is None or admissions[0].grammar is None:  # none, or compiled by the engine process
        return
    started = time.monotonic()
    try:
        for admission in admissions:
            if admission.grammar is not None:
                await asyncio.wrap_future(admission.grammar)
    except ValueError as exc:
        state.metrics.observe_grammar(spec.kind, time.monotonic() - started, valid=False)
        raise ProtocolError(str(exc), param=param) from None
    state.metrics.observe_grammar(spec.kind, time.monotonic() - started, valid=True)


async def _first_output(
    state: ServerState,
    admissions: Sequence[Admission],
    stream: AsyncGenerator[ChoiceDelta, None],
    *,
    prompt_param: str,
    grammar_param: str,
) -> AsyncGenerator[ChoiceDelta, None]:
    """:func:`_first`, counting the request's grammar when it compiles in the engine process
    (there the first output is where an invalid one shows; the wait is not observed)."""
    spec = admissions[0].params.structured_output
    if spec is None or admissions[0].grammar is not None:  # none, or _await_grammar's
        return await _first(stream, prompt_param=prompt_param, grammar_param=grammar_param)
    try:
        deltas = await _first(stream, prompt_param=prompt_param, grammar_param=grammar_param)
    except APIError as error:
        if error.param == grammar_param:
            state.metrics.observe_grammar(spec.kind, None, valid=False)
        raise
    state.metrics.observe_grammar(spec.kind, None, valid=True)
    return deltas


async def _first(
    stream: AsyncGenerator[ChoiceDelta, None], *, prompt_param: str, grammar_param: str
) -> AsyncGenerator[ChoiceDelta, None]:
    """Wait for the first output, so a refused request becomes an HTTP error, not a stream.

    When every choice fails before its first token, the request is answered with the first
    choice's error (400 when the request is invalid, 500 naming the plugin that failed).
    """
    failed: list[ChoiceDelta] = []
    try:
        while True:
            delta = await anext(stream)
            if delta.error is None:
                break
            failed.append(delta)
    except StopAsyncIteration:
        if failed and failed[0].error is not None:
            error = api_error(failed[0].error) or InternalServerError()
            if error.param == "prompt":
                error.param = prompt_param
            elif error.param == "structured_output":  # compiled in the engine process
                error.param = grammar_param
            raise error from None
        raise InternalServerError("The engine produced no output.") from None
    except BaseException:
        await stream.aclose()
        raise
    return streaming.prepend([*failed, delta], stream)
