"""OpenAI request bodies and the protocol error they decode to, shared by the wire-protocol
tests and the per-request ``extra`` tests."""

from __future__ import annotations

import json
from typing import Any

import pytest

from brigade.server.errors import ProtocolError
from brigade.server.protocol import ChatCompletionRequest, decode_json

USER = [{"role": "user", "content": "hi"}]


def chat_body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": USER, **fields}).encode()


def completion_body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


def protocol_error(body: bytes, type_: type = ChatCompletionRequest) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_json(body, type_)
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    return info.value
