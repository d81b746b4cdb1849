"""Create small, deterministic, randomly initialised HF-format models offline.

Nothing can be downloaded in tests or benchmarks, so this module writes complete HuggingFace
model directories (config, generation config, safetensors weights, tokenizer with a ChatML
chat template) that ``transformers.Auto*.from_pretrained`` loads without network access. The
tokenizer is byte-level BPE by default, or SentencePiece-style (Llama 2 layout) on request.

The same arguments always produce byte-identical ``model.safetensors`` and ``tokenizer.json``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from brigade.cache import cache_root
from brigade.models.tokenizer import CORPUS_PATH, MAX_VOCAB_SIZE, TokenizerKind, tokenizer_kind

__all__ = [
    "ARCHITECTURES",
    "DTYPES",
    "FORMAT_VERSION",
    "SIZES",
    "create_model",
    "default_model_dir",
    "default_model_name",
]

# Bump whenever the recipe (init scheme, config defaults, tokenizer setup) changes, so that
# default_model_dir() builds a fresh cache entry instead of reusing a stale one.
FORMAT_VERSION = 2

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
SIZES = ("tiny", "small")
DTYPES = ("float32", "bfloat16", "float16")

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Shapes match the benchmark documentation; do not change without updating it.
_SIZE_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {
        "vocab_size": 4000,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 688,
    },
    "small": {
        "vocab_size": 4000,
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 2816,
    },
}

# arch -> (config class, HF model class name, arch-specific config values)
_ARCH_SPECS: dict[str, tuple[type[PretrainedConfig], str, dict[str, Any]]] = {
    "llama": (
        LlamaConfig,
        "LlamaForCausalLM",
        {"rope_theta": 10000.0, "rms_norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False},
    ),
    # Qwen2 always has q/k/v biases in transformers; there is no flag for it.
    "qwen2": (
        Qwen2Config,
        "Qwen2ForCausalLM",
        {"rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "use_sliding_window": False},
    ),
    # Qwen3 has per-head q_norm/k_norm; head_dim comes from the size preset explicitly.
    "qwen3": (
        Qwen3Config,
        "Qwen3ForCausalLM",
        {
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "use_sliding_window": False,
        },
    ),
    # 4096 = max_position_embeddings, so the window never bites unless a test overrides it.
    "mistral": (
        MistralConfig,
        "MistralForCausalLM",
        {"rope_theta": 10000.0, "rms_norm_eps": 1e-5, "sliding_window": 4096},
    ),
}

# Keys the caller must set through create_model's own arguments (or never).
_RESERVED_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "tie_word_embeddings",
    }
)
# Read by every supported model even where the config class does not declare it.
_EXTRA_KNOWN_KEYS = frozenset({"rope_scaling", "head_dim"})
_TOKEN_ID_KEYS = frozenset({"bos_token_id", "eos_token_id", "pad_token_id"})

# Init scheme (see _init_std and _init_weights).  Chosen so that greedy decoding of random
# models is varied: the usual std=0.02 init makes every position predict the same token.  With
# unit-RMS embeddings the last hidden state depends strongly on the current token, and an
# independent random lm_head turns that into a pseudo-random next token.
_EMBED_STD = 1.0  # residual stream starts at unit RMS, dominated by the current token
_LINEAR_GAIN = 1.0  # linear weights ~ N(0, gain / sqrt(fan_in)): unit-variance outputs
_LOGIT_STD = 4.0  # target logit std: large enough that argmax ties are rare
_NORM_NOISE = 0.05  # RMSNorm weights ~ 1 + N(0, noise)
_BIAS_STD = 0.02


def create_model(
    out_dir: str | os.PathLike[str],
    arch: str = "llama",
    size: str = "tiny",
    *,
    seed: int = 0,
    dtype: str = "float32",
    tie_word_embeddings: bool = False,
    overrides: Mapping[str, Any] | None = None,
    tokenizer: str = "bpe",
) -> pathlib.Path:
    """Write a randomly initialised HF-format causal LM into ``out_dir`` and return its path.

    Args:
        out_dir: target directory; created if missing, existing files are overwritten.
        arch: one of :data:`ARCHITECTURES`.
        size: one of :data:`SIZES` (``tiny`` ~4.95M params, ``small`` ~102.6M params).
        seed: seed of the weight initialisation; same seed -> byte-identical weights.
        dtype: storage dtype of the weights, one of :data:`DTYPES`.
        tie_word_embeddings: share ``lm_head`` with the input embeddings (no ``lm_head``
            tensor is written).
        overrides: config fields to change, e.g. ``{"num_hidden_layers": 2}`` or
            ``{"sliding_window": 16}``; keys must be known to the architecture's config.
        tokenizer: ``"bpe"`` (byte-level BPE, ChatML special tokens, no BOS added) or
            ``"spm"`` (SentencePiece-style, Llama 2 layout: ``<unk>``/``<s>``/``</s>``, byte
            fallback, BOS added); the config's token ids follow it.

    Raises:
        ValueError: unknown ``arch``/``size``/``dtype``/``tokenizer`` or an invalid override.
    """
    kind = tokenizer_kind(tokenizer)
    config = _build_config(arch, size, dtype, tie_word_embeddings, overrides or {}, kind)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tensors = _init_weights(config, seed, _TORCH_DTYPES[dtype])
    # Fixed metadata only (no timestamps/versions) keeps the file byte-identical across runs.
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    config_dict = config.to_diff_dict()
    # transformers >= 4.56 writes "dtype"; older readers (and many tools) look for "torch_dtype".
    config_dict["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")

    generation_config = GenerationConfig(
        bos_token_id=kind.token_id(kind.bos_token),
        # A chat turn ends with <|im_end|>, plain text with EOS: stop on both.
        eos_token_id=[kind.token_id(token) for token in kind.stop_tokens],
        pad_token_id=kind.token_id(kind.pad_token),
    )
    generation_config.save_pretrained(str(out))
    kind.save(out, config.max_position_embeddings)
    return out


def _build_config(
    arch: str,
    size: str,
    dtype: str,
    tie_word_embeddings: bool,
    overrides: Mapping[str, Any],
    kind: TokenizerKind,
) -> PretrainedConfig:
    """Assemble and validate the transformers config for ``arch``/``size``."""
    if arch not in _ARCH_SPECS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {list(ARCHITECTURES)}")
    if size not in _SIZE_PRESETS:
        raise ValueError(f"unknown size {size!r}; expected one of {list(SIZES)}")
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {list(DTYPES)}")
    config_cls, model_cls_name, arch_values = _ARCH_SPECS[arch]
    _check_override_keys(arch, config_cls, overrides)
    values: dict[str, Any] = {
        **_SIZE_PRESETS[size],
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "bos_token_id": kind.token_id(kind.bos_token),
        "eos_token_id": kind.token_id(kind.eos_token),
        "pad_token_id": kind.token_id(kind.pad_token),
        **arch_values,
        **overrides,
        "tie_word_embeddings": tie_word_embeddings,
        "dtype": dtype,
        "architectures": [model_cls_name],
    }
    config = config_cls(**values)
    _check_built_config(config, overrides)
    return config


def _check_override_keys(
    arch: str, config_cls: type[PretrainedConfig], overrides: Mapping[str, Any]
) -> None:
    """Overrides name fields of the architecture's config that no argument of
    :func:`create_model` sets."""
    reserved = sorted(_RESERVED_KEYS.intersection(overrides))
    if reserved:
        raise ValueError(
            f"overrides may not set {reserved}; use create_model's arguments (dtype=, "
            "tie_word_embeddings=, arch=) instead"
        )
    # Only the architecture's own fields (plus token ids): the generic PretrainedConfig keys
    # (bad_words_ids, num_beams, ...) have nothing to do with the model and would hide typos.
    generic = set(PretrainedConfig().to_dict())
    known = (set(config_cls().to_dict()) - generic) | _EXTRA_KNOWN_KEYS | _TOKEN_ID_KEYS
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"unknown config keys for arch {arch!r}: {unknown}; known keys: {sorted(known)}"
        )


def _check_built_config(config: PretrainedConfig, overrides: Mapping[str, Any]) -> None:
    """The config holds the whole tokenizer's vocabulary, and every override as given."""
    if config.vocab_size < MAX_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MAX_VOCAB_SIZE} (the tokenizer's size), "
            f"got {config.vocab_size}"
        )
    # Some config classes silently drop values (Qwen2/Qwen3 set sliding_window to None unless
    # use_sliding_window=True); fail loudly instead of creating a different model than asked.
    for key, value in overrides.items():
        if value is not None and getattr(config, key, None) is None:
            raise ValueError(
                f"override {key}={value!r} was discarded by {type(config).__name__}; "
                "it probably depends on another field (e.g. qwen2/qwen3 sliding_window "
                "requires use_sliding_window=True)"
            )


def _init_std(name: str, shape: torch.Size, config: PretrainedConfig) -> tuple[float, float]:
    """Return ``(mean, std)`` of the normal distribution used for parameter ``name``."""
    if name.endswith("norm.weight"):
        return 1.0, _NORM_NOISE
    if name.endswith(".bias"):
        return 0.0, _BIAS_STD
    if name.endswith("embed_tokens.weight"):
        if config.tie_word_embeddings:
            # The same matrix produces the logits (unit-RMS final hidden state dot a row), so
            # its scale sets the logit std directly.
            return 0.0, _LOGIT_STD / math.sqrt(shape[1])
        return 0.0, _EMBED_STD
    if name == "lm_head.weight":
        return 0.0, _LOGIT_STD / math.sqrt(shape[1])
    if len(shape) == 2:
        return 0.0, _LINEAR_GAIN / math.sqrt(shape[1])
    raise ValueError(f"no init rule for parameter {name!r} with shape {tuple(shape)}")


def _init_weights(
    config: PretrainedConfig, seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Deterministically initialise every parameter of the HF model built from ``config``."""
    # Build on the meta device: we only need HF's exact parameter names and shapes, and
    # skipping the real allocation + HF init keeps "small" creation fast.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    persistent_buffers = set(model.state_dict()) - {n for n, _ in model.named_parameters()}
    persistent_buffers.discard("lm_head.weight")  # tied: present in state_dict, not a param
    if persistent_buffers:  # pragma: no cover - none of the supported models has any
        raise RuntimeError(f"unexpected persistent buffers: {sorted(persistent_buffers)}")

    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    # named_parameters() de-duplicates shared parameters, so a tied lm_head is skipped.
    # Sorting fixes the order in which the generator is consumed.
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        mean, std = _init_std(name, param.shape, config)
        tensor = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std + mean
        if config.tie_word_embeddings and name == "model.norm.weight":
            # With tied weights the residual stream still contains the current token's own
            # embedding row, so h . E favours repeating the input token forever.  Random signs
            # on the final norm make that self-term zero-mean without changing logit scale.
            signs = torch.randint(0, 2, param.shape, generator=generator) * 2 - 1
            tensor = tensor * signs
        tensors[name] = tensor.to(dtype).contiguous()
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return tensors


def _is_complete(path: pathlib.Path) -> bool:
    names = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return all((path / name).is_file() for name in names)


def default_model_name() -> str:
    """Cache directory name of the default model (includes the recipe version)."""
    # The corpus digest makes a corpus edit produce a new tokenizer dir even if someone
    # forgets to bump FORMAT_VERSION.
    digest = hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest()[:8]
    return f"brigade-llama-tiny-v{FORMAT_VERSION}-{digest}"


def default_model_dir() -> pathlib.Path:
    """Return the built-in default model (tiny llama, seed 0), building it on first use.

    The model lives in ``$BRIGADE_CACHE_DIR/models/<name>`` (default
    ``~/.cache/brigade/models/<name>``).  It is built in a temporary sibling directory and
    renamed into place, so readers never see a half-written model and concurrent builders
    simply let the first rename win.
    """
    target = cache_root() / "models" / default_model_name()
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        create_model(tmp, "llama", "tiny", seed=0)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache holds nothing secret
        try:
            # Atomic on POSIX; fails with ENOTEMPTY/EEXIST if another process won the race.
            os.replace(tmp, target)
        except OSError:
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not _is_complete(target):  # pragma: no cover - would indicate a broken filesystem
        raise RuntimeError(f"default model at {target} is incomplete")
    return target
