"""The ``brigade`` command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from brigade.cli import main


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BRIGADE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_generate_on_the_default_model(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--prompt", "The kitchen opens at", "--prompt", "Hi", "--max-tokens", "12"]
    assert main(argv) == 0
    first = capsys.readouterr()
    lines = first.out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("'The kitchen opens at' -> '")
    assert lines[0] != lines[1].replace("'Hi'", "'The kitchen opens at'")
    assert "tokens in" in first.err
    assert any(cache_dir.rglob("model.safetensors")), "default model not cached"
    assert main(argv) == 0  # greedy and cached: the same text again
    assert capsys.readouterr().out.splitlines() == lines


def test_generate_with_a_created_model_and_a_prompts_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tmp_path / "qwen3"
    assert main(["model", "create", "--arch", "qwen3", "--out", str(model_dir)]) == 0
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == [
        "Qwen3ForCausalLM"
    ]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\n\ntwo\nthree\n")
    config = tmp_path / "engine.toml"
    config.write_text(f'[model]\npath = "{model_dir}"\n[kv]\npage_size = 8\nnum_pages = 64\n')
    capsys.readouterr()
    assert main(["generate", "--config", str(config), "--prompts-file", str(prompts)]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 3
    assert "KV pool 64 pages x 8" in captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate"], "give at least one --prompt"),
        (["generate", "--prompt", "x", "--max-tokens", "0"], "max_tokens=0 is invalid"),
        (["generate", "--prompt", "x", "--set", "kv.page_size=abc"], "expected int"),
        (
            ["generate", "--prompt", "x " * 40, "--set", "kv.num_pages=1"],
            "this engine serves at most 15 prompt tokens",
        ),
        (["generate", "--prompt", "x", "--set", "model.path=/nonexistent"], "/nonexistent"),
        (["model", "create", "--arch", "gpt2", "--out", "x"], "gpt2"),
        pytest.param(
            ["generate", "--prompt", "x", "--set", 'executor.plugin="cuda-graph"'],
            "needs a CUDA GPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present"),
        ),
    ],
)
def test_user_errors_are_one_line_messages(
    argv: list[str], message: str, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("brigade: error: ")
    assert message in err
    assert "Traceback" not in err


def test_console_script_is_installed() -> None:
    brigade = Path(sys.executable).with_name("brigade")
    result = subprocess.run([brigade, "config", "check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "(defaults): OK" in result.stdout


def test_serve_on_a_busy_port_fails_fast_with_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port), "--set", "model.path=/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err
