"""A real server with an API key: nothing short of that key opens a protected route, and
nothing a request sends makes the server read a file."""

from __future__ import annotations

import json
import socket
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import running_server, tiny_model, tiny_server_config

KEY = "s3cret-key"
TEMPLATE_MARK = "TEMPLATE-FILE-WAS-READ"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
PROTECTED: dict[tuple[str, str], dict[str, Any] | None] = {
    ("GET", "/v1/models"): None,
    ("GET", "/v1/models/tiny"): None,
    ("POST", "/tokenize"): {"prompt": "hi"},
    ("POST", "/detokenize"): {"tokens": [5, 6]},
    ("POST", "/v1/chat/completions"): CHAT,
    ("POST", "/v1/completions"): {"prompt": "hi", "max_tokens": 1},
    ("POST", "/v1/embeddings"): {"input": "hi"},
    ("POST", "/v1/responses"): {"input": "hi", "max_output_tokens": 1},
    ("GET", "/schema/openapi.json"): None,
}
"""Every route the API key guards, with a body it would answer 200 to."""
OPEN_PATHS = ("/health", "/metrics", "/ping", "/version")
REFUSED_AUTHORIZATION: dict[str, list[bytes]] = {
    "no header": [],
    "empty header": [b"Authorization:"],
    "scheme alone": [b"Authorization: Bearer"],
    "empty token": [b"Authorization: Bearer "],
    "blank token": [b"Authorization: Bearer    "],
    "tab token": [b"Authorization: Bearer \t "],
    "whitespace-only key": [b"Authorization: Bearer \t\t"],
    "non-breaking space token": [b"Authorization: Bearer \xc2\xa0"],
    "blank header": [b"Authorization:    "],
    "wrong key": [b"Authorization: Bearer not-the-key"],
    "key as a prefix": [f"Authorization: Bearer {KEY[:-1]}".encode()],
    "key with a space": [f"Authorization: Bearer {KEY} x".encode()],
    "another scheme": [f"Authorization: Basic {KEY}".encode()],
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The server, and a template file that no request may make it read."""
    root = tmp_path_factory.mktemp("auth")
    template = root / "evil.jinja"
    template.write_text(TEMPLATE_MARK + "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    config = tiny_server_config(
        tiny_model(root), max_model_len=256, num_pages=64, server=f'api_keys = ["{KEY}"]\n'
    )
    with running_server(config, root) as (base, _):
        yield base, template


def call(
    base: str, method: str, path: str, body: dict[str, Any] | None, headers: Any
) -> httpx.Response:
    return httpx.request(method, f"{base}{path}", json=body, headers=headers, timeout=60)


def raw_call(
    base: str, method: str, path: str, body: dict[str, Any] | None, headers: list[bytes]
) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a request sent byte for byte: HTTP clients refuse to send a
    header value with trailing whitespace, which is what an attacker sends."""
    host, port = base.removeprefix("http://").split(":")
    payload = json.dumps(body).encode() if body is not None else b""
    head = [f"{method} {path} HTTP/1.1".encode(), b"Host: x", b"Connection: close"]
    if body is not None:
        head += [b"Content-Type: application/json", f"Content-Length: {len(payload)}".encode()]
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"\r\n".join([*head, *headers]) + b"\r\n\r\n" + payload)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    _, _, content = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), json.loads(content or b"{}")


def test_the_table_names_every_route_but_the_open_ones(served: tuple[str, Path]) -> None:
    base, _ = served
    schema = call(base, "GET", "/schema/openapi.json", None, {"Authorization": f"Bearer {KEY}"})
    documented = {
        (method.upper(), path.replace("{model_id}", "tiny"))
        for path, item in schema.json()["paths"].items()
        for method in item
        if path not in OPEN_PATHS
    }
    assert documented <= set(PROTECTED), documented - set(PROTECTED)


@pytest.mark.parametrize(("method", "path"), list(PROTECTED))
def test_only_the_key_opens_a_protected_route(
    served: tuple[str, Path], method: str, path: str
) -> None:
    base, _ = served
    body = PROTECTED[(method, path)]
    for name, headers in REFUSED_AUTHORIZATION.items():
        status, answer = raw_call(base, method, path, body, headers)
        assert status == 401, (name, status, answer)
        assert answer["error"]["code"] == "invalid_api_key", name
    status, answer = raw_call(base, method, path, body, [f"Authorization: Bearer {KEY}".encode()])
    assert status == 200, answer


def test_a_request_cannot_name_a_template_file(served: tuple[str, Path]) -> None:
    """vLLM takes a per-request ``chat_template``; Brigade refuses it (and the template
    arguments may not smuggle one in), and /tokenize ignores it: the file is never read."""
    base, template = served
    auth = {"Authorization": f"Bearer {KEY}"}
    for extra, param in (
        ({"chat_template": str(template)}, "chat_template"),
        ({"chat_template_kwargs": {"chat_template": str(template)}}, "chat_template_kwargs"),
    ):
        refused = call(base, "POST", "/v1/chat/completions", {**CHAT, **extra}, auth)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == param
        assert TEMPLATE_MARK not in refused.text
    messages = {"messages": CHAT["messages"]}
    plain = call(base, "POST", "/tokenize", messages, auth).json()
    named = call(base, "POST", "/tokenize", {**messages, "chat_template": str(template)}, auth)
    assert named.status_code == 200
    assert named.json() == plain  # the model's own template, not the file's
    detokenized = call(base, "POST", "/detokenize", {"tokens": plain["tokens"]}, auth)
    assert TEMPLATE_MARK not in detokenized.json()["prompt"]


def test_no_token_never_matches_even_an_empty_key() -> None:
    """Defence in depth: settings that hold an empty key (built past their own check) still
    let no request without a token in."""
    from litestar.datastructures import Headers

    from brigade.server.errors import AuthenticationError
    from brigade.server.guards import authenticate
    from brigade.stations import ServerSettings

    settings = ServerSettings(api_keys=("k",))
    object.__setattr__(settings, "api_keys", ("", "k"))
    for header in ([], [(b"authorization", b"Bearer ")], [(b"authorization", b"Bearer  ")]):
        request: Any = types.SimpleNamespace(
            headers=Headers(header), client=types.SimpleNamespace(host="10.0.0.1"), state={}
        )
        with pytest.raises(AuthenticationError):
            authenticate(request, settings)
    request = types.SimpleNamespace(
        headers=Headers([(b"authorization", b"Bearer k")]), client=None, state={}
    )
    authenticate(request, settings)  # type: ignore[arg-type]
    assert request.state["brigade_client"] == "key:1"
