"""`brigade serve` out of the box: the default model (SmolLM2-135M-Instruct, a real trained
checkpoint) behind the real server, started with the flags a vLLM user types."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
from server_harness import running_server

VLLM_FLAGS = [
    "--api-key",
    "sk-test",
    "--served-model-name",
    "smol",
    "--max-model-len",
    "2k",
    "--max-num-seqs",
    "8",
    "--dtype",
    "float",
    "--block-size",
    "16",
]


def test_the_default_model_answers_through_vllm_style_flags(tmp_path: Path) -> None:
    with running_server("", tmp_path, args=VLLM_FLAGS) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test", max_retries=0)
        reply = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32,
            temperature=0,
        )
        answer = reply.choices[0].message.content or ""
        assert "Paris" in answer, answer
        assert reply.choices[0].finish_reason == "stop"
        assert client.models.retrieve("smol").id == "smol"
        tokenized = httpx.post(
            f"{base}/tokenize",
            json={"prompt": "Hello"},
            headers={"Authorization": "Bearer sk-test"},
            timeout=10,
        ).json()
        assert tokenized["max_model_len"] == 2000  # vLLM reads 2k as 2000
        assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 401  # the key holds
    log = next(tmp_path.glob("server-*.log")).read_text()
    assert "SmolLM2-135M-Instruct loaded in" in log
    assert "model.max_model_len=2000" in log
    assert "sk-test" not in log, "the API key must never be printed"
