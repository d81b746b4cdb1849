"""The OpenAI wire protocol, request side: msgspec structs, body decoding and validation.

Unknown fields are ignored, as OpenAI does. Known fields that would change what is generated
but that Brigade does not implement (``functions``, ``best_of``, ``echo``, ``suffix``, image or
audio content, ...) are rejected with a 400 naming the field, rather than silently ignored.
Every check raises ``ProtocolError`` with ``param`` set to the field's path (``max_tokens``,
``messages[0].content``). The grammar a request asks for is chosen in ``structured_request``;
a decoded request becomes ``SamplingParams`` in ``generation_inputs``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypeVar

import msgspec

from brigade.interfaces import ExtraValue, StructuredOutput, freeze_extra
from brigade.server.errors import ErrorResponse, ProtocolError
from brigade.server.structured_request import one_grammar, response_format_grammar, vllm_grammar
from brigade.server.tools import ToolChoice, parse_tools

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "DetokenizeRequest",
    "ErrorResponse",
    "StreamOptions",
    "TokenizeRequest",
    "decode_json",
]

T = TypeVar("T")
TokenId = Annotated[int, msgspec.Meta(ge=0)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
"""A 64-bit seed, as OpenAI's; torch generators take no more (choice i of n uses seed + i)."""
MAX_N = 128
"""Most choices per prompt (OpenAI's limit), so one request cannot flood the engine."""
ROLES = ("system", "developer", "user", "assistant", "tool")
"""Message roles we accept (``function`` messages belong to the deprecated functions API)."""
MAX_DEPTH = 64
"""Arrays and objects nested deeper than this anywhere in a request body are refused (400):
deeper JSON is no real schema or tool list, and would exhaust recursion further on."""
_ANY_FIELDS = (
    "response_format",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "audio",
    "web_search_options",
    "extra_args",
    "vllm_xargs",
    "guided_json",
    "structured_outputs",
    "chat_template_kwargs",
)
"""Fields decoded as any JSON: their depth is checked here (typed fields have their own)."""
MAX_TOKEN_ID_DIGITS = 18
"""A ``logit_bias`` key longer than this (leading zeros aside) is no token id of any model."""
_REFUSED_VLLM_FIELDS = (
    ("allowed_token_ids", "restricting the output to given token ids"),
    ("bad_words", "per-request banned words; the ban-words logits processor bans engine-wide"),
    ("truncate_prompt_tokens", "truncating the prompt"),
    ("prompt_logprobs", "log probabilities of the prompt"),
    ("use_beam_search", "beam search"),
    (
        "logits_processors",
        "logits processors per request; the server's are [sampler] logits_processors",
    ),
    ("return_tokens_as_token_ids", "token ids in place of token strings"),
)
"""vLLM request fields that would change the answer and that Brigade does not implement."""
_TEMPLATE_ARGUMENTS = frozenset(
    {"messages", "tools", "add_generation_prompt", "tokenize", "continue_final_message"}
    | {"chat_template", "documents", "return_dict"}
)


class StreamOptions(msgspec.Struct, omit_defaults=True):
    """``stream_options`` of a streaming request."""

    include_usage: bool = False
    """Send a last chunk with ``usage`` and no choices before ``data: [DONE]``."""


class ContentPart(msgspec.Struct):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, omit_defaults=True):
    """One message of a conversation; checked by the request that holds it."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Any = None
    """An assistant turn's calls, in OpenAI's shape (sent back with the tools' results)."""
    tool_call_id: str | None = None
    """A ``tool`` message: the call it answers."""

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)


class _SamplingFields(msgspec.Struct, kw_only=True, dict=True):
    """Sampling fields shared by both generation endpoints; None means the OpenAI default."""

    model: str | None = None
    """None means the served model."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """vLLM extension; -1 and 0 both disable it."""
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    n: Annotated[int, msgspec.Meta(le=MAX_N)] | None = None
    """Choices per prompt (null means 1)."""
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    priority: int = 0
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: Any = None
    extra_args: dict[str, Any] | None = None
    """Brigade extension: data for plugins (``Request.extra``), e.g. ``{"deadline_s": 2}``."""
    vllm_xargs: dict[str, Any] | None = None
    """vLLM's name for ``extra_args`` (give one of the two)."""
    # vLLM's structured-output fields, mapped onto the grammar station (one at most, and not
    # with response_format or tools).
    structured_outputs: Any = None
    """vLLM >= 0.10: ``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}``."""
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM fields that would change the output and are not implemented: refused (400).
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    prompt_logprobs: Any = None
    use_beam_search: bool = False
    logits_processors: Any = None
    return_tokens_as_token_ids: bool = False
    spaces_between_special_tokens: bool = True

    def _check_common(self) -> None:
        for name in _ANY_FIELDS:
            _check_depth(getattr(self, name, None), name, base=1)
        if self.stream_options is not None and not self.stream:
            raise ProtocolError(
                "stream_options is only allowed when stream is true.", param="stream_options"
            )
        for name, feature in _REFUSED_VLLM_FIELDS:
            if getattr(self, name) not in (None, False, []):
                _unsupported(name, feature)
        if not self.spaces_between_special_tokens:
            _unsupported("spaces_between_special_tokens", "joining special tokens without spaces")
        if self.guided_decoding_backend not in (None, "", "auto", "xgrammar"):
            raise ProtocolError(
                f"guided_decoding_backend {self.guided_decoding_backend!r} is not available: "
                "structured output uses the server's [grammar] station (xgrammar by default); "
                "leave the field out.",
                param="guided_decoding_backend",
            )
        if self.guided_whitespace_pattern is not None:
            _unsupported(
                "guided_whitespace_pattern",
                "a whitespace pattern; the server's [grammar] max_whitespace sets it",
            )
        self.structured_output()  # validates response_format, vLLM's guided fields (and tools)
        self.extra()  # validates extra_args

    def extra(self) -> Mapping[str, ExtraValue]:
        """``extra_args`` (or ``vllm_xargs``) frozen for ``Request.extra``; empty when unset."""
        return self._extra

    @functools.cached_property
    def _extra(self) -> Mapping[str, ExtraValue]:
        if self.extra_args is not None and self.vllm_xargs is not None:
            raise ProtocolError(
                "give one of extra_args or vllm_xargs (the same field under vLLM's name), "
                "not both.",
                param="vllm_xargs",
            )
        field = "extra_args" if self.vllm_xargs is None else "vllm_xargs"
        try:
            return freeze_extra(getattr(self, field), name=field)
        except ValueError as exc:
            raise ProtocolError(f"{exc}.", param=field) from None

    def structured_output(self) -> StructuredOutput | None:
        """The grammar of the answer, or None for plain text (parsed once per request)."""
        return self._grammar

    def grammar_param(self) -> str:
        """The field a grammar error names: a vLLM structured-output field when one is set,
        else ``response_format``."""
        guided = vllm_grammar(self)
        return "response_format" if guided is None else guided[0]

    @functools.cached_property
    def _grammar(self) -> StructuredOutput | None:
        return one_grammar(response_format_grammar(self.response_format), vllm_grammar(self))


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    """Takes precedence over ``max_tokens`` (which OpenAI deprecated for chat)."""
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    web_search_options: Any = None
    add_generation_prompt: bool = True
    """vLLM extension: end the prompt with the assistant turn's opening (the template's)."""
    continue_final_message: bool = False
    """vLLM extension: the last (assistant) message is continued, not closed."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM extension: extra variables for the chat template (e.g. ``enable_thinking``)."""
    chat_template: str | None = None
    echo: bool = False
    add_special_tokens: bool = False
    """vLLM extension: only false (the template adds the special tokens it wants)."""
    documents: Any = None

    def __post_init__(self) -> None:
        self._check_common()
        if self.functions:
            _unsupported("functions", "the deprecated functions API; use tools")
        if self.function_call not in (None, "none"):
            _unsupported("function_call", "the deprecated functions API; use tool_choice")
        choice = self.tool_choice_spec()
        if choice is not None and response_format_grammar(self.response_format) is not None:
            raise ProtocolError(
                "response_format cannot be combined with tool calls; set tool_choice to "
                '"none" or drop response_format.',
                param="response_format",
            )
        if self.audio is not None or (self.modalities and self.modalities != ["text"]):
            _unsupported("audio" if self.audio is not None else "modalities", "audio output")
        if self.web_search_options is not None:
            _unsupported("web_search_options", "web search")
        if self.chat_template is not None:
            _unsupported("chat_template", "a chat template per request; set [model] chat_template")
        if self.echo:
            _unsupported("echo", "echoing the last message")
        if self.add_special_tokens:
            _unsupported("add_special_tokens", "special tokens added on top of the template's")
        if self.documents is not None:
            _unsupported("documents", "documents for the chat template")
        _check_messages(self.messages)
        self.template_kwargs()  # validates continue_final_message and chat_template_kwargs

    def template_kwargs(self) -> dict[str, Any]:
        """Extra arguments of the chat template: ``chat_template_kwargs`` and
        ``continue_final_message``."""
        kwargs = dict(self.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & _TEMPLATE_ARGUMENTS)
        if reserved:
            raise ProtocolError(
                f"chat_template_kwargs may not set {reserved[0]!r}: it is the request's own "
                "field or the server's.",
                param="chat_template_kwargs",
            )
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ProtocolError(
                    "continue_final_message needs add_generation_prompt set to false.",
                    param="continue_final_message",
                )
            if not self.messages or self.messages[-1].role != "assistant":
                raise ProtocolError(
                    "continue_final_message needs the last message to be the assistant's.",
                    param="continue_final_message",
                )
            kwargs["continue_final_message"] = True
        return kwargs

    def tool_choice_spec(self) -> ToolChoice | None:
        """The tools the model may or must call, or None when it may call none."""
        return self._tool_choice

    @functools.cached_property
    def _tool_choice(self) -> ToolChoice | None:
        return parse_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    @functools.cached_property
    def _grammar(self) -> StructuredOutput | None:
        """The tool calls' grammar, else ``response_format``'s."""
        choice = self._tool_choice
        guided = vllm_grammar(self)
        if choice is not None:
            if guided is not None:
                raise ProtocolError(
                    f"{guided[0]} cannot be combined with tool calls; set tool_choice to "
                    f'"none" or drop {guided[0]}.',
                    param=guided[0],
                )
            return choice.structured_output()
        return one_grammar(response_format_grammar(self.response_format), guided)


class CompletionRequest(_SamplingFields, kw_only=True):
    """Body of ``POST /v1/completions``; ``prompt`` is text, token ids, or a batch of either."""

    prompt: str | list[str | TokenId | list[TokenId]]
    max_tokens: int | None = 16
    """OpenAI's default for completions is 16; an explicit null means "as many as fit"."""
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    add_special_tokens: bool = True
    """vLLM extension: false encodes a text prompt without the tokenizer's special tokens."""

    def __post_init__(self) -> None:
        self._check_common()
        if self.best_of is not None and self.best_of != (self.n or 1):
            _unsupported("best_of", "best_of other than n")
        if self.echo:
            _unsupported("echo", "echoing the prompt")
        if self.suffix:
            _unsupported("suffix", "insertion (suffix)")
        self.prompts()  # validates the shape

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: each one a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ProtocolError("prompt must not be an empty list.", param="prompt")
        if all(isinstance(item, int) for item in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        if all(isinstance(item, str) for item in prompt):
            return list(prompt)  # type: ignore[arg-type]
        if all(isinstance(item, list) for item in prompt):
            for index, ids in enumerate(prompt):
                if not ids:
                    raise ProtocolError("a prompt must not be empty.", param=f"prompt[{index}]")
            return list(prompt)  # type: ignore[arg-type]
        raise ProtocolError(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists; it mixes those.",
            param="prompt",
        )


class TokenizeRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Body of ``POST /tokenize`` (vLLM's shape): exactly one of ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Default: true for ``prompt``, false for ``messages`` (the template adds them)."""
    add_generation_prompt: bool = True
    """With ``messages``: end with the assistant turn's opening, as chat completions do."""

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ProtocolError("give exactly one of prompt or messages.", param="prompt")
        if self.messages is not None:
            _check_messages(self.messages)

    @property
    def adds_special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens (BOS, ...)."""
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.prompt is not None


class DetokenizeRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Body of ``POST /detokenize``."""

    tokens: list[TokenId]
    model: str | None = None


def decode_json(body: bytes, type_: type[T]) -> T:
    """Decode and validate a request body; every failure is a ``ProtocolError`` (400).

    ``param`` is the path of the offending field (``max_tokens``, ``messages[0].role``), or
    None when the body is not JSON or not an object.
    """
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.DecodeError as exc:
        raise ProtocolError.from_decode_error(exc) from None
    except RecursionError:  # msgspec's own limit, far past MAX_DEPTH
        raise ProtocolError(
            f"request body is nested too deeply: at most {MAX_DEPTH} levels of arrays and "
            "objects are allowed."
        ) from None


def _check_depth(value: Any, param: str, *, base: int) -> None:
    """400 when ``value`` (found ``base`` levels deep in the body) nests past MAX_DEPTH."""
    stack = [(value, base)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth + 1 > MAX_DEPTH:
            raise ProtocolError(
                f"{param} is nested too deeply: at most {MAX_DEPTH} levels of arrays and "
                "objects are allowed in a request.",
                param=param,
            )
        stack.extend((child, depth + 1) for child in children)


def _check_messages(messages: Sequence[ChatMessage]) -> None:
    if not messages:
        raise ProtocolError("messages must not be empty.", param="messages")
    for index, message in enumerate(messages):
        at = f"messages[{index}]"
        _check_depth(message.tool_calls, f"{at}.tool_calls", base=3)
        if message.role not in ROLES:
            raise ProtocolError(
                f"role {message.role!r} is not supported: expected one of {', '.join(ROLES)}.",
                param=f"{at}.role",
                code="unsupported_value",
            )
        if message.tool_calls:
            _check_tool_calls(message.tool_calls, at)
        if message.role == "tool" and message.tool_call_id is None:
            raise ProtocolError("a tool message needs tool_call_id.", param=f"{at}.tool_call_id")
        if message.content is None and message.role != "assistant":
            raise ProtocolError(f"a {message.role} message needs content.", param=f"{at}.content")
        parts = message.content if isinstance(message.content, list) else []
        for part_index, part in enumerate(parts):
            if part.type != "text" or part.text is None:
                raise ProtocolError(
                    f"content part type {part.type!r} is not supported: only text parts "
                    '({"type": "text", "text": ...}) are.',
                    param=f"{at}.content[{part_index}]",
                    code="unsupported_value",
                )


def _unsupported(param: str, feature: str) -> None:
    raise ProtocolError(
        f"{param} is not supported by this server yet ({feature}); see docs/server.md.",
        param=param,
        code="unsupported_parameter",
    )


def _check_tool_calls(calls: Any, at: str) -> None:
    if not isinstance(calls, list):
        raise ProtocolError("tool_calls must be a list.", param=f"{at}.tool_calls")
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ProtocolError(
                'a tool call is {"id": ..., "type": "function", "function": {"name": ..., '
                '"arguments": "<JSON>"}}.',
                param=f"{at}.tool_calls[{index}]",
            )
