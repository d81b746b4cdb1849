"""Write a created model's tokenizer into a GGUF file, as llama.cpp's ``convert_hf_to_gguf.py``.

For tests and the GGUF writer of created models: it reads ``tokenizer.json`` (either kind that
``brigade.models.create`` writes) and the configs beside it, and adds the ``tokenizer.ggml.*``
keys llama.cpp reads. Special token ids, add-BOS/EOS flags, merges (byte-level BPE) and the chat
template come from ``gguf.SpecialVocab``, the converter's own reader.

A SentencePiece-style ``tokenizer.json`` has no scores, only merges ordered by score, so the
scores are recovered from that order: a token's score is minus the rank of the first merge that
makes it, and tokens no merge makes rank below all of those (control and byte tokens get 0, as in
a SentencePiece model).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf

__all__ = ["add_tokenizer_metadata"]

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def add_tokenizer_metadata(writer: gguf.GGUFWriter, model_dir: Path) -> None:
    """Add the tokenizer of the model in ``model_dir`` to ``writer``'s metadata.

    Byte-level BPE is written as ``tokenizer.ggml.model = "gpt2"`` with pre-tokenizer ``"gpt-2"``
    (the regex of ``ByteLevel(use_regex=True)``); BPE with byte fallback as ``"llama"``
    (SentencePiece), with scores, byte token types and ``add_space_prefix``.

    Raises:
        ValueError: ``tokenizer.json`` is not a BPE model, or its ids have gaps.
    """
    model_dir = Path(model_dir)
    data = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(
            f"{model_dir / 'tokenizer.json'}: model type {model.get('type')!r}; only BPE models "
            "(byte-level, or with byte fallback) can be exported"
        )
    kind = "llama" if model.get("byte_fallback") else "gpt2"
    tokens = _tokens_in_id_order(model["vocab"], data.get("added_tokens", []), model_dir)
    _EXPORTERS[kind](writer, data, tokens)
    special_vocab = gguf.SpecialVocab(model_dir, load_merges=kind == "gpt2", n_vocab=len(tokens))
    special_vocab.add_to_gguf(writer, quiet=True)


def _add_byte_level(writer: gguf.GGUFWriter, data: dict[str, Any], tokens: list[str]) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(_token_types(data, tokens, byte_tokens=False))


def _add_sentencepiece(writer: gguf.GGUFWriter, data: dict[str, Any], tokens: list[str]) -> None:
    types = _token_types(data, tokens, byte_tokens=True)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(_scores(tokens, types, data["model"]["merges"]))
    writer.add_token_types(types)
    writer.add_add_space_prefix(_prepends_space(data.get("normalizer")))


_EXPORTERS: dict[str, Callable[[gguf.GGUFWriter, dict[str, Any], list[str]], None]] = {
    "gpt2": _add_byte_level,
    "llama": _add_sentencepiece,
}


def _tokens_in_id_order(
    vocab: dict[str, int], added: list[dict[str, Any]], model_dir: Path
) -> list[str]:
    by_id = {index: token for token, index in vocab.items()}
    by_id.update({entry["id"]: entry["content"] for entry in added})
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError(f"{model_dir / 'tokenizer.json'}: token ids are not 0..{len(by_id) - 1}")
    return [by_id[index] for index in range(len(by_id))]


def _token_types(data: dict[str, Any], tokens: list[str], *, byte_tokens: bool) -> list[int]:
    """NORMAL, with special added tokens CONTROL, other added tokens USER_DEFINED, the unknown
    token UNKNOWN and (SentencePiece) ``<0xNN>`` tokens BYTE."""
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    if byte_tokens:
        for index, token in enumerate(tokens):
            if _BYTE_TOKEN.fullmatch(token):
                types[index] = gguf.TokenType.BYTE
    for entry in data.get("added_tokens", []):
        special = entry.get("special")
        types[entry["id"]] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
    unk = data["model"].get("unk_token")
    if unk in tokens:
        types[tokens.index(unk)] = gguf.TokenType.UNKNOWN
    return types


def _scores(tokens: list[str], types: list[int], merges: list[Any]) -> list[float]:
    first_rank: dict[str, int] = {}
    for rank, merge in enumerate(merges):
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        first_rank.setdefault(left + right, rank)
    scores = []
    for index, token in enumerate(tokens):
        if token in first_rank:
            scores.append(-float(first_rank[token] + 1))
        elif types[index] == gguf.TokenType.NORMAL:
            scores.append(-float(len(merges) + 1 + index))
        else:
            scores.append(0.0)
    return scores


def _prepends_space(normalizer: dict[str, Any] | None) -> bool:
    """Whether the normalizer prepends ``▁`` (a Sequence holding a Prepend, as Llama 2's)."""
    if not normalizer:
        return False
    steps = normalizer.get("normalizers", [normalizer])
    return any(step.get("type") == "Prepend" for step in steps)
