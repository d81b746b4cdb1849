"""Reads a Hugging Face ``config.json`` dict into the shared decoder's settings.

Llama, Mistral, Qwen2 and Qwen3 are one decoder; a :class:`Family` records what each HF
architecture does differently, and defaults for absent keys mirror transformers' config
classes (4.57), so a config reads the same here as there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from brigade.plugins.models.rope import RopeConfig, parse_rope_config

__all__ = ["DecoderConfig", "Family", "parse_decoder_config"]

SUPPORTED_ACTIVATIONS = ("silu",)
MAX_SIZE = 2**31 - 1
"""The largest count or size a config key may give (heads, widths, positions): a tensor
dimension of a real model is far below it, and past it sizes multiply beyond what torch
indexes."""
MAX_LAYERS = 1 << 16
"""The most layers a config may give: real models have a few hundred at most, and the decoder
keeps a per-layer entry (its sliding window) for each before anything is built."""
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True, slots=True)
class Family:
    """How one HF architecture differs from the shared decoder."""

    architecture: str
    qkv_bias: bool | None
    """q/k/v projection bias; None = the config's ``attention_bias``."""
    o_bias: bool | None
    """Output projection bias; None = the config's ``attention_bias``."""
    reads_mlp_bias: bool
    """Whether the config's ``mlp_bias`` applies (else the MLP has no bias)."""
    qk_norm: bool
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""
    sliding: Literal["none", "all_layers", "qwen"]
    """none; ``sliding_window`` on every layer (Mistral); or Qwen's ``use_sliding_window`` +
    ``max_window_layers`` / ``layer_types``."""
    default_max_positions: int
    default_head_dim: int | None = None
    """``head_dim`` when the key is absent; None = hidden_size // num_attention_heads."""
    default_sliding_window: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class DecoderConfig:
    """The shared decoder's shape and per-family switches."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]
    """Per layer: the sliding window, or None for full attention."""
    rope: RopeConfig
    q_size: int = dataclasses.field(init=False)
    kv_size: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "q_size", self.num_heads * self.head_dim)
        object.__setattr__(self, "kv_size", self.num_kv_heads * self.head_dim)


def parse_decoder_config(hf_config: Mapping[str, Any], family: Family) -> DecoderConfig:
    """Validate ``hf_config`` for ``family``; ``ValueError`` names the key and what is allowed."""
    if hf_config.get("quantization_config"):
        raise ValueError(
            "quantization_config: quantized checkpoints are not supported; "
            "allowed: unquantized float32/bfloat16/float16 weights"
        )
    vocab_size = _positive_int(hf_config, "vocab_size")
    hidden_size = _positive_int(hf_config, "hidden_size")
    num_heads = _positive_int(hf_config, "num_attention_heads")
    num_kv_heads = _positive_int(hf_config, "num_key_value_heads", default=num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    head_dim = _head_dim(hf_config, family, hidden_size, num_heads)
    activation = hf_config.get("hidden_act", "silu")
    if activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"hidden_act={activation!r} is not supported; "
            f"allowed: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    rms_norm_eps = float(hf_config.get("rms_norm_eps", 1e-6))
    if rms_norm_eps <= 0:
        raise ValueError(f"rms_norm_eps must be > 0, got {rms_norm_eps}")
    num_layers = _positive_int(hf_config, "num_hidden_layers", maximum=MAX_LAYERS)
    attention_bias = bool(hf_config.get("attention_bias", False))
    max_positions = _positive_int(
        hf_config, "max_position_embeddings", default=family.default_max_positions
    )
    return DecoderConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=_positive_int(hf_config, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=rms_norm_eps,
        qkv_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
        o_bias=attention_bias if family.o_bias is None else family.o_bias,
        mlp_bias=family.reads_mlp_bias and bool(hf_config.get("mlp_bias", False)),
        qk_norm=family.qk_norm,
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        sliding_windows=_sliding_windows(hf_config, family, num_layers),
        rope=parse_rope_config(hf_config, head_dim, max_positions),
    )


def _positive_int(
    hf_config: Mapping[str, Any], key: str, default: int | None = None, maximum: int = MAX_SIZE
) -> int:
    value = hf_config.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"config.json has no {key!r}; it must be a positive integer")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ValueError(f"{key} must be a positive integer up to {maximum}, got {value!r}")
    return value


def _head_dim(
    hf_config: Mapping[str, Any], family: Family, hidden_size: int, num_heads: int
) -> int:
    if hf_config.get("head_dim") is not None:
        head_dim = _positive_int(hf_config, "head_dim")
    elif "head_dim" not in hf_config and family.default_head_dim is not None:
        head_dim = family.default_head_dim
    elif hidden_size % num_heads:
        raise ValueError(
            f"head_dim is not set and hidden_size ({hidden_size}) is not a multiple of "
            f"num_attention_heads ({num_heads}); set head_dim"
        )
    else:
        head_dim = hidden_size // num_heads
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
    return head_dim


def _sliding_windows(
    hf_config: Mapping[str, Any], family: Family, num_layers: int
) -> tuple[int | None, ...]:
    if family.sliding == "none":
        return (None,) * num_layers
    if family.sliding == "all_layers":
        window = hf_config.get("sliding_window", family.default_sliding_window)
        return (_window(window),) * num_layers
    if not hf_config.get("use_sliding_window", False):
        return (None,) * num_layers
    window = _window(hf_config.get("sliding_window"))
    if window is None:
        return (None,) * num_layers
    layer_types = hf_config.get("layer_types")
    if layer_types is None:
        full_layers = hf_config.get("max_window_layers", 28)
        if isinstance(full_layers, bool) or not isinstance(full_layers, int) or full_layers < 0:
            raise ValueError(f"max_window_layers must be an integer >= 0, got {full_layers!r}")
        return tuple(window if i >= full_layers else None for i in range(num_layers))
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ValueError(f"layer_types must list one type per layer ({num_layers})")
    unknown = sorted({t for t in layer_types if t not in _LAYER_TYPES})
    if unknown:
        raise ValueError(
            f"layer_types holds {', '.join(map(str, unknown))}; allowed: {', '.join(_LAYER_TYPES)}"
        )
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def _window(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"sliding_window must be a positive integer or null, got {value!r}")
    return value
