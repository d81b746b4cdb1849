"""A real third-party client, unmodified, against the real server: langchain-openai's chat
model (plain calls, streaming, ``bind_tools``, ``with_structured_output``) and its embeddings.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import jsonschema
import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from pydantic import BaseModel, Field
from server_harness import running_server, tiny_model, tiny_server_config


class Weather(BaseModel):
    """A weather report (fields in this order: the answer keeps it)."""

    unit: Literal["C", "F"]
    temp: int = Field(ge=0, le=40)
    sky: Literal["clear", "cloudy", "rain"]


@tool
def get_weather(city: Literal["Oslo", "Nice"]) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = tiny_model(tmp_path_factory.mktemp("model"))
    config = tiny_server_config(model_dir, max_model_len=512, num_pages=400)
    with running_server(config, tmp_path_factory.mktemp("srv")) as (base, _):
        yield f"{base}/v1"


def chat_model(base_url: str, **kwargs: object) -> ChatOpenAI:
    return ChatOpenAI(
        model="tiny", base_url=base_url, api_key="none", temperature=0.0, max_retries=0, **kwargs
    )


def test_invoke_and_stream(base_url: str) -> None:
    llm = chat_model(base_url, max_tokens=12)
    answer = llm.invoke([HumanMessage("What is the weather in Oslo?")])
    assert isinstance(answer, AIMessage)
    assert answer.content
    assert answer.response_metadata["finish_reason"] == "length"
    assert answer.usage_metadata is not None
    assert answer.usage_metadata["output_tokens"] == 12
    pieces = list(llm.stream("What is the weather in Oslo?"))
    assert "".join(str(p.content) for p in pieces) == answer.content  # greedy: same text


def test_bind_tools_returns_a_parsed_call(base_url: str) -> None:
    llm = chat_model(base_url, max_tokens=64).bind_tools([get_weather], tool_choice="get_weather")
    answer = llm.invoke("What is the weather in Oslo?")
    assert isinstance(answer, AIMessage)
    assert [call["name"] for call in answer.tool_calls] == ["get_weather"], answer
    jsonschema.validate(answer.tool_calls[0]["args"], get_weather.args_schema.model_json_schema())


def test_with_structured_output_parses_into_the_model(base_url: str) -> None:
    llm = chat_model(base_url, max_tokens=64).with_structured_output(Weather)
    report = llm.invoke("Report the weather in Oslo as JSON.")
    assert isinstance(report, Weather)
    raw = chat_model(base_url, max_tokens=64).with_structured_output(Weather, include_raw=True)
    result = raw.invoke("Report the weather in Oslo as JSON.")
    text = str(result["raw"].content)
    # Keys in the schema's order, as OpenAI answers them.
    assert text.index('"unit"') < text.index('"temp"') < text.index('"sky"'), text


def test_embeddings(base_url: str) -> None:
    embeddings = OpenAIEmbeddings(
        model="tiny",
        base_url=base_url,
        api_key="none",
        max_retries=0,
        check_embedding_ctx_length=False,  # else it tokenizes with tiktoken's (downloaded) files
    )
    documents = embeddings.embed_documents(["hello world", "hello world", "goodbye"])
    query = embeddings.embed_query("hello world")
    assert len(documents) == 3
    assert len(documents[0]) == len(query) > 0
    assert max(abs(a - b) for a, b in zip(documents[0], query, strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(documents[0], documents[2], strict=True)) > 1e-3
