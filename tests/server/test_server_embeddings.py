"""``/v1/embeddings`` through the real server and the official openai client: vectors equal
transformers' pooled hidden states, both encodings, vLLM's extensions, clear refusals, and
embeddings served beside generation."""

from __future__ import annotations

import base64
import json
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_harness import running_server, tiny_model, tiny_server_config

IDS = [[5, 17, 99, 3, 42, 7, 8, 120, 33], [11, 12], [200, 201, 202, 203, 204, 205, 206]]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    model_dir = tiny_model(tmp_path_factory.mktemp("model"))
    config = tiny_server_config(model_dir, max_model_len=256, num_pages=200)
    with running_server(config, tmp_path_factory.mktemp("srv")) as (base, _):
        yield base, model_dir


@pytest.fixture(scope="module")
def hidden_size(served: tuple[str, Path]) -> int:
    return int(json.loads((served[1] / "config.json").read_text())["hidden_size"])


@pytest.fixture(scope="module")
def client(served: tuple[str, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reference(served: tuple[str, Path]) -> list[torch.Tensor]:
    """transformers' last-token final hidden state of each of IDS (not normalized)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(served[1], dtype=torch.float32).eval()
    with torch.no_grad():
        return [
            model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
            for ids in IDS
        ]


def test_vectors_equal_transformers_in_both_encodings(
    client: openai.OpenAI, reference: list[torch.Tensor], hidden_size: int
) -> None:
    # The openai client asks for base64 by default and decodes it.
    answer = client.embeddings.create(model="tiny", input=IDS)
    floats = client.embeddings.create(model="tiny", input=IDS, encoding_format="float")
    assert answer.object == "list"
    assert answer.model == "tiny"
    assert [item.index for item in answer.data] == [0, 1, 2]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, IDS))
    for item, plain, expected in zip(answer.data, floats.data, reference, strict=True):
        vector = torch.tensor(item.embedding)
        assert vector.shape == (hidden_size,)
        # Batched differently, the two calls may round differently in the last bits.
        assert float((vector - torch.tensor(plain.embedding)).abs().max()) < 1e-6
        target = torch.nn.functional.normalize(expected, dim=0)
        assert float((vector - target).abs().max()) < 1e-5
        assert abs(float(vector.norm()) - 1.0) < 1e-5


def test_raw_base64_is_little_endian_float32(served: tuple[str, Path], hidden_size: int) -> None:
    body = {"model": "tiny", "input": IDS[1], "encoding_format": "base64"}
    answer = httpx.post(f"{served[0]}/v1/embeddings", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    encoded = answer.json()["data"][0]["embedding"]
    vector = struct.unpack(f"<{hidden_size}f", base64.b64decode(encoded))
    plain = httpx.post(
        f"{served[0]}/v1/embeddings", json={**body, "encoding_format": "float"}, timeout=30
    ).json()["data"][0]["embedding"]
    assert list(vector) == plain


def test_vllm_extensions_and_text_input(
    client: openai.OpenAI, reference: list[torch.Tensor], hidden_size: int
) -> None:
    raw = client.embeddings.create(
        model="tiny", input=IDS[0], encoding_format="float", extra_body={"normalize": False}
    )
    assert float((torch.tensor(raw.data[0].embedding) - reference[0]).abs().max()) < 1e-4
    tail = client.embeddings.create(
        model="tiny",
        input=[[1, 2, 3, *IDS[2]]],
        encoding_format="float",
        extra_body={"truncate_prompt_tokens": len(IDS[2])},
    )
    alone = client.embeddings.create(model="tiny", input=[IDS[2]], encoding_format="float")
    gap = torch.tensor(tail.data[0].embedding) - torch.tensor(alone.data[0].embedding)
    assert float(gap.abs().max()) < 1e-6
    assert tail.usage.prompt_tokens == len(IDS[2])
    texts = client.embeddings.create(
        model="tiny", input=["hello world", "hello world", "something else"], dimensions=hidden_size
    )
    first, second, third = (torch.tensor(item.embedding) for item in texts.data)
    assert float((first - second).abs().max()) < 1e-6
    assert float((first - third).abs().max()) > 1e-2


def test_bad_requests_get_a_400_naming_the_field(client: openai.OpenAI, hidden_size: int) -> None:
    cases = [
        ({"input": [[1, 2], [9999]]}, "input", "input 1"),
        ({"input": []}, "input", "empty"),
        ({"input": ""}, "input", "empty"),
        ({"input": [1, 2], "dimensions": 32}, "dimensions", f"{hidden_size} dimensions"),
        ({"input": [1, "a"]}, "input", "mixes"),
    ]
    for fields, param, words in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(model="tiny", encoding_format="float", **fields)
        error = caught.value.body
        assert isinstance(error, dict), error
        assert error.get("param") == param, (fields, error)
        assert words in str(error.get("message")), (fields, error)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")
    assert client.embeddings.create(model="tiny", input="still serving").data


def test_embeddings_are_served_beside_a_streaming_generation(
    client: openai.OpenAI, reference: list[torch.Tensor]
) -> None:
    chunks: list[str] = []

    def generate() -> None:
        stream = client.completions.create(
            model="tiny",
            prompt=[3, 4, 5],
            max_tokens=60,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            chunks.append(chunk.choices[0].text)

    thread = threading.Thread(target=generate)
    thread.start()
    vectors = [
        client.embeddings.create(model="tiny", input=IDS, encoding_format="float") for _ in range(3)
    ]
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert len(chunks) >= 50
    for answer in vectors:
        for item, expected in zip(answer.data, reference, strict=True):
            target = torch.nn.functional.normalize(expected, dim=0)
            assert float((torch.tensor(item.embedding) - target).abs().max()) < 1e-5


def test_the_openapi_document_lists_the_endpoint(served: tuple[str, Path]) -> None:
    document = httpx.get(f"{served[0]}/schema/openapi.json", timeout=10).json()
    operation = document["paths"]["/v1/embeddings"]["post"]
    assert set(operation["responses"]) >= {"200", "400", "429", "503"}
    schema = document["components"]["schemas"]["EmbeddingRequest"]
    assert {"input", "encoding_format", "dimensions", "normalize"} <= set(schema["properties"])
