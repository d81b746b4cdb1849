"""The real server on 127.0.0.1, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_harness import running_server, tiny_model, tiny_server_config

KEY = "test-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = tiny_server_config(
        model_dir,
        max_model_len=512,
        num_pages=400,
        server=f'api_keys = ["{KEY}"]\nmax_request_bytes = 4096\n',
    )
    with running_server(config, tmp_path_factory.mktemp("srv")) as (base, _):
        yield base


@pytest.fixture
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def post(server: str, path: str, body: object, *, key: str | None = KEY, raw: bytes | None = None):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{server}{path}", content=content, headers=headers, timeout=60)


def health(server: str) -> dict:
    return httpx.get(f"{server}/health", timeout=10).json()


def test_chat_completion(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=12,
        temperature=0,
    )
    choice = response.choices[0]
    assert response.object == "chat.completion"
    assert response.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage is not None
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 < usage.completion_tokens <= 12


def test_completions_with_token_prompts_batches_and_n(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model="tiny",
        prompt=[[5, 6, 7], [8, 9]],
        max_tokens=5,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage is not None
    assert response.usage.prompt_tokens == 5
    assert response.usage.completion_tokens == 20
    again = client.completions.create(
        model="tiny",
        prompt=[[5, 6, 7], [8, 9]],
        max_tokens=5,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    texts = {c.index: c.text for c in response.choices}
    assert {c.index: c.text for c in again.choices} == texts, "same seed, same text"
    assert texts[0] != texts[1], "choice i uses seed + i"


def test_n_choices_share_the_prompt_pages(server: str, client: openai.OpenAI) -> None:
    before = metric(server, "brigade:prefix_cache_hits_total")
    prompt = list(range(100, 164))  # 8 full pages of 8 tokens
    response = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, n=4, temperature=1.0, seed=11
    )
    assert len(response.choices) == 4
    hits = metric(server, "brigade:prefix_cache_hits_total") - before
    assert hits >= 3 * 56, f"choices 1-3 should reuse choice 0's prompt pages, hits {hits}"


def test_streaming_chat_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Stream please"}],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals in (["length"], ["stop"])
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    whole = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Stream please"}],
        max_tokens=10,
        temperature=0,
    )
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = response.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == response.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the top
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
    completion = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=3,
        temperature=0,
        logprobs=2,
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 3  # type: ignore[arg-type]


def test_stop_strings_truncate_and_count_tokens_up_to_the_stop(client: openai.OpenAI) -> None:
    base = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 20,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.completions.create(**base)  # type: ignore[call-overload]
    text = full.choices[0].text
    stop = text[6:9]
    stopped = client.completions.create(**base, stop=[stop])  # type: ignore[call-overload]
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < full.usage.completion_tokens  # type: ignore[union-attr]


def test_models_tokenize_detokenize_and_schema(server: str, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    tokens = post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == 512
    text = post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    schema = httpx.get(f"{server}/schema/openapi.json", headers={"Authorization": f"Bearer {KEY}"})
    assert schema.status_code == 200
    assert "/v1/chat/completions" in schema.json()["paths"]


@pytest.mark.parametrize(
    ("path", "body", "raw", "status", "param"),
    [
        ("/v1/completions", None, b"{not json", 400, None),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, None, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, None, 400, "temperature"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"},
            None,
            404,
            "model",
        ),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, None, 400, None),
    ],
)
def test_bad_requests_get_openai_shaped_errors(
    server: str, path: str, body: object, raw: bytes | None, status: int, param: str | None
) -> None:
    response = post(server, path, body, raw=raw)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param


def test_prompt_longer_than_the_context_names_both_lengths(server: str) -> None:
    response = post(server, "/v1/completions", {"prompt": list(range(5, 705)), "max_tokens": 2})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "700" in message
    assert "512" in message


def test_api_keys_and_open_paths(server: str) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    assert post(server, "/v1/completions", body, key=None).status_code == 401
    wrong = post(server, "/v1/completions", body, key="nope")
    assert wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/v1/models").status_code == 401
    assert httpx.get(f"{server}/health").status_code == 200
    assert httpx.get(f"{server}/metrics").status_code == 200


def test_version_and_ping_answer_without_an_api_key(server: str) -> None:
    import importlib.metadata

    version = httpx.get(f"{server}/version")
    assert version.status_code == 200
    assert version.json() == {"version": importlib.metadata.version("brigade-llm")}
    assert httpx.get(f"{server}/ping").status_code == 200
    assert httpx.post(f"{server}/ping").status_code == 200


def test_retrieve_a_served_model_or_404(server: str, client: openai.OpenAI) -> None:
    listed = client.models.list().data[0]
    assert client.models.retrieve("tiny") == listed
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-9")
    assert missing.value.code == "model_not_found"
    assert "'gpt-9'" in missing.value.message
    assert httpx.get(f"{server}/v1/models/tiny").status_code == 401


def bare_app(model_name: str, *, shutting_down: bool = False) -> Any:
    """The app over a state with no engine: enough for the routes that read no engine."""
    from litestar.testing import TestClient

    from brigade.server.app import ServerState, create_app
    from brigade.server.ratelimit import RateLimiter
    from brigade.stations import ServerSettings

    state = ServerState(
        async_engine=types.SimpleNamespace(  # type: ignore[arg-type]
            dead=None, info=types.SimpleNamespace(vocab_size=256, max_model_len=64)
        ),
        frontend=None,  # type: ignore[arg-type]
        tokenizer=None,
        settings=ServerSettings(),
        model_name=model_name,
        metrics=None,  # type: ignore[arg-type]
        limiter=RateLimiter(0, 0),
        shutting_down=shutting_down,
    )
    return TestClient(create_app(state))


def test_ping_is_503_while_shutting_down() -> None:
    with bare_app("tiny", shutting_down=True) as app:
        assert app.get("/ping").status_code == 503
        assert app.post("/ping").status_code == 503
    with bare_app("tiny") as app:
        assert app.get("/ping").status_code == 200


def test_retrieve_a_model_whose_name_has_a_slash() -> None:
    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    with bare_app(name) as app:
        listed = app.get("/v1/models").json()["data"][0]
        assert app.get(f"/v1/models/{name}").json() == listed
        assert app.get("/v1/models/HuggingFaceTB%2FSmolLM2-135M-Instruct").json() == listed
        missing = app.get("/v1/models/HuggingFaceTB")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"


def test_body_over_the_limit_is_413(server: str) -> None:
    response = post(server, "/v1/completions", {"prompt": "x" * 5000, "max_tokens": 1})
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_disconnecting_client_aborts_and_frees_pages(server: str) -> None:
    idle = health(server)["num_free_pages"]
    body = {"prompt": "x", "max_tokens": 400, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert health(server)["num_free_pages"] < idle
    deadline = time.monotonic() + 10
    while health(server)["num_free_pages"] != idle and time.monotonic() < deadline:
        time.sleep(0.1)
    state = health(server)
    assert state["num_free_pages"] == idle
    assert state["num_running"] == 0


def test_concurrent_requests_are_batched(server: str, client: openai.OpenAI) -> None:
    def one(i: int) -> int:
        response = client.completions.create(
            model="tiny",
            prompt=[10 + i, 11, 12],
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return response.usage.completion_tokens  # type: ignore[union-attr]

    before = health(server)["num_steps"]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        assert list(pool.map(one, range(32))) == [16] * 32
    steps = health(server)["num_steps"] - before
    assert steps < 32 * 16 / 4, f"{steps} steps for 32 concurrent requests of 16 tokens"


def metric(server: str, name: str) -> float:
    text = httpx.get(f"{server}/metrics").text
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", re.MULTILINE)
    return sum(float(m.group(2)) for m in pattern.finditer(text))


def test_metrics_move_after_requests(server: str, client: openai.OpenAI) -> None:
    names = [
        "brigade:generation_tokens_total",
        "brigade:prompt_tokens_total",
        "brigade:time_to_first_token_seconds_count",
        "brigade:e2e_request_latency_seconds_count",
        "brigade:request_success_total",
    ]
    before = {n: metric(server, n) for n in names}
    client.completions.create(
        model="tiny", prompt=[1, 2, 3], max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    after = {n: metric(server, n) for n in names}
    assert after["brigade:generation_tokens_total"] - before["brigade:generation_tokens_total"] == 7
    assert after["brigade:prompt_tokens_total"] - before["brigade:prompt_tokens_total"] == 3
    for name in names[2:]:
        assert after[name] == before[name] + 1, name
    text = httpx.get(f"{server}/metrics").text
    assert "brigade:kv_cache_usage_perc" in text
    info = next(line for line in text.splitlines() if line.startswith("brigade:engine_info{"))
    assert 'scheduler="fcfs"' in info
    assert 'kv="paged"' in info


@pytest.fixture(scope="module")
def strict_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    config = f"""
[model]
path = "{model_dir}"
[kv]
page_size = 8
num_pages = 400
[scheduler]
max_num_seqs = 1
[server]
api_keys = ["a", "b", "c"]
max_waiting_requests = 1
requests_per_minute = 3
shutdown_timeout_s = 20
"""
    with running_server(config, tmp_path_factory.mktemp("strict")) as (base, process):
        yield base, process


def test_rate_limit_429_with_retry_after(strict_server: tuple) -> None:
    server, _ = strict_server
    statuses = [
        post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key="b") for _ in range(4)
    ]
    assert [r.status_code for r in statuses[:3]] == [200, 200, 200]
    limited = statuses[3]
    assert limited.status_code == 429
    assert int(limited.headers["Retry-After"]) >= 1
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"


def test_full_queue_is_503_and_running_requests_survive(strict_server: tuple) -> None:
    server, _ = strict_server
    long_body = {"prompt": "x", "max_tokens": 300, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, server, "/v1/completions", long_body, key="a")
        while health(server)["num_running"] == 0:
            time.sleep(0.05)
        waiting = pool.submit(post, server, "/v1/completions", long_body, key="a")
        while health(server)["num_waiting"] == 0:
            time.sleep(0.05)
        refused = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key="a")
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "server_overloaded"
        assert running.result().status_code == 200
        assert waiting.result().json()["usage"]["completion_tokens"] == 300


def test_sigterm_lets_running_requests_finish_then_exits_0(strict_server: tuple) -> None:
    server, process = strict_server
    body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    headers = {"Authorization": "Bearer c"}  # a and b spent their rate budget above
    with httpx.stream(
        "POST", f"{server}/v1/completions", json=body, headers=headers, timeout=60
    ) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        process.send_signal(signal.SIGTERM)
        draining = httpx.get(f"{server}/health", timeout=10)  # still listening, saying so
        refused = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key="c")
        rest = list(lines)
    assert draining.status_code == 503
    assert draining.json()["status"] == "shutting down"
    assert refused.status_code == 503
    assert "data: [DONE]" in rest
    finals = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert finals[-1]["choices"][0]["finish_reason"] == "length"
    assert process.wait(timeout=30) == 0
