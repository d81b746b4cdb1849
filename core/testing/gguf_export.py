"""Write GGUF files from ``brigade model create`` directories, as llama.cpp's converter would.

Nothing can be downloaded in tests, so the GGUF tests convert random-weight Hugging Face
directories themselves: :func:`write_gguf` writes the metadata keys and tensor names of
llama.cpp's ``convert_hf_to_gguf.py`` (Llama and Mistral as ``llama``, with q/k rows
permuted for its interleaved RoPE; Qwen2 and Qwen3 as they are), 1-D tensors in F32 and
matrices in any type of :data:`~brigade.models.gguf.SUPPORTED_TENSOR_TYPES`.

The ``gguf`` package quantizes F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0; the K-quants
(Q2_K ... Q6_K) are quantized here, in ggml's block layouts. They are plain round-to-nearest
quantizers (the block scales, themselves quantized, are the better of the two nearest
levels), not llama.cpp's optimising search: their error is a little larger than llama.cpp's,
their bytes are as valid.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np
import torch

from brigade.models.gguf import SUPPORTED_TENSOR_TYPES
from brigade.models.loader import iter_safetensors

__all__ = ["GGUF_ARCHITECTURE_OF", "K_QUANT_TYPES", "quantize", "write_gguf"]

GGUF_ARCHITECTURE_OF: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",  # llama.cpp's converter writes Mistral as llama
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
"""Hugging Face ``architectures`` name -> the ``general.architecture`` written for it."""

K_QUANT_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
"""The types :func:`quantize` quantizes itself (the ``gguf`` package cannot)."""

_FILE_TYPES = {  # tensor type -> general.file_type (llama_ftype) of a file of mostly that type
    "F32": "ALL_F32",
    "F16": "MOSTLY_F16",
    "BF16": "MOSTLY_BF16",
    "Q8_0": "MOSTLY_Q8_0",
    "Q4_0": "MOSTLY_Q4_0",
    "Q4_1": "MOSTLY_Q4_1",
    "Q5_0": "MOSTLY_Q5_0",
    "Q5_1": "MOSTLY_Q5_1",
    "Q2_K": "MOSTLY_Q2_K",
    "Q3_K": "MOSTLY_Q3_K_S",
    "Q4_K": "MOSTLY_Q4_K_S",
    "Q5_K": "MOSTLY_Q5_K_S",
    "Q6_K": "MOSTLY_Q6_K",
}
_ROPE_KEYS = {"rope_type", "rope_theta", "factor", "original_max_position_embeddings"}
"""rope_parameters keys a GGUF of these architectures can express."""


def write_gguf(
    model_dir: Path,
    out: Path,
    *,
    tensor_type: str = "F32",
    tokenizer: bool = True,
    split_max_tensors: int = 0,
) -> Path:
    """Convert the HF model in ``model_dir`` to a GGUF at ``out``; return the file to load.

    Matrices are stored as ``tensor_type``, 1-D tensors (norms, biases) as F32. With
    ``tokenizer`` the tokenizer is written too (by :mod:`brigade.testing.gguf_tokenizer_export`).
    ``split_max_tensors`` > 0 splits the model into parts of at most that many tensors,
    named ``<stem>-00001-of-0000N.gguf`` as ``llama-gguf-split`` names them; the first part
    is returned.

    Raises ``ValueError`` for an architecture or tensor type that cannot be written, a matrix
    whose rows are not a multiple of the type's block size, or a config a GGUF of that
    architecture cannot express (sliding windows, RoPE scaling other than linear, yarn or
    Llama 3's, which becomes a ``rope_freqs`` tensor as llama.cpp writes it).
    """
    import gguf

    if tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise ValueError(
            f"tensor_type {tensor_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    arch = _gguf_architecture(model_dir, config)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, arch, split_max_tensors=split_max_tensors)
    _add_hyperparameters(writer, config, arch, Path(model_dir).name)
    writer.add_file_type(gguf.LlamaFileType[_FILE_TYPES[tensor_type]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_weights(writer, model_dir, config, arch, tensor_type)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    factors = _rope_frequency_factors(config, head_dim) if arch == "llama" else None
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors.astype(np.float32))
    if tokenizer:
        from brigade.testing.gguf_tokenizer_export import add_tokenizer_metadata

        add_tokenizer_metadata(writer, Path(model_dir))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(out)[0]


def _gguf_architecture(model_dir: Path, config: dict[str, Any]) -> str:
    """The ``general.architecture`` of the model ``config`` describes."""
    names = config.get("architectures") or []
    arch = next((GGUF_ARCHITECTURE_OF[n] for n in names if n in GGUF_ARCHITECTURE_OF), None)
    if arch is None:
        raise ValueError(
            f"{model_dir}: architecture {names} cannot be written as GGUF; supported: "
            f"{', '.join(GGUF_ARCHITECTURE_OF)}"
        )
    return arch


def _add_weights(
    writer: Any, model_dir: Path, config: dict[str, Any], arch: str, tensor_type: str
) -> None:
    """Every weight under its GGUF name (no ``output.weight`` for a tied model), matrices as
    ``tensor_type`` (``llama``'s q/k rows permuted), 1-D tensors as F32."""
    import gguf

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    num_heads = config["num_attention_heads"]
    heads = {"q_proj": num_heads, "k_proj": config.get("num_key_value_heads", num_heads)}
    for name, tensor in iter_safetensors(model_dir, torch.float32, "cpu"):
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue  # a tied model has no output.weight
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"{model_dir}: tensor {name!r} has no GGUF name for {arch}")
        values = tensor.numpy()
        projection = name.split(".")[-2]
        if arch == "llama" and projection in heads:
            values = _permute_for_llama_cpp(values, heads[projection])
        type_name = tensor_type if values.ndim == 2 else "F32"
        block_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]
        if values.shape[-1] % block_size:
            raise ValueError(
                f"tensor {name!r} has rows of {values.shape[-1]} values, not a multiple of "
                f"{type_name}'s block size {block_size}; pick shapes that are"
            )
        writer.add_tensor(
            gguf_name,
            quantize(values, type_name),
            raw_dtype=gguf.GGMLQuantizationType[type_name],
        )


def _add_hyperparameters(writer: Any, config: dict[str, Any], arch: str, name: str) -> None:
    """The ``{arch}.*`` keys ``convert_hf_to_gguf.py`` writes for ``config``."""
    import gguf

    window = config.get("sliding_window")
    max_positions = config["max_position_embeddings"]
    uses_window = config.get("use_sliding_window", True)  # Mistral's window always applies
    if window is not None and uses_window and window < max_positions:
        raise ValueError(
            f"sliding_window {window} < max_position_embeddings {max_positions}: a "
            f"{arch!r} GGUF cannot express sliding-window attention"
        )
    num_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    writer.add_name(name)
    writer.add_context_length(max_positions)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(config.get("num_key_value_heads", num_heads))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if "head_dim" in config or arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    # transformers >= 5 writes rope_parameters; older directories rope_theta + rope_scaling.
    rope = config.get("rope_parameters") or {
        "rope_theta": config.get("rope_theta", 10000.0),
        **(config.get("rope_scaling") or {}),
    }
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3" and arch == "llama":
        rope = {"rope_theta": rope["rope_theta"]}  # the scaling goes into rope_freqs.weight
    unknown = sorted(set(rope) - _ROPE_KEYS - {"type"})
    if rope_type not in ("default", "linear", "yarn", "llama3") or unknown:
        raise ValueError(
            f"RoPE {rope_type!r} with {unknown or 'no other keys'} cannot be written; "
            f"supported: default, linear or yarn with keys {', '.join(sorted(_ROPE_KEYS))}"
        )
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope_type in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType[rope_type.upper()])
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if rope_type == "yarn" and "original_max_position_embeddings" in rope:
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))


def _rope_frequency_factors(config: dict[str, Any], head_dim: int) -> np.ndarray | None:
    """Llama 3's RoPE scaling as llama.cpp's converter stores it: one divisor per frequency
    (the ``rope_freqs`` tensor), here derived from Brigade's own frequency code."""
    from brigade.plugins.models.rope import inverse_frequencies, parse_rope_config

    rope = parse_rope_config(config, head_dim, config["max_position_embeddings"])
    if rope.rope_type != "llama3":
        return None
    plain = parse_rope_config({"rope_theta": rope.theta}, head_dim, rope.max_positions)
    return (inverse_frequencies(plain) / inverse_frequencies(rope)).numpy()


def _permute_for_llama_cpp(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: within each head, the rows of the first half and
    of the second half (transformers' rotate_half pairs) are interleaved, so row 2i holds
    row i and row 2i + 1 row head_dim / 2 + i. weight: [num_heads * head_dim, ...]."""
    rows = weight.shape[0]
    # [heads, 2, head_dim / 2, ...] -> [heads, head_dim / 2, 2, ...]
    halves = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return np.ascontiguousarray(halves.swapaxes(1, 2).reshape(weight.shape))


def quantize(values: np.ndarray, type_name: str) -> np.ndarray:
    """``values`` [..., n] as GGML type ``type_name``: float32/float16 arrays for F32/F16,
    else the raw bytes [..., n / block_size * type_size] (uint8), which
    ``gguf.quants.dequantize`` reads back. ``n`` must be a multiple of the block size."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[type_name]
    values = np.ascontiguousarray(values, dtype=np.float32)
    quantizer = _K_QUANTIZERS.get(type_name)
    if quantizer is None:
        return quants.quantize(values, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if values.shape[-1] % block_size:
        raise ValueError(
            f"{type_name} needs rows that are a multiple of {block_size} values, got "
            f"{values.shape[-1]}"
        )
    blocks = quantizer(values.reshape(-1, block_size))  # [num_blocks, type_size]
    return blocks.reshape(*values.shape[:-1], values.shape[-1] // block_size * type_size)


# --- K-quants: super-blocks of 256 values in sub-blocks of 16 or 32 -------------------------


def _f16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to float16 (the super-block scales are stored in it)."""
    return values.astype(np.float16).astype(np.float32)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """[num_blocks] -> [num_blocks, 2] little-endian float16 bytes."""
    return values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, 0 where the denominator is 0."""
    safe = np.where(denominator == 0, 1, denominator)
    return np.where(denominator == 0, 0, numerator / safe)


def _pack(values: np.ndarray, bits: int, run: int) -> np.ndarray:
    """Pack [num_blocks, n] values of ``bits`` bits, 8 / bits per byte, ggml's way: byte l of
    each group of ``run`` bytes holds value l of the group's consecutive runs at bits 0, bits,
    2 * bits, ... -> [num_blocks, n * bits / 8] uint8."""
    per_byte = 8 // bits
    # [blocks, groups, per_byte, run]: run k of a group goes to bits k * bits
    runs = values.astype(np.uint8).reshape(values.shape[0], -1, per_byte, run)
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).reshape(1, 1, per_byte, 1)
    return np.bitwise_or.reduce(runs << shifts, axis=2).reshape(values.shape[0], -1)


def _best(
    candidates: Sequence[tuple[np.ndarray, ...]],
    x: np.ndarray,
    reconstruct: Callable[..., tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, ...]:
    """Per sub-block, the candidate (sub-block scale, ...) that reconstructs ``x`` best.

    Each candidate's parts are [blocks, subs]; ``reconstruct(*candidate)`` returns (levels q,
    approximation of x), both like ``x`` [blocks, subs, size]. Returns the winning parts
    followed by its q.
    """
    best: tuple[np.ndarray, ...] = ()
    best_error = np.full(x.shape[:2], np.inf)
    for candidate in candidates:
        levels, approx = reconstruct(*candidate)
        error = ((approx - x) ** 2).sum(axis=-1)  # [blocks, subs]
        better = error < best_error
        chosen = (*candidate, levels)
        best = tuple(
            np.where(better.reshape(better.shape + (1,) * (new.ndim - 2)), new, old)
            for new, old in zip(chosen, best or chosen, strict=True)
        )
        best_error = np.minimum(error, best_error)
    return best


def _affine(
    blocks: np.ndarray, sub_size: int, max_level: int, max_scale: int
) -> tuple[np.ndarray, ...]:
    """x ~ d * scale * q - dmin * min with q in [0, max_level], 6- or 4-bit sub-block scale
    and min in [0, max_scale]. blocks: [n, 256] -> d, dmin [n]; scale, min [n, subs]; q."""
    x = blocks.reshape(blocks.shape[0], -1, sub_size)  # [n, subs, sub_size]
    low = np.minimum(x.min(axis=-1), 0)  # the min is subtracted, so it is never positive
    step = (x.max(axis=-1) - low) / max_level  # [n, subs]
    d = _f16(step.max(axis=-1) / max_scale)  # [n]
    dmin = _f16((-low).max(axis=-1) / max_scale)  # [n]
    scale_floor = np.floor(_divide(step, d[:, None]))
    min_floor = np.floor(_divide(-low, dmin[:, None]))

    def levels(scale: np.ndarray, minimum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        step_q = (d[:, None] * scale)[..., None]
        offset = (dmin[:, None] * minimum)[..., None]
        q = np.clip(np.rint(_divide(x + offset, step_q)), 0, max_level)
        return q, step_q * q - offset

    # The rounded-down and rounded-up sub-block scale and min, whichever pair fits best.
    candidates = [
        (np.clip(scale_floor + a, 0, max_scale), np.clip(min_floor + b, 0, max_scale))
        for a, b in product((0, 1), repeat=2)
    ]
    scale, minimum, q = _best(candidates, x, levels)
    return d, dmin, scale.astype(np.uint8), minimum.astype(np.uint8), q.reshape(len(x), -1)


def _symmetric(
    blocks: np.ndarray, sub_size: int, max_level: int, max_scale: int
) -> tuple[np.ndarray, ...]:
    """x ~ d * scale * q with q in [-max_level - 1, max_level] and a signed sub-block scale in
    [-max_scale - 1, max_scale]; the value of largest magnitude maps to the most negative
    level, as in ggml. blocks: [n, 256] -> d [n], scale [n, subs], q [n, 256] (signed)."""
    x = blocks.reshape(blocks.shape[0], -1, sub_size)  # [n, subs, sub_size]
    peak = np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    step = peak / -(max_level + 1)  # [n, subs], signed
    biggest = np.take_along_axis(step, np.abs(step).argmax(axis=-1)[:, None], axis=-1)[:, 0]
    d = _f16(biggest / -(max_scale + 1))  # [n]
    scale_floor = np.floor(_divide(step, d[:, None]))

    def levels(scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        step_q = (d[:, None] * scale)[..., None]
        q = np.clip(np.rint(_divide(x, step_q)), -max_level - 1, max_level)
        return q, step_q * q

    candidates = [(np.clip(scale_floor + a, -max_scale - 1, max_scale),) for a in (0, 1)]
    scale, q = _best(candidates, x, levels)
    return d, scale, q.reshape(len(x), -1)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    """block_q2_K: scales[16] (scale | min << 4), qs[64] (2-bit), d, dmin."""
    d, dmin, scale, minimum, q = _affine(blocks, 16, 3, 15)
    return np.concatenate(
        [scale | (minimum << 4), _pack(q, 2, 32), _f16_bytes(d), _f16_bytes(dmin)], axis=1
    )


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    """block_q3_K: hmask[32] (bit 2 of q + 4), qs[64] (its bits 0-1), scales[12] (6-bit
    scale + 32: low nibbles in bytes 0-7, high 2 bits in bytes 8-11), d."""
    d, scale, q = _symmetric(blocks, 16, 3, 31)
    unsigned_q = (q + 4).astype(np.uint8)
    unsigned_scale = (scale + 32).astype(np.uint8)  # [n, 16]
    scales = np.concatenate(
        [_pack(unsigned_scale & 0x0F, 4, 8), _pack(unsigned_scale >> 4, 2, 4)], axis=1
    )
    return np.concatenate(
        [_pack(unsigned_q >> 2, 1, 32), _pack(unsigned_q & 3, 2, 32), scales, _f16_bytes(d)],
        axis=1,
    )


def _k_scales(scale: np.ndarray, minimum: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and mins: bytes 0-3 and 4-7 hold scales and
    mins 0-3 with bits 4-5 of those of 4-7 on top; bytes 8-11 their low nibbles."""
    low = scale[:, :4] | ((scale[:, 4:] >> 4) << 6)
    middle = minimum[:, :4] | ((minimum[:, 4:] >> 4) << 6)
    high = (scale[:, 4:] & 0x0F) | ((minimum[:, 4:] & 0x0F) << 4)
    return np.concatenate([low, middle, high], axis=1)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    """block_q4_K: d, dmin, scales[12], qs[128] (4-bit)."""
    d, dmin, scale, minimum, q = _affine(blocks, 32, 15, 63)
    return np.concatenate(
        [_f16_bytes(d), _f16_bytes(dmin), _k_scales(scale, minimum), _pack(q, 4, 32)], axis=1
    )


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    """block_q5_K: d, dmin, scales[12], qh[32] (bit 4), qs[128] (bits 0-3)."""
    d, dmin, scale, minimum, q = _affine(blocks, 32, 31, 63)
    q = q.astype(np.uint8)
    return np.concatenate(
        [
            _f16_bytes(d),
            _f16_bytes(dmin),
            _k_scales(scale, minimum),
            _pack(q >> 4, 1, 32),
            _pack(q & 0x0F, 4, 32),
        ],
        axis=1,
    )


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """block_q6_K: ql[128] (bits 0-3 of q + 32), qh[64] (bits 4-5), scales[16] (int8), d."""
    d, scale, q = _symmetric(blocks, 16, 31, 127)
    unsigned_q = (q + 32).astype(np.uint8)
    return np.concatenate(
        [
            _pack(unsigned_q & 0x0F, 4, 64),
            _pack(unsigned_q >> 4, 2, 32),
            scale.astype(np.int8).view(np.uint8),
            _f16_bytes(d),
        ],
        axis=1,
    )


_K_QUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
