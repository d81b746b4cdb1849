"""vLLM's ``serve`` flag values read as Brigade's: each parser takes vLLM's spelling (a string,
or a list of them) and returns the config key's value, or raises ``ValueError`` saying what is
allowed. :data:`brigade.serve_flags.FLAGS` names the parser of each flag.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

from brigade.user_json import loads_json

__all__ = [
    "token_count",
    "integer",
    "rank_count",
    "executor_backend",
    "gib",
    "choice",
    "dtype",
    "kv_cache_dtype",
    "scheduling_policy",
    "device",
    "one_name",
    "hermes",
    "runner",
    "pooler_config",
    "speculative_config",
]

_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def token_count(text: str) -> int:
    """vLLM's human-readable integers: 4096; 4k = 4000 and 25.6k = 25600 (k m g t are powers
    of 1000); 32K = 32768 (K M G T are powers of 1024, whole numbers only)."""
    if text.strip().lower() in ("auto", "-1"):
        raise ValueError(
            "Brigade does not fit the length to memory (vLLM's auto and -1); leave the flag "
            "out for the model's own limit, or give a length"
        )
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if match is None or ("." in match[1] and match[2] not in _DECIMAL_SUFFIXES):
        raise ValueError(
            "expected a token count such as 4096, 4k (4000), 25.6k or 32K (32768); decimals "
            "only with k, m, g or t"
        )
    number, suffix = Decimal(match[1]), match[2]
    count = int(number * _DECIMAL_SUFFIXES.get(suffix, _BINARY_SUFFIXES.get(suffix, 1)))
    if count < 1:
        raise ValueError("expected at least 1 token")
    return count


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("expected an integer") from None


def rank_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        raise ValueError("expected a whole number of ranks, 1 or more") from None
    if count < 1:
        raise ValueError("expected a whole number of ranks, 1 or more")
    return count


def executor_backend(text: str) -> str:
    if text in ("mp", "uni"):
        return "mp"
    if text == "ray":
        return "ray"
    raise ValueError(
        "expected mp, uni or ray (external_launcher, torchrun starting every rank itself, is "
        "not supported: Brigade starts its ranks)"
    )


def gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise ValueError("expected a number of GiB >= 0")
    return value


def choice(mapping: dict[str, str], *, refused: str = "") -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text in mapping:
            return mapping[text]
        allowed = f"allowed: {', '.join(mapping)}"
        raise ValueError(f"{refused}; {allowed}" if refused and text.startswith("fp8") else allowed)

    return parse


dtype = choice(
    {
        "auto": "auto",
        "half": "float16",
        "float16": "float16",
        "bfloat16": "bfloat16",
        "float": "float32",
        "float32": "float32",
    }
)
kv_cache_dtype = choice(
    {
        "auto": "auto",
        "bfloat16": "bfloat16",
        "float16": "float16",
        "half": "float16",
        "float32": "float32",
    },
    refused="there is no fp8 KV cache yet",
)
scheduling_policy = choice({"fcfs": "fcfs", "priority": "priority"})


def device(text: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise ValueError("allowed: auto, cpu, cuda, cuda:N")
    return text


def one_name(names: Sequence[str]) -> str:
    if len(names) > 1:
        raise ValueError(
            f"Brigade serves one model name and has no aliases yet, so a client naming "
            f"{names[1]!r} would get 404; give one name (put MODEL before the flags if "
            f"{names[-1]!r} was meant as the model)"
        )
    return names[0]


def hermes(text: str) -> str:
    if text != "hermes":
        raise ValueError(
            "Brigade reads tool calls in the hermes format (`<tool_call>JSON</tool_call>`) only; "
            "allowed: hermes"
        )
    return text


def runner(text: str) -> str:
    if text not in ("auto", "generate", "pooling", "embed", "none"):
        raise ValueError(
            "Brigade serves generation and embeddings from one engine and has no other "
            "runner (classify, score, reward, transcription: not implemented yet); allowed: "
            "auto, generate, pooling, embed, none"
        )
    return text


def pooler_config(text: str) -> str:
    """vLLM's ``--pooler-config`` JSON -> ``server.embedding_pooling``."""
    try:
        config = loads_json(text)
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise ValueError('expected a JSON object such as \'{"pooling_type": "MEAN"}\'')
    others = sorted(set(config) - {"pooling_type"})
    if others:
        raise ValueError(
            f"only pooling_type is supported, not {', '.join(others)} (normalization: "
            "--set server.embedding_normalize=false)"
        )
    kind = str(config.get("pooling_type", "LAST")).upper()
    if kind not in ("LAST", "MEAN"):
        raise ValueError(f"pooling_type {kind} is not supported; allowed: LAST, MEAN")
    return kind.lower()


_SPECULATIVE_KEYS = {
    "num_speculative_tokens": "num_speculative_tokens",
    "disable_by_batch_size": "max_batch_size",
    "prompt_lookup_max": "max_n",
    "prompt_lookup_min": "min_n",
    "suffix_decoding_max_tree_depth": "max_depth",
    "suffix_decoding_max_cached_requests": "max_cached_requests",
    "suffix_decoding_max_spec_factor": "max_spec_factor",
    "suffix_decoding_min_token_prob": "min_probability",
    "model": "model",
}
"""vLLM's ``--speculative-config`` keys -> ``[speculative]`` keys (the method's options)."""
_METHOD_KEYS = frozenset(
    key
    for key in _SPECULATIVE_KEYS
    if key.startswith(("prompt_lookup", "suffix_decoding", "model"))
)
"""Keys that belong to one method (the prefix of its keys in ``speculative_config``)."""
_SPECULATIVE_METHODS = {"ngram": "ngram", "suffix": "suffix", "draft_model": "draft-model"}
"""vLLM's method names -> Brigade's proposers."""


def speculative_config(text: str) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` JSON -> the ``[speculative]`` keys it sets (``plugin``,
    the shared settings and the method's options)."""
    try:
        config = loads_json(text)
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise ValueError(
            'expected a JSON object such as \'{"method": "ngram", "num_speculative_tokens": 5}\''
        )
    method = config.get("method")
    if method is None and "model" in config:
        method = "draft_model"
    plugin = _SPECULATIVE_METHODS.get(method)  # type: ignore[arg-type]
    if plugin is None:
        raise ValueError(
            f"method {method!r} is not implemented yet (EAGLE, MTP and Medusa heads "
            f"included); allowed: {', '.join(_SPECULATIVE_METHODS)}"
        )
    # Each method's own keys: the others' are refused, not ignored.
    own = {"ngram": "prompt_lookup", "suffix": "suffix_decoding", "draft-model": "model"}[plugin]
    table: dict[str, Any] = {"plugin": plugin}
    unknown = []
    for key, value in config.items():
        if key == "method":
            continue
        target = _SPECULATIVE_KEYS.get(key)
        if target is None or (key in _METHOD_KEYS and not key.startswith(own)):
            unknown.append(key)
            continue
        table[target] = value
    if plugin == "draft-model" and "model" not in table:
        raise ValueError('method "draft_model" needs "model": the draft model\'s path')
    if unknown:
        allowed = ", ".join(
            k for k in _SPECULATIVE_KEYS if k not in _METHOD_KEYS or k.startswith(own)
        )
        raise ValueError(
            f"{', '.join(sorted(unknown))}: not supported with method {method!r}; "
            f"allowed: method, {allowed}"
        )
    return table
