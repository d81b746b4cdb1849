"""What an outside attacker tries against the real server: oversized and slow bodies, idle
and half-sent connections, deep nesting, key spellings, huge numbers, a client that leaves."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import select
import signal
import socket
import subprocess
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest
from server_harness import running_server, tiny_model, tiny_server_config

MiB = 1 << 20
KEYS = [f"k{i}" for i in range(10)]
LIMITS = """shutdown_timeout_s = 0.5
max_connections = 8
header_timeout_s = 1
body_timeout_s = 1
keep_alive_timeout_s = 1
requests_per_minute = 5
max_waiting_requests = 16
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen]]:
    """Each test uses its own key, so rate limits do not cross; the last one stops it."""
    model_dir = tiny_model(tmp_path_factory.mktemp("served"))
    keys = json.dumps([*KEYS, "clé"], ensure_ascii=False)
    config = tiny_server_config(
        model_dir, max_model_len=2048, num_pages=400, server=f"api_keys = {keys}\n{LIMITS}"
    )
    with running_server(config, tmp_path_factory.mktemp("srv")) as (base, process):
        yield base, process


@pytest.fixture
def server(served: tuple[str, subprocess.Popen]) -> str:
    return served[0]


def post(server: str, path: str, body: Any, key: str, timeout: float = 60) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server}{path}", json=body, headers=headers, timeout=timeout)


def address(server: str) -> tuple[str, int]:
    host, port = server.removeprefix("http://").split(":")
    return host, int(port)


def metric(server: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{server}/metrics").text
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE):
        if all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def tree_rss(pid: int) -> int:
    """Resident memory of the server: its process and the processes it started (the front
    ends that read bodies run apart from the supervisor with ``[server] engine_process``)."""
    server = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [server, *server.children(recursive=True)])


def test_a_chunked_body_over_the_limit_is_refused_while_it_arrives(
    served: tuple[str, subprocess.Popen],
) -> None:
    server, process = served
    before = tree_rss(process.pid)
    sock = socket.create_connection(address(server), timeout=5)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k1\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"10000\r\n" + b"x" * 0x10000 + b"\r\n"
    sent, answer = 0, b""
    try:
        while sent < 64 * MiB:
            if select.select([sock], [], [], 0)[0]:
                answer = sock.recv(4096)
                break
            sock.sendall(chunk)
            sent += 0x10000
        answer = answer or sock.recv(4096)
    except OSError:  # refused and closed (reset, broken pipe, or it stopped reading)
        pass
    finally:
        sock.close()
    grown = tree_rss(process.pid) - before
    assert sent < 16 * MiB, f"the server read {sent} bytes of a 1 MiB-limited body"
    assert grown < 32 * MiB, f"the server grew by {grown / MiB:.0f} MiB"
    assert not answer or answer.startswith(b"HTTP/1.1 413")
    assert httpx.get(f"{server}/health").status_code == 200


def test_nesting_beyond_64_levels_is_a_400(server: str) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    headers = {"Authorization": "Bearer k2", "Content-Type": "application/json"}
    user = '{"role": "user", "content": "hi"}'
    for body in (
        f'{{"messages": [{{"role": "user", "content": {deep}}}]}}',
        f'{{"messages": [{user}], "response_format": {deep}}}',
        f'{{"messages": [{user}], "tools": {deep}}}',
        f'{{"messages": [{user}, {{"role": "assistant", "tool_calls": {deep}}}]}}',
    ):
        refused = httpx.post(f"{server}/v1/chat/completions", content=body, headers=headers)
        assert refused.status_code == 400, body[:60]

    def schema(depth: int) -> str:  # JSON text: too deep for the client's json module too
        return '{"type": "array", "items": ' * depth + '{"type": "string"}' + "}" * depth

    for depth, param in ((5000, None), (70, "response_format")):
        body = (
            f'{{"messages": [{user}], "response_format": {{"type": "json_schema", '
            f'"json_schema": {{"schema": {schema(depth)}}}}}}}'
        )
        refused = httpx.post(f"{server}/v1/chat/completions", content=body, headers=headers)
        assert refused.status_code == 400, depth
        assert "nested too deeply" in refused.json()["error"]["message"]
        assert refused.json()["error"]["param"] == param
    tool = f'{{"type": "function", "function": {{"name": "f", "parameters": {schema(5000)}}}}}'
    body = f'{{"messages": [{user}], "tools": [{tool}]}}'
    refused = httpx.post(f"{server}/v1/chat/completions", content=body, headers=headers)
    assert refused.status_code == 400
    assert "nested too deeply" in refused.json()["error"]["message"]


def test_rate_limits_follow_the_key_whatever_the_spelling_of_bearer(server: str) -> None:
    body = {"prompt": [5], "max_tokens": 1}
    url = f"{server}/v1/completions"
    spellings = ["Bearer k0", "bearer k0", "BEARER k0", "Bearer  k0", "bEaReR k0"]
    for spelling in spellings:  # requests_per_minute = 5
        assert httpx.post(url, json=body, headers={"Authorization": spelling}).status_code == 200
    limited = httpx.post(url, json=body, headers={"Authorization": "Bearer k0"})
    assert limited.status_code == 429


def test_one_authorization_header_and_keys_compared_as_utf8(server: str) -> None:
    url = f"{server}/v1/models"
    twice = httpx.get(url, headers=[("Authorization", "Bearer k3"), ("Authorization", "Bearer x")])
    assert twice.status_code == 401
    assert "one Authorization header" in twice.json()["error"]["message"]
    assert httpx.get(url, headers=[(b"Authorization", "Bearer clé".encode())]).status_code == 200
    latin1 = httpx.get(url, headers=[(b"Authorization", "Bearer clé".encode("latin-1"))])
    assert latin1.status_code == 401


def test_idle_half_sent_and_surplus_connections(server: str) -> None:
    """max_connections = 8, header_timeout_s = 1."""
    idle = [socket.create_connection(address(server), timeout=10) for _ in range(7)]
    half = socket.create_connection(address(server), timeout=10)
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
    surplus = socket.create_connection(address(server), timeout=10)
    try:
        assert surplus.recv(4096).startswith(b"HTTP/1.1 503")
        for sock in [*idle, half]:  # closed by the server, well before the 10 s timeout
            assert sock.recv(4096) == b""
    finally:
        for sock in [*idle, half, surplus]:
            sock.close()
    answer = post(server, "/v1/completions", {"prompt": [5], "max_tokens": 1}, "k4")
    assert answer.status_code == 200


def test_a_body_that_does_not_arrive_in_time_is_a_408(server: str) -> None:
    with socket.create_connection(address(server), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k5\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt": '
        )
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408")


def test_a_non_streaming_client_that_leaves_aborts_its_request(server: str) -> None:
    aborted = metric(server, "brigade:request_success_total", finished_reason="abort")
    generated = metric(server, "brigade:generation_tokens_total")
    body = {"prompt": [5, 6], "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", body, "k6", timeout=1.0)
    deadline = time.monotonic() + 30
    while httpx.get(f"{server}/health").json()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "brigade:request_success_total", finished_reason="abort") == aborted + 1
    assert metric(server, "brigade:generation_tokens_total") - generated < 2000


def test_max_tokens_is_checked_against_the_context(server: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        ("/v1/completions", {"prompt": [5], "max_tokens": 10**18}, "max_tokens"),
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 10**18}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": messages, "max_completion_tokens": 3000},
            "max_completion_tokens",
        ),
    ]
    for path, body, param in cases:
        refused = post(server, path, body, "k7")
        assert refused.status_code == 400, body
        assert refused.json()["error"]["param"] == param
        assert "2048" in refused.json()["error"]["message"]  # the context it must fit


def test_a_batch_larger_than_the_queue_is_a_400_not_retry_later(server: str) -> None:
    refused = post(server, "/v1/completions", {"prompt": [[5]] * 17, "max_tokens": 1}, "k8")
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "prompt"
    assert "max_waiting_requests" in refused.json()["error"]["message"]


def test_errors_name_the_right_field_and_no_python_internals(server: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"temperature": 3.5e38}, "temperature"),
    ]
    for fields, param in cases:
        refused = post(server, "/v1/chat/completions", {"messages": messages, **fields}, "k9")
        error = refused.json()["error"]
        assert refused.status_code == 400, fields
        assert error["param"] == param, fields
        assert "sys." not in error["message"]
        assert "int_max_str_digits" not in error["message"]
    huge = b'{"prompt": [5], "max_tokens": 1' + b"0" * 5000 + b"}"
    headers = {"Authorization": "Bearer k9", "Content-Type": "application/json"}
    refused = httpx.post(f"{server}/v1/completions", content=huge, headers=headers)
    assert refused.status_code == 400
    assert "sys." not in refused.json()["error"]["message"]


def test_streams_are_200_and_the_openapi_document_tells_the_truth(server: str) -> None:
    body = {"prompt": [5], "max_tokens": 2, "stream": True}
    headers = {"Authorization": "Bearer k3"}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
    document = httpx.get(f"{server}/schema/openapi.json", headers=headers).json()
    components = document["components"]["schemas"]
    for path, item in document["paths"].items():
        for method, operation in item.items():
            assert "201" not in operation["responses"], (path, method)
            assert "200" in operation["responses"], (path, method)
            if method == "post" and path != "/ping":
                reference = operation["requestBody"]["content"]["application/json"]["schema"]
                assert reference["$ref"].rsplit("/", 1)[1] in components
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(chat) == {"application/json", "text/event-stream"}


def test_tokenization_runs_off_the_event_loop() -> None:
    """A tokenizer busy on a long prompt leaves the event loop free (/ping answers)."""
    from litestar.testing import TestClient

    from brigade.server.app import ServerState, create_app
    from brigade.server.ratelimit import RateLimiter
    from brigade.stations import ServerSettings

    entered, released, finished = threading.Event(), threading.Event(), threading.Event()

    class SlowTokenizer:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            entered.set()
            released.wait(10)
            finished.set()
            return [1, 2]

    model = types.SimpleNamespace(vocab_size=256, max_model_len=64)
    engine = types.SimpleNamespace(dead=None, info=model)
    state = ServerState(
        async_engine=engine,  # type: ignore[arg-type]
        frontend=None,  # type: ignore[arg-type]
        tokenizer=SlowTokenizer(),
        settings=ServerSettings(),
        model_name="tiny",
        metrics=None,  # type: ignore[arg-type]
        limiter=RateLimiter(0, 0),
    )
    with TestClient(create_app(state)) as app, concurrent.futures.ThreadPoolExecutor(1) as pool:
        tokenized = pool.submit(app.post, "/tokenize", json={"prompt": "long"})
        assert entered.wait(10)
        assert app.get("/ping").status_code == 200
        assert not finished.is_set(), "/ping waited for the tokenizer"
        released.set()
        assert tokenized.result().json()["tokens"] == [1, 2]


def test_without_keys_clients_are_told_apart_by_address_not_by_a_header() -> None:
    from litestar.datastructures import Headers

    from brigade.server.errors import RateLimitError
    from brigade.server.guards import authenticate, charge_rate_limit
    from brigade.server.ratelimit import RateLimiter
    from brigade.stations import ServerSettings

    settings = ServerSettings(requests_per_minute=2)
    limiter = RateLimiter(2, 0)

    def charge(header: str, host: str = "10.0.0.1") -> None:
        request: Any = types.SimpleNamespace(
            headers=Headers([(b"authorization", header.encode())]),
            client=types.SimpleNamespace(host=host),
            state={},
        )
        authenticate(request, settings)
        charge_rate_limit(request, limiter, settings, [[1]], 1)

    charge("Bearer made-up")
    charge("Bearer another")
    with pytest.raises(RateLimitError):
        charge("Bearer a-third")  # a new header is no new allowance
    charge("Bearer a-third", host="10.0.0.2")  # another client is


def test_a_flood_of_connection_warnings_is_logged_once_per_window() -> None:
    from brigade.server.http import ThrottledWarnings

    throttle = ThrottledWarnings(every_s=60)

    def record(message: str, level: int = logging.WARNING) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", level, __file__, 1, message, (), None)

    passed = [throttle.filter(record("Invalid HTTP request received.")) for _ in range(1000)]
    assert passed.count(True) == 1
    assert throttle.filter(record("Too many open connections (max_connections = %d)."))
    assert throttle.filter(record("Invalid HTTP request received.", logging.INFO))


def test_past_a_fractional_shutdown_timeout_streams_end_with_abort_and_an_error_event(
    served: tuple[str, subprocess.Popen],
) -> None:
    """Last in the module (it stops the server): shutdown_timeout_s = 0.5."""
    server, process = served
    body = {"prompt": [5, 6], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": "Bearer k4"}
    with httpx.stream(
        "POST", f"{server}/v1/completions", json=body, headers=headers, timeout=60
    ) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    # 0.5 s, not "no timeout": it stops long before 2000 tokens would take.
    assert process.wait(timeout=20) == 0
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-3][6:])["choices"][0]["finish_reason"] == "abort"
    # Then an error event: the client is told the server stopped it.
    error = json.loads(rest[-2][6:])["error"]
    assert error["code"] == "server_overloaded"
    assert "shutting down" in error["message"]
