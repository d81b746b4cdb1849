"""A GGUF model as Brigade's decoders read it: an HF-style config and HF-named tensors.

llama.cpp stores Llama/Mistral q and k projections permuted for its interleaved RoPE; they are
permuted back here, so the shared decoder (transformers' ``rotate_half`` convention) runs every
checkpoint unchanged. Qwen2/Qwen3 files use the NeoX layout and are read as they are. A file
without ``output.weight`` ties the LM head to the embeddings. Llama 3's RoPE scaling, which
llama.cpp bakes into a ``rope_freqs`` tensor, becomes ``rope_parameters.freq_factors``.

Quantized tensors are dequantized with ``gguf.quants`` (float32, then cast to the model
dtype), a few at a time on worker threads (NumPy releases the GIL), so at most a handful of
dequantized tensors exist beside the model.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from brigade.errors import ModelLoadError
from brigade.models.gguf import GGUF_ARCHITECTURES, SUPPORTED_TENSOR_TYPES, GGUFFile, GGUFTensor

__all__ = ["gguf_hf_config", "gguf_metadata_key", "gguf_weights", "hf_tensor_name"]

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_ROPE_FREQS = "rope_freqs.weight"
_PERMUTED = ("llama", "mistral")
"""Architectures whose q/k rows llama.cpp stores interleaved (converted with ``permute``)."""

_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def hf_tensor_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None when it has none."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    match = _LAYER_NAME.match(name)
    if match is None or match[2] not in _LAYER_TENSORS:
        return None
    return f"model.layers.{match[1]}.{_LAYER_TENSORS[match[2]]}.{match[3]}"


_METADATA_KEYS = {
    "num_hidden_layers": "block_count",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "max_position_embeddings": "context_length",
}
"""config.json keys -> the ``<architecture>.`` metadata keys :func:`gguf_hf_config` reads."""


def gguf_metadata_key(file: GGUFFile, key: str) -> str:
    """The metadata key a config key of :func:`gguf_hf_config` comes from (``vocab_size``:
    the embedding's rows)."""
    if key in _METADATA_KEYS:
        return f"{file.architecture}.{_METADATA_KEYS[key]}"
    return "token_embd.weight rows" if key == "vocab_size" else key


def gguf_hf_config(file: GGUFFile) -> dict[str, Any]:
    """An HF ``config.json``-shaped dict for ``file``; raises ``ModelLoadError`` for an
    architecture, tensor type or tensor that Brigade cannot load."""
    arch = file.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{file.path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    _check_tensors(file, arch)

    def key(name: str, default: Any = None) -> Any:
        return file.get(f"{arch}.{name}", default)

    hidden_size = _int(file, f"{arch}.embedding_length", key("embedding_length"))
    num_heads = _int(file, f"{arch}.attention.head_count", key("attention.head_count"))
    num_kv_heads = _int(
        file, f"{arch}.attention.head_count_kv", key("attention.head_count_kv", num_heads)
    )
    head_dim = key("attention.key_length") or hidden_size // num_heads
    value_dim = key("attention.value_length") or head_dim
    if value_dim != head_dim:
        raise ModelLoadError(
            f"{file.path}: {arch}.attention.value_length {value_dim} differs from key_length "
            f"{head_dim}; only equal key and value head sizes are supported"
        )
    rotary_dim = key("rope.dimension_count") or head_dim
    if rotary_dim != head_dim:
        raise ModelLoadError(
            f"{file.path}: {arch}.rope.dimension_count {rotary_dim} is not the head size "
            f"{head_dim}; partial rotary embeddings are not supported"
        )
    embedding = file.tensors["token_embd.weight"]
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": embedding.shape[0],
        "hidden_size": hidden_size,
        "intermediate_size": _int(file, f"{arch}.feed_forward_length", key("feed_forward_length")),
        "num_hidden_layers": _int(file, f"{arch}.block_count", key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": _int(file, f"{arch}.context_length", key("context_length")),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "attention_bias": "blk.0.attn_q.bias" in file.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in file.tensors,
        "rope_parameters": _rope_parameters(file, arch, head_dim),
        "dtype": _checkpoint_dtype(file),
        "bos_token_id": file.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": file.get("tokenizer.ggml.eos_token_id"),
    }
    if arch == "mistral":
        config["sliding_window"] = key("attention.sliding_window")
    if arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    return config


def _int(file: GGUFFile, name: str, value: Any) -> int:
    if isinstance(value, list):
        raise ModelLoadError(
            f"{file.path}: {name} varies per layer ({value[:4]}...); only one value for all "
            "layers is supported"
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{file.path}: {name} must be a positive integer, got {value!r}")
    return value


def _check_tensors(file: GGUFFile, arch: str) -> None:
    unsupported = sorted(
        {t.type_name for t in file.tensors.values() if t.type_name not in SUPPORTED_TENSOR_TYPES}
    )
    if unsupported:
        names = [t.name for t in file.tensors.values() if t.type_name == unsupported[0]]
        raise ModelLoadError(
            f"{file.path}: tensor type {', '.join(unsupported)} (e.g. {names[0]}) is not "
            f"supported; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    if "token_embd.weight" not in file.tensors:
        raise ModelLoadError(f"{file.path}: no token_embd.weight tensor; not a {arch} model?")
    for name in file.tensors:
        if name != _ROPE_FREQS and hf_tensor_name(name) is None:
            hint = " (mixture-of-experts models are not supported)" if "_exps" in name else ""
            raise ModelLoadError(
                f"{file.path}: tensor {name!r} has no place in a {arch} model{hint}"
            )


def _checkpoint_dtype(file: GGUFFile) -> str:
    """The dtype ``[model] dtype = "auto"`` means: that of the weight matrices when they are
    all one float type; float32 for quantized or mixed files."""
    types = {t.type_name for t in file.tensors.values() if len(t.shape) == 2}
    if len(types) == 1 and next(iter(types)) in _FLOAT_TYPES:
        return _FLOAT_TYPES[next(iter(types))]
    return "float32"


def _rope_parameters(file: GGUFFile, arch: str, head_dim: int) -> dict[str, Any]:
    theta = float(file.get(f"{arch}.rope.freq_base", 10000.0))
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = file.get(f"{arch}.rope.scaling.type", "none")
    factor = file.get(f"{arch}.rope.scaling.factor")
    if scaling == "linear" and factor:
        params.update(rope_type="linear", factor=float(factor))
    elif scaling == "yarn" and factor:
        original = file.get(f"{arch}.rope.scaling.original_context_length")
        params.update(rope_type="yarn", factor=float(factor))
        if original:
            params["original_max_position_embeddings"] = int(original)
        attn_factor = file.get(f"{arch}.rope.scaling.attn_factor")
        if attn_factor:  # llama.cpp multiplies its default mscale by this
            params["attention_factor"] = float(attn_factor) * (0.1 * math.log(factor) + 1.0)
    elif scaling not in ("none", "linear", "yarn"):
        raise ModelLoadError(
            f"{file.path}: {arch}.rope.scaling.type {scaling!r} is not supported; "
            "supported: none, linear, yarn"
        )
    if _ROPE_FREQS in file.tensors:
        factors = _dequantize(file, file.tensors[_ROPE_FREQS]).flatten()
        if factors.numel() != head_dim // 2:
            raise ModelLoadError(
                f"{file.path}: {_ROPE_FREQS} has {factors.numel()} values; expected "
                f"head_dim / 2 = {head_dim // 2}"
            )
        params["freq_factors"] = [float(f) for f in factors]
    return params


def gguf_weights(
    file: GGUFFile,
    config: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    on_tensor: Callable[[int], None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every weight, dequantized and cast to ``dtype``.

    ``on_tensor(nbytes)`` is called as each tensor is read (for a progress bar).
    """
    arch = file.architecture
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors = [t for t in file.tensors.values() if t.name != _ROPE_FREQS]
    workers = max(1, min(4, os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="dequant") as pool:
        pending: list[tuple[GGUFTensor, concurrent.futures.Future[torch.Tensor]]] = []
        queue = iter(tensors)
        for tensor in queue:  # keep a bounded number of tensors in flight
            pending.append((tensor, pool.submit(_dequantize, file, tensor)))
            if len(pending) < 2 * workers:
                continue
            yield _finish(pending.pop(0), arch, heads, dtype, device, on_tensor)
        while pending:
            yield _finish(pending.pop(0), arch, heads, dtype, device, on_tensor)


def _finish(
    item: tuple[GGUFTensor, concurrent.futures.Future[torch.Tensor]],
    arch: str,
    heads: dict[str, int],
    dtype: torch.dtype,
    device: torch.device | str,
    on_tensor: Callable[[int], None] | None,
) -> tuple[str, torch.Tensor]:
    tensor, future = item
    values = future.result()
    match = _LAYER_NAME.match(tensor.name)
    if arch in _PERMUTED and match is not None and match[2] in heads:
        values = _unpermute(values, heads[match[2]])
    if on_tensor is not None:
        on_tensor(tensor.nbytes)
    name = hf_tensor_name(tensor.name)
    if name is None:  # pragma: no cover - gguf_hf_config refused such files
        raise ModelLoadError(f"{tensor.file}: tensor {tensor.name!r} has no place in the model")
    return name, values.to(device=device, dtype=dtype)


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute``: per head, rows (0, 2, 4, ..., 1, 3, 5, ...) back to
    transformers' first-half/second-half order. weight: [num_heads * head_dim, ...]."""
    rows = weight.shape[0]
    # [heads, head_dim / 2, 2, ...] -> [heads, 2, head_dim / 2, ...]
    halves = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return halves.transpose(1, 2).reshape(weight.shape)


def _dequantize(file: GGUFFile, tensor: GGUFTensor) -> torch.Tensor:
    """One tensor as float32 (or its own float type) in torch order, a fresh copy."""
    raw = np.frombuffer(file.data(tensor), dtype=np.uint8)
    array: np.ndarray[Any, Any]
    if tensor.type_name == "F32":
        array = raw.view(np.float32).copy()
    elif tensor.type_name == "F16":
        array = raw.view(np.float16).copy()
    elif tensor.type_name == "BF16":
        bits = torch.from_numpy(raw.view(np.int16).copy())
        return bits.view(torch.bfloat16).reshape(tensor.shape)
    else:
        from gguf import GGMLQuantizationType, quants

        rows = raw.reshape(math.prod(tensor.shape[:-1]) or 1, -1)
        array = quants.dequantize(rows, GGMLQuantizationType(tensor.type_id))
    return torch.from_numpy(np.ascontiguousarray(array)).reshape(tensor.shape)
