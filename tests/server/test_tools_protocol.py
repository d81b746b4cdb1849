"""response_format and tools on the wire: parsing, grammars, errors, and tool-call output."""

from __future__ import annotations

import json
from typing import Any

import pytest

from brigade.interfaces import StructuredOutput
from brigade.server.errors import ProtocolError
from brigade.server.generation_inputs import sampling_params, template_messages
from brigade.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_json,
)
from brigade.server.tools import ToolCallStream, parse_tool_calls, schema_key

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "get_time"}},
]


def chat(**fields: Any) -> ChatCompletionRequest:
    body = json.dumps({"model": "m", "messages": USER, **fields}).encode()
    return decode_json(body, ChatCompletionRequest)


def refused(type_: type = ChatCompletionRequest, **fields: Any) -> ProtocolError:
    base = {"messages": USER} if type_ is ChatCompletionRequest else {"prompt": "hi"}
    with pytest.raises(ProtocolError) as info:
        decode_json(json.dumps({"model": "m", **base, **fields}).encode(), type_)
    return info.value


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        (None, None),
        ({"type": "text"}, None),
        ({"type": "json_object"}, StructuredOutput("json")),
        (
            {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
            StructuredOutput("json_schema", json.dumps(schema_key(SCHEMA))),
        ),
        ({"type": "regex", "regex": "[a-z]+"}, StructuredOutput("regex", "[a-z]+")),
        ({"type": "ebnf", "ebnf": 'root ::= "a"'}, StructuredOutput("ebnf", 'root ::= "a"')),
    ],
)
def test_response_format_becomes_the_grammar(response_format: Any, expected: Any) -> None:
    for type_ in (ChatCompletionRequest, CompletionRequest):
        base = {"messages": USER} if type_ is ChatCompletionRequest else {"prompt": "hi"}
        body = json.dumps({"model": "m", **base, "response_format": response_format}).encode()
        request = decode_json(body, type_)
        assert sampling_params(request, default_max_tokens=8).structured_output == expected


def test_equal_schemas_give_the_same_cache_key_and_property_order_is_kept() -> None:
    two = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    reordered = {"properties": two["properties"], "type": "object"}
    flipped = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    formats = [
        {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        for name, schema in (("a", two), ("b", reordered), ("c", flipped))
    ]
    first, second, third = (chat(response_format=f).structured_output() for f in formats)
    assert first == second  # keyword order is irrelevant to the answer
    assert first != third  # property order is the answer's key order
    for spec, schema in ((first, two), (third, flipped)):
        assert spec is not None
        properties = json.loads(spec.spec)["properties"]
        assert list(properties) == list(schema["properties"])


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "yaml"}, "response_format.type"),
        ("json", "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"schema": 3}},
            "response_format.json_schema.schema",
        ),
        ({"type": "regex"}, "response_format.regex"),
        ({"type": "ebnf", "ebnf": ""}, "response_format.ebnf"),
    ],
)
def test_malformed_response_format_is_a_400_naming_the_field(
    response_format: Any, param: str
) -> None:
    assert refused(response_format=response_format).param == param
    assert refused(CompletionRequest, response_format=response_format).param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": {"name": "f"}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_malformed_tools_are_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    assert refused(**fields).param == param


def test_tool_choices_constrain_to_structural_tags() -> None:
    assert chat(tools=TOOLS, tool_choice="none").structured_output() is None
    assert chat(tool_choice="none").structured_output() is None
    formats = {}
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_time"}}):
        spec = chat(tools=TOOLS, tool_choice=choice).structured_output()
        assert spec is not None
        assert spec.kind == "structural_tag"
        formats[json.dumps(choice)] = json.loads(spec.spec)["format"]
    assert formats['"auto"']["type"] == "triggered_tags"
    assert formats['"required"']["type"] == "tags_with_separator"
    assert formats['"required"']["at_least_one"] is True
    named = formats['{"type": "function", "function": {"name": "get_time"}}']
    assert named["type"] == "tag"
    assert '"get_time"' in named["begin"]
    # tools without tool_choice means auto, as OpenAI does
    assert (
        chat(tools=TOOLS).structured_output()
        == chat(tools=TOOLS, tool_choice="auto").structured_output()
    )
    single = json.loads(
        chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        .structured_output()
        .spec  # type: ignore[union-attr]
    )
    assert single["format"]["stop_after_first"] is True


def test_tool_calls_are_parsed_out_of_the_text() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2
    assert parse_tool_calls("no calls") == ("no calls", [])
    cut = '<tool_call>\n{"name": "get_weather", "argu'
    assert parse_tool_calls(cut) == (cut, [])


def test_a_call_cut_at_max_tokens_is_content_never_a_call() -> None:
    # vLLM's answer to a call cut by the token limit: no tool_calls entry with invalid JSON
    # arguments, the cut text as content (the finish reason says length).
    head = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": '
    for cut in ('{"city": "Os', '{"city": "Paris"}}', ""):
        assert parse_tool_calls(head + cut) == ((head + cut).strip(), [])
    for cut in ('<tool_call>\n{"name": "get_wea', "<tool_call>", "<tool_c"):
        assert parse_tool_calls("Checking. " + cut) == ("Checking. " + cut, [])
    whole = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
    content, calls = parse_tool_calls(whole + head + "{")
    assert content == head + "{"
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    text = whole + head + '{"city": "Oslo", "te'
    for size in (1, 4, len(text)):
        stream = ToolCallStream()
        streamed, found = "", []
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        for index, piece in enumerate(pieces):
            out, parsed = stream.feed(piece, final=index == len(pieces) - 1)
            streamed += out
            found += [(c.name, c.arguments) for c in parsed]
        assert streamed == "\n" + head + '{"city": "Oslo", "te'
        assert found == [("get_time", "{}")]


def test_streamed_tool_calls_hold_back_partial_tags() -> None:
    text = 'Sure. <tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call> done'
    for size in (1, 3, 7, len(text)):
        stream = ToolCallStream()
        content, names = "", []
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        for index, piece in enumerate(pieces):
            out, calls = stream.feed(piece, final=index == len(pieces) - 1)
            assert "<" not in out, "no part of a tag leaks into content"
            content += out
            names += [c.name for c in calls]
        assert content == "Sure.  done"
        assert names == ["get_time"]
    stream = ToolCallStream()
    out, calls = stream.feed("<tool", final=False)
    assert (out, calls) == ("", [])
    out, calls = stream.feed("box", final=True)  # not a tag after all
    assert out == "<toolbox"
    assert calls == []


def test_assistant_tool_calls_and_tool_results_reach_the_template() -> None:
    request = chat(
        messages=[
            *USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=TOOLS,
    )
    messages = template_messages(request.messages)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
