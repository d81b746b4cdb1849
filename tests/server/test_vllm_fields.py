"""vLLM's request extensions on the wire: each maps onto Brigade or is refused naming itself."""

from __future__ import annotations

import json
from typing import Any

import pytest

from brigade.interfaces import StructuredOutput
from brigade.server.errors import ProtocolError
from brigade.server.protocol import ChatCompletionRequest, CompletionRequest, decode_json

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def decode(type_: type = ChatCompletionRequest, **fields: Any) -> Any:
    base = {"messages": USER} if type_ is ChatCompletionRequest else {"prompt": "hi"}
    return decode_json(json.dumps({"model": "m", **base, **fields}).encode(), type_)


def refused(type_: type = ChatCompletionRequest, **fields: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(type_, **fields)
    return info.value


@pytest.mark.parametrize("type_", [ChatCompletionRequest, CompletionRequest])
@pytest.mark.parametrize(
    ("fields", "kind", "param"),
    [
        ({"guided_json": SCHEMA}, "json_schema", "guided_json"),
        ({"guided_json": json.dumps(SCHEMA)}, "json_schema", "guided_json"),
        ({"guided_regex": "[a-z]{3}"}, "regex", "guided_regex"),
        ({"guided_choice": ["yes", 'no "way"']}, "ebnf", "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, "ebnf", "guided_grammar"),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", "structured_outputs.json"),
        ({"structured_outputs": {"regex": "a+"}}, "regex", "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["x", "y"]}}, "ebnf", "structured_outputs.choice"),
        ({"structured_outputs": {"json_object": True}}, "json", "structured_outputs.json_object"),
        ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "regex", "guided_regex"),
    ],
)
def test_vllm_structured_output_fields_become_the_grammar(
    type_: type, fields: dict[str, Any], kind: str, param: str
) -> None:
    request = decode(type_, **fields)
    grammar = request.structured_output()
    assert isinstance(grammar, StructuredOutput)
    assert grammar.kind == kind
    assert request.grammar_param() == param
    if kind == "json_schema":
        assert list(json.loads(grammar.spec)["properties"]) == ["b", "a"]  # schema order


def test_guided_choice_is_exactly_one_of_the_strings() -> None:
    grammar = decode(guided_choice=["yes", 'no "way"', "ünï"]).structured_output()
    assert grammar.spec == 'root ::= "yes" | "no \\"way\\"" | "ünï"'


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json"),
        (
            {"structured_outputs": {"regex": "a", "grammar": 'root ::= "a"'}},
            "structured_outputs.grammar",
        ),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": "json"}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": 3}, "guided_json"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
        ({"guided_whitespace_pattern": " ?", "guided_json": SCHEMA}, "guided_whitespace_pattern"),
        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"logits_processors": ["x"]}, "logits_processors"),
        ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ],
)
def test_what_is_not_enforced_is_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    assert refused(**fields).param == param


def test_tools_and_a_guided_field_do_not_mix() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
    error = refused(tools=tools, tool_choice="required", guided_regex="a")
    assert error.param == "guided_regex"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"echo": True}, "echo"),
        ({"add_special_tokens": True}, "add_special_tokens"),
        ({"documents": [{"text": "x"}]}, "documents"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"continue_final_message": True}, "continue_final_message"),  # generation prompt on
        (
            {"continue_final_message": True, "add_generation_prompt": False},  # last is user's
            "continue_final_message",
        ),
    ],
)
def test_chat_template_fields_are_checked(fields: dict[str, Any], param: str) -> None:
    assert refused(**fields).param == param


def test_chat_template_kwargs_and_continuing_the_last_message_reach_the_template() -> None:
    messages = [*USER, {"role": "assistant", "content": "Hel"}]
    request = decode(
        messages=messages,
        add_generation_prompt=False,
        continue_final_message=True,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert request.template_kwargs() == {"enable_thinking": False, "continue_final_message": True}
    assert decode().template_kwargs() == {}


def test_completions_encode_without_special_tokens_when_asked() -> None:
    from types import SimpleNamespace

    from brigade.server.generation import _encode_prompts

    seen: list[bool] = []

    class Tokenizer:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            seen.append(add_special_tokens)
            return [1, 2] if add_special_tokens else [2]

    state: Any = SimpleNamespace(tokenizer=Tokenizer())
    assert decode(CompletionRequest).add_special_tokens is True
    flag = decode(CompletionRequest, add_special_tokens=False).add_special_tokens
    assert _encode_prompts(state, ["hi", [7, 8]], flag) == [[2], [7, 8]]
    assert _encode_prompts(state, ["hi"]) == [[1, 2]]
    assert seen == [False, True]
