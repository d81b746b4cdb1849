"""Shared fixtures."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

# Triton decides between compiled and interpreted kernels when a kernel is defined, so the
# switch must be on before any test (the attention conformance check included) loads them.
# Without CUDA the interpreter is the only way the triton backend runs at all.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_SHAPE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def build_hf_model(family: str, *, seed: int = 0, **overrides: Any) -> Any:
    """A tiny transformers model of ``family`` (llama, mistral, qwen2, qwen3), eager attention.

    Weights are drawn with a fixed seed at a scale that makes logits far from uniform, so
    greedy continuations vary: linear weights and embeddings N(0, 0.2), biases N(0, 0.1),
    norm weights 1 + N(0, 0.1).
    """
    import transformers

    config_class = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]
    config = config_class(**{**TINY_SHAPE, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.2)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    # generate() would mask prompt tokens equal to pad_token_id: pass an attention_mask.
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture
def hf_model_dir(tmp_path: Path) -> Callable[..., tuple[Any, Path]]:
    """Factory: ``hf_model_dir(family, storage_dtype=None, **config)`` -> (float32
    transformers model, its saved directory); ``storage_dtype`` sets the checkpoint's dtype."""

    def make(
        family: str, *, storage_dtype: torch.dtype | None = None, **overrides: Any
    ) -> tuple[Any, Path]:
        model = build_hf_model(family, **overrides)
        directory = tmp_path / family
        save_model(model, directory, storage_dtype)
        return model, directory

    return make


def save_model(model: Any, directory: Path, storage_dtype: torch.dtype | None = None) -> None:
    """Save ``model``; with ``storage_dtype``, stored in that dtype and the float32 model
    rounded to the stored values (so it stays an exact reference)."""
    if storage_dtype is None:
        model.save_pretrained(directory)
        return
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(storage_dtype))
    # A copy, so the reference keeps its float32 buffers (RoPE inv_freq) unrounded.
    copy.deepcopy(model).to(storage_dtype).save_pretrained(directory)


@pytest.fixture(scope="session")
def model_70b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with only Llama-3-70B's config.json (no weights, no tokenizer), for the
    simulated executor."""
    import json

    from simulated_helpers import LLAMA_3_70B

    directory = tmp_path_factory.mktemp("llama-3-70b")
    (directory / "config.json").write_text(json.dumps(LLAMA_3_70B), encoding="utf-8")
    return directory
