"""Model files a user (or an attacker who hands them a model) can break: a config.json that
disagrees with its weights is refused before a model is built from it, naming both numbers;
every broken file is one ``brigade: error:`` line and exit status 2, never a traceback."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import assert_refused, run_brigade

from brigade.config import check_config, load_config
from brigade.errors import ConfigError, ModelLoadError
from brigade.models.create import create_model
from brigade.registry import Registry, load_registry

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer tiny Llama: hidden 256, 4 heads and 2 KV heads of 64, MLP 688, 4000 tokens."""
    return create_model(
        tmp_path_factory.mktemp("files") / "tiny", "llama", overrides={"num_hidden_layers": 2}
    )


@pytest.fixture
def altered(model_dir: Path, tmp_path: Path) -> Callable[..., Path]:
    """``altered(config={...}, files={name: bytes})``: a copy of the model with config.json
    keys changed and files replaced."""

    def make(config: dict[str, Any] | None = None, files: dict[str, bytes] | None = None) -> Path:
        copy = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(model_dir, copy)
        original = json.loads((model_dir / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**original, **(config or {})}))
        for name, data in (files or {}).items():
            (copy / name).write_bytes(data)
        return copy

    return make


def check(registry: Registry, path: Path | str) -> list[str]:
    return check_config(load_config(None, registry, overrides=[f"model.path={path}"]), registry)


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"num_hidden_layers": 1_000_000}, "num_hidden_layers = 1000000, but the weights hold 2"),
        ({"num_hidden_layers": 10**30}, "num_hidden_layers = 10000000000000000000000000000"),
        ({"num_hidden_layers": 1}, "num_hidden_layers = 1, but the weights hold 2 layers"),
        ({"hidden_size": 512}, "hidden_size = 512, but the embedding"),
        ({"vocab_size": 8000}, "vocab_size = 8000, but the embedding"),
        ({"vocab_size": 10**30}, "vocab_size = 1000000000000000000000000000000, but"),
        ({"num_attention_heads": 8}, "num_attention_heads = 8, but 8 heads of 64 values need 512"),
        ({"num_key_value_heads": 4}, "num_key_value_heads = 4, but 4 heads of 64 values need 256"),
        ({"intermediate_size": 1000}, "intermediate_size = 1000, but model.layers.0.mlp.up_proj"),
    ],
)
def test_a_config_that_disagrees_with_its_weights_names_both_numbers(
    config: dict[str, Any], fragment: str, altered: Callable[..., Path], registry: Registry
) -> None:
    folder = altered(config)
    with pytest.raises(ModelLoadError) as refused:
        check(registry, folder)
    assert fragment in str(refused.value)
    assert str(folder / "config.json") in str(refused.value)


def test_a_gguf_whose_metadata_disagrees_with_its_tensor_table_names_both(
    altered: Callable[..., Path], registry: Registry, tmp_path: Path
) -> None:
    from brigade.testing.gguf_export import write_gguf

    claims_eight = altered({"num_hidden_layers": 8})  # the writer copies the count
    gguf_file = write_gguf(claims_eight, tmp_path / "eight.gguf")
    with pytest.raises(ModelLoadError, match=r"llama\.block_count = 8, but the weights hold 2"):
        check(registry, gguf_file)


def test_a_huge_layer_count_is_refused_before_the_model_is_built(
    altered: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine checks first: building a million-layer model is what must not start."""
    from brigade import LLM
    from brigade.plugins.models.architectures import DecoderArchitecture

    def build(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was built")

    monkeypatch.setattr(DecoderArchitecture, "build", build)
    with pytest.raises(ModelLoadError, match="num_hidden_layers = 1000000"):
        LLM(overrides=[f"model.path={altered({'num_hidden_layers': 1_000_000})}"])


@pytest.mark.parametrize(
    ("files", "fragment"),
    [
        ({"config.json": DEEP.encode()}, "config.json is not valid JSON: arrays or objects nested"),
        ({"config.json": b'{"architectures": ["LlamaForCausalLM"], "x": "\xff"}'}, "'utf-8'"),
        ({"config.json": b'{"vocab_size": ' + b"9" * 5000 + b"}"}, "an integer of 5000 digits"),
        ({"tokenizer_config.json": b'{"x": ' + DEEP.encode() + b"}"}, "nested too deeply"),
        ({"special_tokens_map.json": DEEP.encode()}, "special_tokens_map.json is not valid"),
        ({"chat_template.json": DEEP.encode()}, "chat_template.json is not valid JSON"),
        ({"chat_template.jinja": b"{{ '\xff' }}"}, "chat_template.jinja: cannot read"),
        ({"model.safetensors.index.json": DEEP.encode()}, "index.json is not valid JSON"),
    ],
)
def test_a_broken_model_file_is_a_model_error(
    files: dict[str, bytes], fragment: str, altered: Callable[..., Path], registry: Registry
) -> None:
    with pytest.raises(ModelLoadError) as refused:
        check(registry, altered(files=files))
    assert fragment in str(refused.value)


def test_a_deeply_nested_generation_config_is_a_model_error(
    altered: Callable[..., Path],
) -> None:
    from brigade.models.checkpoint import open_checkpoint

    data = b'{"x": ' + DEEP.encode() + b"}"
    checkpoint = open_checkpoint(str(altered(files={"generation_config.json": data})))
    with pytest.raises(ModelLoadError, match=r"generation_config\.json is not valid JSON"):
        checkpoint.sampling_defaults()


def test_absurd_positions_are_refused_not_allocated(
    altered: Callable[..., Path], registry: Registry
) -> None:
    with pytest.raises(ModelLoadError, match="max_position_embeddings must be a positive int"):
        check(registry, altered({"max_position_embeddings": 10**30}))
    # Within the bound, the RoPE tables and the token-id rows cannot fit any machine.
    with pytest.raises(ConfigError, match=r"would need .* of memory"):
        check(registry, altered({"max_position_embeddings": 2**31 - 1}))


@pytest.mark.parametrize(
    ("command", "change"),
    [
        ("config check", {"config": {"num_hidden_layers": 1_000_000}}),
        ("generate", {"config": {"num_hidden_layers": 1_000_000}}),
        ("serve", {"config": {"num_hidden_layers": 1_000_000}}),
        ("generate", {"files": {"tokenizer_config.json": DEEP.encode()}}),
        ("serve", {"files": {"tokenizer_config.json": DEEP.encode()}}),
        ("serve", {"files": {"config.json": b"\xff\xfe"}}),
        ("generate", {"files": {"generation_config.json": DEEP.encode()}}),
    ],
)
def test_the_command_line_answers_a_broken_model_with_one_line(
    command: str, change: dict[str, Any], altered: Callable[..., Path]
) -> None:
    folder = altered(**change)
    argv = {
        "config check": ["config", "check", "--set", f"model.path={folder}"],
        "generate": ["generate", "--set", f"model.path={folder}", "--prompt", "x"],
        "serve": ["serve", str(folder), "--port", "0"],
    }[command]
    broken = next(iter(change.get("files", {"config.json": b""})))
    assert_refused(run_brigade(*argv), broken)


def test_max_model_len_past_the_model_is_one_line(model_dir: Path) -> None:
    result = run_brigade(
        "generate", "--set", f"model.path={model_dir}", "--set", "model.max_model_len=100000",
        "--prompt", "x",
    )  # fmt: skip
    assert_refused(result, "max_model_len 100000 exceeds the model's max_position_embeddings")


def test_serve_refuses_a_model_it_cannot_run_before_starting_a_process(
    altered: Callable[..., Path], tmp_path: Path
) -> None:
    """What the model's headers show (a missing model, a config that disagrees with its
    weights) the server's supervisor refuses before it starts an engine or a front end."""
    for folder, fragment in (
        (tmp_path / "no-such-model", "does not exist"),
        (altered({"num_hidden_layers": 1_000_000}), "num_hidden_layers = 1000000"),
    ):
        result = run_brigade("serve", str(folder), "--port", "0")
        assert_refused(result, fragment)
        assert "processes_started" not in result.stdout + result.stderr
