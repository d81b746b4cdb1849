"""Tests for brigade.models.create: offline, deterministic HF-format model creation."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from brigade.models import create as create_mod
from brigade.models.create import (
    ARCHITECTURES,
    FORMAT_VERSION,
    create_model,
    default_model_dir,
)
from brigade.models.tokenizer import tokenizer_json

ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
PROMPTS = ("The quick brown fox", "def fibonacci(n):", "Once upon a time, in a land")
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
"""What a created model holds, as the pinned transformers 5 writes it (4.x also wrote
special_tokens_map.json)."""


def _greedy(model: torch.nn.Module, prompts: list[list[int]], steps: int = 32) -> torch.Tensor:
    """Plain greedy decoding (no EOS stop) of equal-length prompts as one batch.

    Returns the new tokens, shape ``[batch, steps]``.  Batching keeps the test fast.
    """
    tokens = torch.tensor(prompts)
    with torch.no_grad():
        for _ in range(steps):
            next_ids = model(tokens).logits[:, -1].argmax(dim=-1, keepdim=True)
            tokens = torch.cat([tokens, next_ids], dim=1)
    return tokens[:, len(prompts[0]) :]


def _prompt_ids(tokenizer: Any, n_tokens: int = 4) -> list[list[int]]:
    ids = [tokenizer.encode(prompt)[:n_tokens] for prompt in PROMPTS]
    assert all(len(row) == n_tokens for row in ids)
    return ids


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model(tmp_path_factory.mktemp("llama"), "llama", "tiny")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiny_model_loads_and_generates_varied_text(arch: str, tmp_path: Path) -> None:
    path = create_model(tmp_path / arch, arch, "tiny")
    assert sorted(os.listdir(path)) == sorted(FILES)

    config = AutoConfig.from_pretrained(path)
    assert config.architectures == [ARCH_CLASSES[arch]]
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (256, 4, 4000)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 64)
    assert config.max_position_embeddings == 4096
    assert config.tie_word_embeddings is False
    raw = json.loads((path / "config.json").read_text())
    assert raw["torch_dtype"] == "float32"
    # transformers 5 writes rope_theta inside rope_parameters
    assert raw["rope_parameters"]["rope_theta"] == (1e6 if arch.startswith("qwen") else 1e4)
    assert raw["rms_norm_eps"] == (1e-6 if arch.startswith("qwen") else 1e-5)
    if arch == "mistral":
        assert raw["sliding_window"] == 4096

    tokenizer = AutoTokenizer.from_pretrained(path)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert type(model).__name__ == ARCH_CLASSES[arch]
    n_params = sum(p.numel() for p in model.parameters())
    assert abs(n_params - 4.95e6) / 4.95e6 < 0.01, n_params

    prompts = _prompt_ids(tokenizer)
    with torch.no_grad():
        logits = model.eval()(torch.tensor(prompts)).logits
    assert torch.isfinite(logits).all()
    # Logits spread well beyond argmax ties yet far from overflow (measured std ~4).
    assert 2.0 < logits.std(dim=-1).mean().item() < 8.0

    new_tokens = _greedy(model, prompts).tolist()
    for row in new_tokens:
        assert len(set(row)) >= 8, row
    assert len({tuple(row) for row in new_tokens}) == len(PROMPTS), "prompts must diverge"


def test_same_call_is_byte_identical_and_seed_matters(tmp_path: Path) -> None:
    first = create_model(tmp_path / "a", "qwen2", "tiny", seed=3)
    second = create_model(tmp_path / "b", "qwen2", "tiny", seed=3)
    for name in FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name

    other = create_model(tmp_path / "c", "qwen2", "tiny", seed=4)
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()
    a, b = _tensors(first), _tensors(other)
    assert a.keys() == b.keys()
    assert all(not torch.equal(a[name], b[name]) for name in a)


def test_tokenizer_training_is_deterministic_across_processes() -> None:
    in_process = hashlib.sha256(tokenizer_json.__wrapped__().encode()).hexdigest()
    assert in_process == hashlib.sha256(tokenizer_json().encode()).hexdigest()
    code = (
        "import hashlib; from brigade.models.tokenizer import tokenizer_json; "
        "print(hashlib.sha256(tokenizer_json().encode()).hexdigest())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == in_process


def test_bfloat16_weights(tmp_path: Path) -> None:
    fp32 = _tensors(create_model(tmp_path / "fp32", "qwen3", "tiny"))
    path = create_model(tmp_path / "bf16", "qwen3", "tiny", dtype="bfloat16")
    bf16 = _tensors(path)
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
    # Same draws, only rounded: bf16 is the fp32 model cast down.
    assert all(torch.equal(bf16[name], fp32[name].to(torch.bfloat16)) for name in fp32)
    raw = json.loads((path / "config.json").read_text())
    assert raw["torch_dtype"] == "bfloat16"
    assert raw["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert model.dtype == torch.bfloat16


def test_tied_embeddings(tmp_path: Path) -> None:
    path = create_model(tmp_path / "tied", "llama", "tiny", tie_word_embeddings=True)
    tensors = _tensors(path)
    assert "lm_head.weight" not in tensors
    assert "model.embed_tokens.weight" in tensors
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokenizer = AutoTokenizer.from_pretrained(path)
    new_tokens = _greedy(model.eval(), _prompt_ids(tokenizer)[:1])[0].tolist()
    assert len(set(new_tokens)) >= 8, new_tokens


def test_overrides_are_applied(tmp_path: Path) -> None:
    path = create_model(
        tmp_path / "m",
        "mistral",
        "tiny",
        overrides={"num_hidden_layers": 2, "sliding_window": 16},
    )
    config = AutoConfig.from_pretrained(path)
    assert (config.num_hidden_layers, config.sliding_window) == (2, 16)
    assert not any(name.startswith("model.layers.2.") for name in _tensors(path))

    path = create_model(
        tmp_path / "q",
        "qwen2",
        "tiny",
        overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    )
    assert AutoConfig.from_pretrained(path).rope_scaling["factor"] == 2.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "gpt2"}, "unknown arch 'gpt2'; expected one of \\['llama', 'qwen2'"),
        ({"size": "huge"}, "unknown size 'huge'; expected one of \\['tiny', 'small'\\]"),
        ({"dtype": "int8"}, "unknown dtype 'int8'"),
        ({"overrides": {"num_layers": 2}}, "unknown config keys .*'num_layers'"),
        ({"overrides": {"sliding_window": 8}}, "unknown config keys for arch 'llama'"),
        ({"overrides": {"torch_dtype": "float16"}}, "may not set \\['torch_dtype'\\]"),
        ({"overrides": {"vocab_size": 100}}, "vocab_size must be >= 4000"),
        ({"arch": "qwen2", "overrides": {"sliding_window": 8}}, "use_sliding_window=True"),
    ],
)
def test_invalid_arguments(kwargs: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        create_model(tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists(), "nothing is written for invalid arguments"


def test_chat_template(llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    assert "chat_template" in json.loads((llama_dir / "tokenizer_config.json").read_text())
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello?"},
        {"role": "assistant", "content": "Hi."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello?<|im_end|>\n"
        "<|im_start|>assistant\nHi.<|im_end|>\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_start) == 4
    assert ids.count(im_end) == 3

    generation = json.loads((llama_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.eos_token_id, im_end]


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "  leading spaces,\ttabs and\r\nnewlines  ",
        "Café naïve façade, Zürich, Dvořák — «quotes» “curly” …",
        "日本語のテキスト、中文 한국어 😀🚀 ❤️",
        'def f(x):\n    return {"key": [1, 2.5e-3, None]}\n',
        "<|im_start|>user\nhi<|im_end|>",
    ],
)
def test_tokenizer_round_trip(llama_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < 4000 for i in ids)


def test_tokenizer_special_tokens(llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    assert len(tokenizer) <= 4000
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3, 4]) == [
        "<|endoftext|>",
        "<|begin_of_text|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|pad|>",
    ]
    assert (tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token) == (
        "<|endoftext|>",
        "<|begin_of_text|>",
        "<|pad|>",
    )
    config = json.loads((llama_dir / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"], config["pad_token_id"]) == (0, 1, 4)
    # BOS is not added implicitly: encoding is exactly the BPE of the text.
    assert tokenizer.encode("a")[0] != tokenizer.bos_token_id


def test_default_model_dir_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BRIGADE_CACHE_DIR", str(tmp_path))
    path = default_model_dir()
    assert path.parent == tmp_path / "models"
    assert f"-v{FORMAT_VERSION}-" in path.name
    assert AutoConfig.from_pretrained(path).architectures == ["LlamaForCausalLM"]
    assert os.listdir(path.parent) == [path.name], "no temp dirs are left behind"

    def fail(*args: object, **kwargs: object) -> Path:
        raise AssertionError("the cached model must be reused, not rebuilt")

    monkeypatch.setattr(create_mod, "create_model", fail)
    assert default_model_dir() == path


def test_default_model_dir_tolerates_losing_a_race(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BRIGADE_CACHE_DIR", str(tmp_path))
    target = tmp_path / "models" / create_mod.default_model_name()
    real_create = create_mod.create_model

    def racing_create(out_dir: Path, *args: object, **kwargs: object) -> Path:
        # Another process finishes first while we are still building.
        real_create(target, "llama", "tiny")
        return real_create(out_dir, *args, **kwargs)

    monkeypatch.setattr(create_mod, "create_model", racing_create)
    assert default_model_dir() == target
    assert os.listdir(target.parent) == [target.name]


@pytest.mark.slow
def test_small_model_shapes(tmp_path: Path) -> None:
    path = create_model(tmp_path / "small", "llama", "small", dtype="bfloat16")
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        shapes = {name: handle.get_slice(name).get_shape() for name in handle.keys()}  # noqa: SIM118
    n_params = sum(torch.Size(shape).numel() for shape in shapes.values())
    assert abs(n_params - 102.6e6) / 102.6e6 < 0.005, n_params
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == [512, 1024]
    assert shapes["model.layers.7.mlp.down_proj.weight"] == [1024, 2816]
    assert AutoConfig.from_pretrained(path).num_attention_heads == 16
