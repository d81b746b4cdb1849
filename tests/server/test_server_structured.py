"""Structured output and tool calls through the real server and the official openai client."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import running_server, tiny_model, tiny_server_config

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "temp": {"type": "integer", "minimum": -50, "maximum": 50},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "temp", "unit"],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"enum": ["UTC", "CET"]}},
                "required": ["tz"],
            },
        },
    },
]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = tiny_model(tmp_path_factory.mktemp("model"))
    config = tiny_server_config(model_dir, max_model_len=512, num_pages=400)
    with running_server(config, tmp_path_factory.mktemp("srv")) as (base, _):
        yield base


@pytest.fixture
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def test_json_schema_chat_with_n_seeds_and_temperature(client: openai.OpenAI) -> None:
    def answers() -> list[str | None]:
        response = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
            max_tokens=128,
            n=4,
            seed=7,
            temperature=1.0,
        )
        assert len(response.choices) == 4
        for choice in response.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
        return [choice.message.content for choice in response.choices]

    assert answers() == answers(), "same seed, same answers"


def test_json_schema_streams(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
        max_tokens=128,
        stream=True,
        temperature=1.0,
        seed=1,
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_with_a_bias_towards_closing(client: openai.OpenAI) -> None:
    # A random model writes keys forever; biasing quote and brace tokens lets it finish, and
    # the grammar still decides where each may go.
    quote, close = ("6", "97")  # '"' and '}' in the built-in tokenizer
    response = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=64,
        logit_bias={quote: 30, close: 30},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content or ""), dict)


def test_completions_regex_and_ebnf(client: openai.OpenAI) -> None:
    pattern = r"(red|green|blue)-[0-9]{2,3}"
    response = client.completions.create(
        model="tiny",
        prompt="colour code:",
        max_tokens=32,
        temperature=1.0,
        n=3,
        seed=5,
        extra_body={"response_format": {"type": "regex", "regex": pattern}},
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        assert re.fullmatch(pattern, choice.text), choice.text
    grammar = 'root ::= "[" item ("," item){0,3} "]"\nitem ::= [0-9] | "x"'
    response = client.completions.create(
        model="tiny",
        prompt="a list:",
        max_tokens=32,
        extra_body={"response_format": {"type": "ebnf", "ebnf": grammar}},
    )
    assert response.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"\[[0-9x](,[0-9x]){0,3}\]", response.choices[0].text)


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
)
def test_forced_tool_calls_validate(client: openai.OpenAI, tool_choice: object) -> None:
    for stream in (False, True):
        kwargs = {
            "model": "tiny",
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": tool_choice,
            "max_tokens": 128,
            "temperature": 1.0,
            "seed": 3,
        }
        if stream:
            calls: dict[int, dict] = {}
            finish = None
            for chunk in client.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
                if not chunk.choices:
                    continue
                finish = chunk.choices[0].finish_reason or finish
                for delta in chunk.choices[0].delta.tool_calls or []:
                    entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                    entry["name"] += delta.function.name or ""
                    entry["arguments"] += delta.function.arguments or ""
            found = [(c["name"], c["arguments"]) for c in calls.values()]
        else:
            message = client.chat.completions.create(**kwargs).choices[0]  # type: ignore[call-overload]
            finish = message.finish_reason
            assert message.message.content is None
            found = [(c.function.name, c.function.arguments) for c in message.message.tool_calls]
        assert finish == "tool_calls"
        assert found
        for name, arguments in found:
            if isinstance(tool_choice, dict):
                assert name == "get_time"
            jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def test_auto_tool_choice_answers_text_or_valid_calls(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=24, seed=2, temperature=1.0
    )
    message = response.choices[0].message
    for call in message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    assert message.content or message.tool_calls


def test_tool_results_go_back_to_the_model(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=128
    )
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    follow_up = client.chat.completions.create(
        model="tiny",
        messages=[
            *MESSAGES,
            first.choices[0].message.model_dump(exclude_none=True),  # type: ignore[list-item]
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
        ],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
    )
    assert follow_up.choices[0].message.tool_calls is None
    assert follow_up.usage is not None
    assert follow_up.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("response_format", "reason"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}, "wat"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}, "'not'"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"format": "color"}}},
            "color",
        ),
        ({"type": "regex", "regex": "a(b"}, "parenthesis"),
        ({"type": "ebnf", "ebnf": "root ::= foo"}, "foo"),
    ],
)
def test_invalid_grammars_are_400_with_the_reason(
    server: str, client: openai.OpenAI, response_format: dict, reason: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            response_format=response_format,  # type: ignore[arg-type]
            max_tokens=8,
        )
    error = info.value.body
    assert isinstance(error, dict)
    assert error["param"] == "response_format"
    assert reason in error["message"]
    health = httpx.get(f"{server}/health", timeout=10).json()
    assert health["status"] == "ok"
    assert health["num_running"] == 0


def test_grammar_metrics(server: str, client: openai.OpenAI) -> None:
    def sample(name: str, **labels: str) -> float:
        text = httpx.get(f"{server}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for found in family.samples:
                if found.name == name and labels.items() <= found.labels.items():
                    return float(found.value)
        raise AssertionError(f"{name} {labels} not exported")

    requests = "brigade:structured_output_requests_total"
    before, errors = sample(requests, kind="json_schema"), sample("brigade:grammar_errors_total")
    client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
        max_tokens=128,
    )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            response_format={"type": "regex", "regex": "a(b"},  # type: ignore[arg-type]
            max_tokens=8,
        )
    assert sample(requests, kind="json_schema") == before + 1
    assert sample("brigade:grammar_errors_total") == errors + 1
