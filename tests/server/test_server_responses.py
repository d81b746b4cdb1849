"""The Responses API through the real server and the official openai client: text,
instructions, streaming, structured output, tool calls and their results, refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from server_harness import running_server, tiny_model, tiny_server_config

SCHEMA = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["C", "F"]},
        "temp": {"type": "integer", "minimum": 0, "maximum": 40},
    },
    "required": ["unit", "temp"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Nice"]}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    model_dir = tiny_model(tmp_path_factory.mktemp("model"))
    config = tiny_server_config(model_dir, max_model_len=512, num_pages=400)
    with running_server(config, tmp_path_factory.mktemp("srv")) as (base, _):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def test_a_text_response_and_its_usage(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="tiny",
        instructions="Answer briefly.",
        input="What is the weather in Oslo?",
        max_output_tokens=12,
        temperature=0.0,
    )
    assert response.object == "response"
    assert response.status == "incomplete"  # 12 tokens of a random model: cut by length
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text
    assert response.usage is not None
    assert response.usage.output_tokens == 12
    assert response.usage.total_tokens == response.usage.input_tokens + 12
    same = client.responses.create(
        model="tiny",
        instructions="Answer briefly.",
        input=[
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "What is the weather in Oslo?"}],
            }
        ],
        max_output_tokens=12,
        temperature=0.0,
    )
    assert same.output_text == response.output_text  # the same conversation, spelled as items


def test_streaming_events_rebuild_the_same_text(client: openai.OpenAI) -> None:
    kwargs = {"model": "tiny", "input": "Hello", "max_output_tokens": 10, "temperature": 0.0}
    whole = client.responses.create(**kwargs)  # type: ignore[call-overload]
    events = list(client.responses.create(stream=True, **kwargs))  # type: ignore[call-overload]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"  # cut by max_output_tokens, as OpenAI says it
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1].response
    assert deltas == last.output[0].content[0].text == whole.output_text


def test_a_completed_stream_gives_the_sdk_its_final_response(client: openai.OpenAI) -> None:
    text = {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA, "strict": True}}
    with client.responses.stream(
        model="tiny",
        input="Weather as JSON",
        max_output_tokens=64,
        text=text,  # type: ignore[arg-type]
    ) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert "".join(deltas) == final.output_text
    jsonschema.validate(json.loads(final.output_text), SCHEMA)


def test_text_format_json_schema_is_enforced_in_schema_order(client: openai.OpenAI) -> None:
    for seed in (1, 2):
        response = client.responses.create(
            model="tiny",
            input="Weather as JSON",
            max_output_tokens=64,
            temperature=1.0,
            extra_body={"seed": seed},
            text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA, "strict": True}},
        )
        value = json.loads(response.output_text)
        jsonschema.validate(value, SCHEMA)
        assert list(value) == ["unit", "temp"]


def test_function_calls_and_their_outputs(client: openai.OpenAI) -> None:
    must_call = {
        "model": "tiny",
        "input": "Weather in Oslo?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_output_tokens": 96,
        "temperature": 1.0,
    }
    response = client.responses.create(**must_call)  # type: ignore[call-overload]
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls
    assert response.status == "completed"
    for call in calls:
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    follow_up = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            *(
                {
                    "type": "function_call",
                    "call_id": c.call_id,
                    "name": c.name,
                    "arguments": c.arguments,
                }
                for c in calls
            ),
            *(
                {"type": "function_call_output", "call_id": c.call_id, "output": "12 C"}
                for c in calls
            ),
        ],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=8,
    )
    assert follow_up.output_text
    streamed = []
    with client.responses.stream(**must_call) as stream:  # type: ignore[arg-type]
        for event in stream:
            if event.type == "response.function_call_arguments.done":
                streamed.append(event.arguments)
        final = stream.get_final_response()
    assert streamed
    assert [item.arguments for item in final.output if item.type == "function_call"] == streamed


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
    ],
)
def test_what_it_cannot_do_is_a_400_naming_the_field(
    client: openai.OpenAI, fields: dict, param: str
) -> None:
    body = {"model": "tiny", "input": "hi", **fields}
    with pytest.raises(openai.BadRequestError) as raised:
        client.post("/responses", body=body, cast_to=object)
    assert raised.value.param == param, raised.value.body
