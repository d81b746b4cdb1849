"""Tool calling: OpenAI ``tools``/``tool_choice`` to a grammar, and model output to ``tool_calls``.

Calls use the Hermes convention the built-in chat template teaches (Qwen2.5 and Qwen3 use it
too)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The grammar is an XGrammar structural tag with one tag per tool, whose arguments follow that
tool's ``parameters`` schema:

- a named function: exactly one call of that tool;
- ``"required"``: one or more calls (one if ``parallel_tool_calls`` is false), nothing else;
- ``"auto"``: free text, but any ``<tool_call>`` the model opens must be a valid call. A weak
  model may simply answer in text: "auto" only guarantees that the calls it makes are valid.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from brigade.interfaces import StructuredOutput
from brigade.server.errors import ProtocolError

__all__ = [
    "CALL_BEGIN",
    "CALL_END",
    "ToolCall",
    "ToolCallStream",
    "ToolChoice",
    "parse_tool_calls",
    "parse_tools",
    "schema_key",
]

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_CALL = re.compile(re.escape(CALL_BEGIN) + r"\s*(.*?)\s*" + re.escape(CALL_END), re.DOTALL)
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: ``arguments`` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True, slots=True)
class ToolChoice:
    """A request's tools and how they must be used."""

    tools: dict[str, dict[str, Any]]
    """Tool name -> its ``parameters`` JSON schema."""
    mode: str
    """``auto``, ``required`` or ``named``."""
    name: str | None = None
    """The forced tool (mode ``named``)."""
    parallel: bool = True

    def structured_output(self) -> StructuredOutput:
        """The structural tag that constrains the output for this choice."""
        names = [self.name] if self.mode == "named" and self.name else list(self.tools)
        tags = [
            {
                "type": "tag",
                "begin": f'{CALL_BEGIN}\n{{"name": {json.dumps(name)}, "arguments": ',
                "content": {"type": "json_schema", "json_schema": schema_key(self.tools[name])},
                "end": f"}}\n{CALL_END}",
            }
            for name in names
        ]
        if self.mode == "named":
            fmt: dict[str, Any] = tags[0]
        elif self.mode == "required":
            fmt = {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": "\n",
                "at_least_one": True,
                "stop_after_first": not self.parallel,
            }
        else:
            fmt = {
                "type": "triggered_tags",
                "triggers": [CALL_BEGIN],
                "tags": tags,
                "at_least_one": False,
                "stop_after_first": not self.parallel,
            }
        tag = {"type": "structural_tag", "format": fmt}
        # Each schema keeps its properties' order (schema_key): arguments come in that order.
        return StructuredOutput("structural_tag", json.dumps(tag))


def parse_tools(
    tools: Any, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolChoice | None:
    """Check ``tools`` and ``tool_choice``; None when no tool may be called.

    Raises ``ProtocolError`` naming the field for anything malformed: a tool that is not a
    function, a bad or repeated name, parameters that are not a JSON schema object, a named
    choice that is not among the tools, ``required`` without tools.
    """
    specs = _parse_tool_list(tools)
    choice = "auto" if tool_choice is None and specs else tool_choice
    if choice is None or choice == "none":
        return None
    if choice in ("auto", "required"):
        if not specs:
            if choice == "auto":
                return None
            raise ProtocolError(
                'tool_choice "required" needs at least one tool in tools.', param="tool_choice"
            )
        mode, name = str(choice), None
    elif isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ProtocolError(
                'a named tool_choice is {"type": "function", "function": {"name": ...}}.',
                param="tool_choice.function.name",
            )
        if name not in specs:
            raise ProtocolError(
                f"tool_choice names function {name!r}, which is not in tools "
                f"({', '.join(specs) or 'none given'}).",
                param="tool_choice.function.name",
            )
        mode = "named"
    else:
        raise ProtocolError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}.',
            param="tool_choice",
            code="unsupported_value",
        )
    return ToolChoice(specs, mode, name, parallel=parallel_tool_calls is not False)


def _parse_tool_list(tools: Any) -> dict[str, dict[str, Any]]:
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise ProtocolError("tools must be a list of function tools.", param="tools")
    specs: dict[str, dict[str, Any]] = {}
    for index, tool in enumerate(tools):
        at = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ProtocolError(
                'only function tools ({"type": "function", "function": {...}}) are supported.',
                param=f"{at}.type",
                code="unsupported_value",
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ProtocolError("a function tool needs a function object.", param=f"{at}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ProtocolError(
                f"a function name is 1 to 64 letters, digits, underscores or dashes; got {name!r}.",
                param=f"{at}.function.name",
            )
        if name in specs:
            raise ProtocolError(f"function {name!r} is defined twice.", param=f"{at}.function.name")
        parameters = function.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise ProtocolError(
                "parameters must be a JSON schema object.", param=f"{at}.function.parameters"
            )
        specs[name] = parameters
    return specs


_ORDERED = frozenset({"properties", "prefixItems"})
"""Schema keywords whose entries' order is the output's order (the answer's keys, items)."""


def schema_key(schema: Any) -> Any:
    """``schema`` in a canonical form for the compile cache: every object's keys sorted except
    the entries of ``properties`` (the order the answer lists its keys in, as OpenAI keeps
    it), so schemas that differ only in keyword order share one compiled grammar."""
    if isinstance(schema, list):
        return [schema_key(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result: dict[str, Any] = {}
    for key in sorted(schema):
        value = schema[key]
        if key in _ORDERED and isinstance(value, dict):
            result[key] = {name: schema_key(child) for name, child in value.items()}
        else:
            result[key] = schema_key(value)
    return result


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Split generated text into its free text and its ``<tool_call>`` blocks.

    Blocks that do not parse stay in the text, and so does a block that was opened but never
    closed (an answer cut at ``max_tokens``): a call is returned only whole, with arguments
    that are valid JSON, as vLLM does; the cut text is the content and the finish reason says
    ``length``.
    """
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _CALL.finditer(text):
        call = _parse_call(match.group(1))
        if call is None:
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    kept.append(text[position:])
    content = "".join(kept).strip()
    return content or None, calls


def _parse_call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    return ToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallStream:
    """Splits a streamed choice into content deltas and whole tool calls.

    Text is passed on as content until a ``<tool_call>`` may be starting (a partial opening
    at the end is held back); a call is emitted once its closing tag has arrived.
    """

    def __init__(self) -> None:
        self._pending = ""
        self.num_calls = 0

    def feed(self, text: str, *, final: bool = False) -> tuple[str, list[ToolCall]]:
        """Content to send now and the calls completed by ``text``; on the ``final`` text, a
        call that never closed (an answer cut at ``max_tokens``) is sent as content, never as
        a call (see :func:`parse_tool_calls`)."""
        self._pending += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            start = self._pending.find(CALL_BEGIN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._pending, CALL_BEGIN)
                cut = len(self._pending) - keep
                content.append(self._pending[:cut])
                self._pending = self._pending[cut:]  # cut: a tag's start
                break
            content.append(self._pending[:start])
            self._pending = self._pending[start:]
            end = self._pending.find(CALL_END)
            if end < 0:
                if final:  # never closed: hand it over as text
                    content.append(self._pending)
                    self._pending = ""
                break
            block = self._pending[: end + len(CALL_END)]
            self._pending = self._pending[end + len(CALL_END) :]
            _, parsed = parse_tool_calls(block)
            if parsed:
                calls.extend(parsed)
            else:
                content.append(block)
        self.num_calls += len(calls)
        return "".join(content), calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def tool_call_dicts(calls: Sequence[ToolCall], *, first_index: int = 0) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` entries (with ``index`` for stream deltas)."""
    return [
        {
            "index": first_index + offset,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for offset, call in enumerate(calls)
    ]
