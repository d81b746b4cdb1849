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


def test_generate_on_the_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    """SmolLM2-135M-Instruct out of the box: a real answer, and the start-up banner."""
    argv = ["generate", "--chat", "--prompt", "What is the capital of France?"]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert first.out.startswith("'What is the capital of France?' -> '"), first.out
    assert "Paris" in first.out
    assert "SmolLM2-135M-Instruct loaded in" in first.err
    assert "GGUF, LlamaForCausalLM, tensors Q4_1 x210" in first.err
    assert "tokens in" in first.err
    assert main(argv) == 0  # greedy: the same text again
    assert capsys.readouterr().out == first.out


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
            [
                "generate",
                "--prompt",
                "x " * 40,
                "--set",
                "kv.num_pages=1",
                "--set",
                "model.path=random-tiny",
            ],
            "this engine serves at most 15 prompt tokens",
        ),
        (["generate", "--prompt", "x", "--set", "model.path=/nonexistent"], "/nonexistent"),
        (
            ["generate", "--prompt", "x", "-tp", "0"],
            "--tensor-parallel-size 0: expected a whole number of ranks, 1 or more",
        ),
        (
            ["generate", "--prompt", "x", "--set", "executor.tensor_parallel_size=0"],
            "tensor_parallel_size",
        ),
        (
            ["generate", "--prompt", "x", "-dp", "0"],
            "--data-parallel-size 0: expected a whole number of ranks, 1 or more",
        ),
        (
            ["generate", "--prompt", "x", "--distributed-executor-backend", "torchrun"],
            "expected mp, uni or ray",
        ),
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
    # The start-up banner may come first (when the engine loaded); the error is one line.
    assert err.splitlines()[-1].startswith("brigade: error: ")
    assert message in err.splitlines()[-1]
    assert "Traceback" not in err


@pytest.mark.parametrize("flag", ["-tp", "--tensor-parallel-size"])
def test_generate_takes_the_tensor_parallel_size(
    flag: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import brigade.llm
    from brigade.config import load_config
    from brigade.errors import BrigadeError
    from brigade.registry import default_registry

    given: list[list[str]] = []

    def fake_llm(config: str | None, overrides: list[str]) -> None:
        given.append(overrides)
        raise BrigadeError("stopped before loading")

    monkeypatch.setattr(brigade.llm, "LLM", fake_llm)
    assert main(["generate", "--prompt", "x", flag, "2"]) == 2
    assert "stopped before loading" in capsys.readouterr().err
    config = load_config(None, default_registry(), overrides=given[0], environ={})
    assert config["executor"].options.tensor_parallel_size == 2


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


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_names_the_distribution_and_the_plugin_api(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.metadata

    from brigade.interfaces import API_VERSION

    with pytest.raises(SystemExit) as exited:
        main([flag])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out == (
        f"brigade {importlib.metadata.version('brigade-llm')} (brigade-llm), "
        f"plugin API {API_VERSION}\n"
    )


@pytest.mark.parametrize("command", [["generate"], ["model", "create"]])
def test_every_flag_has_help(command: list[str]) -> None:
    import argparse

    from brigade.cli import _build_parser

    parser = _build_parser()
    for name in command:
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = subparsers.choices[name]
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 6
    for action in flags:
        assert (action.help or "").strip(), f"{action.option_strings[0]} has no help"
