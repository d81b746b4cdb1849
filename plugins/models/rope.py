"""Rotary position embeddings: config parsing, the cos/sin cache and its application.

Frequencies follow transformers' ``modeling_rope_utils`` exactly (default, linear, llama3,
yarn); ``freq_factors`` (per-frequency divisors, as llama.cpp's ``rope_freqs`` tensor holds
them) is how a GGUF file's Llama 3 scaling arrives. The rotation is transformers'
non-interleaved ``rotate_half`` convention: the first half of the head dimension pairs with
the second half.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["RopeConfig", "apply_rope", "inverse_frequencies", "parse_rope_config", "rope_cos_sin"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True, slots=True)
class RopeConfig:
    """Everything the cos/sin cache depends on, with the scaling's parameters."""

    head_dim: int
    theta: float
    max_positions: int
    rope_type: str = "default"
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The scaling dict as written in the config (``factor``, ``low_freq_factor``, ...)."""


def parse_rope_config(
    hf_config: Mapping[str, Any], head_dim: int, max_positions: int
) -> RopeConfig:
    """Read ``rope_theta`` + ``rope_scaling`` (older configs) or ``rope_parameters`` (newer).

    Raises ``ValueError`` naming the key for a scaling type or parameter this module cannot
    compute.
    """
    if isinstance(hf_config.get("rope_parameters"), Mapping):
        key = "rope_parameters"
        params: Mapping[str, Any] = hf_config["rope_parameters"]
        if all(isinstance(v, Mapping) for v in params.values()):
            raise ValueError(
                "rope_parameters: per-layer-type RoPE parameters are not supported; "
                "allowed: one dict with rope_type, rope_theta and the scaling's parameters"
            )
    else:
        key = "rope_scaling"
        params = hf_config.get("rope_scaling") or {}
        if not isinstance(params, Mapping):
            raise ValueError(f"rope_scaling must be a dict or null, got {params!r}")
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type == "dynamic":
        raise ValueError(
            f"{key}: rope_type 'dynamic' (NTK scaling that changes with the sequence length) "
            f"is not supported; allowed: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{key}: rope_type {rope_type!r} is not supported; "
            f"allowed: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(
            f"partial_rotary_factor={partial} is not supported; only 1.0 (rotate the whole head)"
        )
    required = {
        "linear": ("factor",),
        "yarn": ("factor",),
        "llama3": (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ),
    }.get(rope_type, ())
    missing = [name for name in required if params.get(name) is None]
    if missing:
        raise ValueError(f"{key}: rope_type {rope_type!r} needs {', '.join(missing)}")
    if theta <= 0:
        raise ValueError(f"rope_theta must be > 0, got {theta}")
    factors = params.get("freq_factors")
    if factors is not None:
        if rope_type != "default":
            raise ValueError(f"{key}: freq_factors go with rope_type 'default', not {rope_type!r}")
        if (
            not isinstance(factors, list | tuple)
            or len(factors) != head_dim // 2
            or not all(isinstance(f, int | float) and f > 0 for f in factors)
        ):
            raise ValueError(
                f"{key}: freq_factors must be {head_dim // 2} positive numbers (head_dim / 2)"
            )
    return RopeConfig(head_dim, theta, max_positions, rope_type, dict(params))


def inverse_frequencies(config: RopeConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, scaling applied."""
    return _inverse_frequencies(config)[0]


def _inverse_frequencies(config: RopeConfig) -> tuple[torch.Tensor, float]:
    """[head_dim // 2] float32 inverse frequencies and the cos/sin scale (yarn's mscale)."""
    dim, base, params = config.head_dim, config.theta, config.params
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    pos_freqs = base**exponents
    inv_freq = 1.0 / pos_freqs
    if config.rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if config.rope_type == "llama3":
        return _llama3_frequencies(inv_freq, params), 1.0
    if config.rope_type == "yarn":
        return _yarn_frequencies(pos_freqs, config)
    if params.get("freq_factors") is not None:
        # llama.cpp's rope_freqs tensor (how GGUF files carry Llama 3's scaling): each
        # frequency divided by its factor.
        return inv_freq / torch.tensor(params["freq_factors"], dtype=torch.float32), 1.0
    return inv_freq, 1.0


def _llama3_frequencies(inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_frequencies(pos_freqs: torch.Tensor, config: RopeConfig) -> tuple[torch.Tensor, float]:
    params, dim, base = config.params, config.head_dim, config.theta
    factor = float(params["factor"])
    original_max = params.get("original_max_position_embeddings") or config.max_positions

    def mscale(scale: float, coefficient: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        coefficient, coefficient_all = params.get("mscale"), params.get("mscale_all_dim")
        if coefficient and coefficient_all:
            attention_factor = mscale(factor, coefficient) / mscale(factor, coefficient_all)
        else:
            attention_factor = mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    blended = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return blended, float(attention_factor)


def rope_cos_sin(config: RopeConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin caches, each [max_positions, head_dim // 2] float32: the angles of the
    float32 frequencies, their cos and sin taken in float64 and rounded once. (Taken in
    float32, a test process's first table sometimes came out with errors of ~1e-4, ~13 correct
    bits, where a later one in the same process was right to the last bit; the cause was not
    found, float64 leaves any such error below float32's rounding.)"""
    inv_freq, scale = _inverse_frequencies(config)
    positions = torch.arange(config.max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq).double()  # [max_positions, head_dim // 2]
    cos, sin = (freqs.cos() * scale).float(), (freqs.sin() * scale).float()
    return cos.to(device), sin.to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [num_tokens, num_heads, head_dim] by cos/sin [num_tokens, head_dim // 2].

    Same arithmetic as transformers' ``x * cos + rotate_half(x) * sin`` with cos/sin
    duplicated over both halves.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos.unsqueeze(1)  # [num_tokens, 1, head_dim // 2]
    sin = sin.unsqueeze(1)  # [num_tokens, 1, head_dim // 2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
