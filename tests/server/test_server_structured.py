"""Structured output and tool calls through the real server and the official openai client."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Literal

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


# -- key order: the schema's, as OpenAI keeps it ------------------------------------------------

UNSORTED = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["C", "F"]},
        "temp": {"type": "integer", "minimum": -50, "maximum": 50},
        "city": {"type": "string", "maxLength": 8},
    },
    "required": ["unit", "temp", "city"],
}
"""Properties in an order that is not alphabetical: the answer must keep it."""


def test_json_schema_answers_keep_the_schema_s_key_order(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": UNSORTED}}
    for seed in (1, 2, 3):
        answer = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            response_format=response_format,  # type: ignore[arg-type]
            max_tokens=96,
            temperature=1.0,
            seed=seed,
        )
        value = json.loads(answer.choices[0].message.content or "")
        assert list(value) == ["unit", "temp", "city"], value


def test_tool_arguments_keep_the_parameters_key_order(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": UNSORTED}}]
    for seed in (1, 2):
        answer = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=tools,  # type: ignore[arg-type]
            tool_choice="required",
            max_tokens=128,
            temperature=1.0,
            seed=seed,
        )
        calls = answer.choices[0].message.tool_calls or []
        assert calls
        for call in calls:
            assert list(json.loads(call.function.arguments)) == ["unit", "temp", "city"]


def test_the_openai_client_s_parse_fills_a_pydantic_model(client: openai.OpenAI) -> None:
    import pydantic

    class Reading(pydantic.BaseModel):  # field order matters: reasoning before the answer
        step: Literal["look", "guess"]
        verdict: bool
        temp: int = pydantic.Field(ge=-50, le=50)
        unit: Literal["C", "F"]

    for seed in (4, 5):
        completion = client.chat.completions.parse(
            model="tiny",
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=Reading,
            max_tokens=96,
            temperature=1.0,
            seed=seed,
        )
        message = completion.choices[0].message
        assert isinstance(message.parsed, Reading), message.content
        assert list(json.loads(message.content or "")) == ["step", "verdict", "temp", "unit"]


def test_a_tool_call_cut_by_max_tokens_is_content_not_a_call(client: openai.OpenAI) -> None:
    # As vLLM: never a tool_calls entry with invalid JSON arguments; the cut text is content.
    cut = 0
    for max_tokens in (10, 30, 44, 52, 60):  # the call's opening is ~38 tiny-model tokens
        for stream in (False, True):
            kwargs = {
                "model": "tiny",
                "messages": MESSAGES,
                "tools": TOOLS[:1],
                "tool_choice": "required",
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "seed": 9,
            }
            if stream:
                content, finish = "", None
                calls: dict[int, list[str]] = {}
                for chunk in client.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
                    if not chunk.choices:
                        continue
                    choice = chunk.choices[0]
                    finish = choice.finish_reason or finish
                    content += choice.delta.content or ""
                    for delta in choice.delta.tool_calls or []:
                        entry = calls.setdefault(delta.index, ["", ""])
                        entry[0] += delta.function.name or ""
                        entry[1] += delta.function.arguments or ""
                found = [tuple(entry) for entry in calls.values()]
            else:
                choice = client.chat.completions.create(**kwargs).choices[0]  # type: ignore[call-overload]
                finish, content = choice.finish_reason, choice.message.content or ""
                found = [
                    (c.function.name, c.function.arguments) for c in choice.message.tool_calls or []
                ]
            if finish != "length":
                assert finish == "tool_calls"
                continue
            assert not found, found
            assert content.lstrip().startswith("<tool_call>"), content
            cut += 1
    assert cut, "no max_tokens value cut a call"


# -- vLLM's structured-output fields, as outlines' from_vllm and vLLM clients send them ---------


def test_vllm_guided_fields_constrain_the_answer(client: openai.OpenAI) -> None:
    choices = ["sunny", "rainy day", 'say "hi"']
    for seed in (1, 2, 3):
        answer = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=32,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_choice": choices},
        )
        assert answer.choices[0].message.content in choices
        completion = client.completions.create(
            model="tiny",
            prompt="Code:",
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"},
        )
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", completion.choices[0].text)
        answer = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=96,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"json": UNSORTED}},
        )
        value = json.loads(answer.choices[0].message.content or "")
        jsonschema.validate(value, UNSORTED)
        assert list(value) == ["unit", "temp", "city"]


def test_vllm_fields_it_cannot_honour_are_a_400_naming_them(client: openai.OpenAI) -> None:
    for body, param in (
        ({"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"chat_template": "{{ 1 }}"}, "chat_template"),
    ):
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=4, extra_body=body
            )
        assert raised.value.param == param, (body, raised.value.body)


def test_continue_final_message_continues_the_assistant_turn(server: str) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "The weather in Oslo is"}]

    def prompt_tokens(**fields: object) -> int:
        body = {"model": "tiny", "messages": messages, "max_tokens": 2, **fields}
        response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["prompt_tokens"])

    closed = prompt_tokens(add_generation_prompt=False)
    continued = prompt_tokens(add_generation_prompt=False, continue_final_message=True)
    assert continued < closed  # the assistant turn's end-of-turn tokens are left off


def test_constrained_top_logprobs_are_numbers_a_client_can_do_arithmetic_on(
    client: openai.OpenAI,
) -> None:
    """guidance's json() crashed on ``"logprob": null`` for tokens the grammar blocks: they
    now carry OpenAI's floor (-9999), so exp() and sums work as on OpenAI's answers."""
    import math

    response = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0.0,
        logprobs=True,
        top_logprobs=20,
        response_format={"type": "regex", "regex": "(yes|no)"},  # type: ignore[arg-type,misc]
    )
    choice = response.choices[0]
    assert choice.message.content in ("yes", "no")
    assert choice.logprobs is not None
    assert choice.logprobs.content
    blocked = 0
    for entry in choice.logprobs.content:
        assert isinstance(entry.logprob, float)
        assert math.isfinite(entry.logprob)
        assert len(entry.top_logprobs) == 20
        values = [top.logprob for top in entry.top_logprobs]
        assert all(isinstance(v, float) for v in values), values
        mass = sum(math.exp(v) for v in values)  # guidance-style: probabilities from logprobs
        assert mass <= 1.0 + 1e-4, mass
        blocked += sum(1 for v in values if v <= -9999.0)
        assert max(values) == entry.logprob  # greedy under the constraint: the top one
    assert blocked, "a two-word grammar must block most of the top 20 tokens"
