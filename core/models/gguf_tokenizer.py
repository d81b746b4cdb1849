"""A GGUF file's tokenizer, rebuilt from its ``tokenizer.ggml.*`` metadata as llama.cpp reads it.

Two vocabulary kinds cover Llama, Mistral, Qwen2 and Qwen3 files (llama.cpp's
``src/llama-vocab.cpp`` is the reference for each rule below):

- ``gpt2``, byte-level BPE: the vocabulary and merges as stored; the text is split by the
  regexes llama.cpp picks from ``tokenizer.ggml.pre`` (:data:`PRE_TOKENIZERS`), applied in turn,
  each splitting the pieces the one before produced, then byte-encoded.
- ``llama``, SentencePiece BPE: merges recovered from the token scores
  (:func:`sentencepiece_merges`), byte fallback to ``<0xNN>`` tokens, spaces written as ``▁`` and
  one prepended to each stretch of text (after every special token, as llama.cpp does).

In both, control (and unknown) tokens become special added tokens, user-defined ones plain added
tokens, so they are matched whole before the rest of the text is split.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from brigade.errors import ModelLoadError
from brigade.models.gguf import GGUFFile
from brigade.models.tokenizer_loading import TokenizerSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "EOG_TOKEN_TEXTS",
    "PRE_TOKENIZERS",
    "SUPPORTED_TOKENIZER_MODELS",
    "PreTokenizer",
    "gguf_eos_token_ids",
    "gguf_tokenizer_spec",
    "sentencepiece_merges",
]

logger = logging.getLogger(__name__)

# gguf.TokenType values (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
_SPECIAL_TYPES = frozenset({_UNKNOWN, _CONTROL})
"""Matched whole in text and skipped when decoding with skip_special_tokens (llama.cpp's
special-token cache holds control, unknown and user-defined tokens; only the first two are
special)."""

EOG_TOKEN_TEXTS: frozenset[str] = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
    }
)
"""Token texts llama.cpp treats as end of generation whatever the metadata says (it also forces
them to control type)."""

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclasses.dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before byte-level BPE, for one family of ``tokenizer.ggml.pre``."""

    splits: tuple[str, ...]
    """Regexes applied in turn; each splits the pieces the previous one produced, and text it
    does not match stays a piece of its own."""
    ignore_merges: bool = False
    """A piece that is itself a vocabulary token is taken whole, without merging."""
    add_bos: bool = False
    """Whether BOS is added when the file has no ``tokenizer.ggml.add_bos_token``."""


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_FAMILIES: tuple[tuple[tuple[str, ...], PreTokenizer], ...] = (
    (("default",), _DEFAULT),
    (
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    (("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    (("falcon",), PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"))),
    (
        ("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion", "granite-docling"),
        PreTokenizer((_GPT2,)),
    ),
    (
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
        PreTokenizer((r"\p{N}", _GPT2)),
    ),
    (
        ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "kormo", "hunyuan", "solar-open"),
        PreTokenizer((_QWEN2,)),
    ),
    (("qwen35",), PreTokenizer((_QWEN35,))),
    (("tekken",), PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True)),
    (("gpt-4o", "llama4", "kanana2", "minimax-m2"), PreTokenizer((_GPT4O,))),
)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    name: family for names, family in _FAMILIES for name in names
}
"""``tokenizer.ggml.pre`` -> llama.cpp's regexes for it (the forms of the original
``tokenizer.json`` where llama.cpp shows them). Other names get ``"default"``, with a warning."""


@dataclasses.dataclass(frozen=True)
class _Vocabulary:
    """The ``tokenizer.ggml.*`` metadata every kind reads."""

    file: GGUFFile
    model: str
    tokens: list[str]
    token_types: list[int]

    def values(self, key: str, kind: type | tuple[type, ...]) -> list[Any] | None:
        """``tokenizer.ggml.<key>``, an array with an entry per token, or None when absent."""
        value = self.file.get(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if not isinstance(value, list) or (value and not isinstance(value[0], kind)):
            raise ModelLoadError(f"{self.file.path}: tokenizer.ggml.{key} is not an array")
        return value


@dataclasses.dataclass(frozen=True)
class _Kind:
    """What one ``tokenizer.ggml.model`` is built from."""

    build: Callable[[_Vocabulary], tuple[Tokenizer, bool]]
    """The backend without added tokens or post-processor, and llama.cpp's add-BOS default."""
    default_ids: dict[str, int]
    """llama.cpp's special token ids when the file names none (keyed by metadata key)."""


def gguf_tokenizer_spec(file: GGUFFile) -> TokenizerSpec:
    """The tokenizer ``file`` describes, tokenizing as llama.cpp does.

    Raises:
        ModelLoadError: no vocabulary, a ``tokenizer.ggml.model`` other than "gpt2" or "llama",
            or malformed tokenizer metadata.
    """
    from tokenizers import AddedToken

    vocabulary = _read_vocabulary(file)
    kind = _KINDS[vocabulary.model]
    backend, default_add_bos = kind.build(vocabulary)
    backend.add_tokens(
        [
            AddedToken(text, special=special, normalized=False)
            for text, special in _added_tokens(vocabulary)
        ]
    )
    special = {key: _special_token(vocabulary, kind, key) for key in _SPECIAL_ID_KEYS}
    add_bos = _flag(file, "tokenizer.ggml.add_bos_token", default_add_bos)
    add_eos = _flag(file, "tokenizer.ggml.add_eos_token", False)
    backend.post_processor = _post_processor(vocabulary, special, add_bos, add_eos)
    chat_template = file.get("tokenizer.chat_template")
    context_length = file.get(f"{file.get('general.architecture')}.context_length")
    return TokenizerSpec(
        backend=backend,
        bos_token=_text(vocabulary, special["bos_token_id"]),
        eos_token=_text(vocabulary, special["eos_token_id"]),
        unk_token=_text(vocabulary, special["unknown_token_id"]),
        pad_token=_text(vocabulary, special["padding_token_id"]),
        chat_template=chat_template if isinstance(chat_template, str) else None,
        model_max_length=context_length if isinstance(context_length, int) else None,
        source=str(file.path),
    )


def gguf_eos_token_ids(file: GGUFFile) -> frozenset[int]:
    """llama.cpp's end-of-generation tokens: the EOS, EOT and EOM ids the file names (EOS by
    llama.cpp's default when it names none) and every token spelled as in :data:`EOG_TOKEN_TEXTS`.

    Raises:
        ModelLoadError: as :func:`gguf_tokenizer_spec`.
    """
    vocabulary = _read_vocabulary(file)
    kind = _KINDS[vocabulary.model]
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    named = (_special_token(vocabulary, kind, key) for key in keys)
    texts = (i for i, text in enumerate(vocabulary.tokens) if text in EOG_TOKEN_TEXTS)
    return frozenset(token_id for token_id in (*named, *texts) if token_id is not None)


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging, as Hugging Face derives
    them: every split of a token into two vocabulary tokens is a merge, best score first.

    Ties keep Hugging Face's order (longer left part first, then longer right part, then token
    order). The work is one dictionary lookup per character of the vocabulary.
    """
    vocab = dict.fromkeys(tokens)
    candidates: list[tuple[float, int, int, str, str]] = []
    for token, score in zip(tokens, scores, strict=False):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                candidates.append((score, cut, len(right), left, right))
    # sorted() is stable, so equal keys stay in token order.
    candidates.sort(key=lambda merge: (-merge[0], -merge[1], -merge[2]))
    return [(left, right) for _, _, _, left, right in candidates]


def _read_vocabulary(file: GGUFFile) -> _Vocabulary:
    model = file.get("tokenizer.ggml.model")
    if not isinstance(model, str) or model not in _KINDS:
        raise ModelLoadError(
            f"{file.path}: tokenizer.ggml.model is {model!r}; Brigade builds tokenizers of "
            f"model {' and '.join(repr(name) for name in SUPPORTED_TOKENIZER_MODELS)} "
            "(byte-level BPE and SentencePiece BPE)"
        )
    tokens = file.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelLoadError(
            f"{file.path} has no tokenizer.ggml.tokens, so no vocabulary to build a tokenizer from;"
            " re-convert it with llama.cpp's convert_hf_to_gguf.py or serve the model's HF folder"
        )
    if "" in tokens:  # llama.cpp renames empty tokens so that each text names one token
        tokens = [text or f"[EMPTY_{index}]" for index, text in enumerate(tokens)]
    if len(set(tokens)) != len(tokens):
        duplicate = next(text for text, count in collections.Counter(tokens).items() if count > 1)
        raise ModelLoadError(f"{file.path}: token {duplicate!r} appears twice in the vocabulary")
    vocabulary = _Vocabulary(file, model, tokens, [])
    types = vocabulary.values("token_type", int)
    if types is not None and len(types) < len(tokens):
        raise ModelLoadError(
            f"{file.path}: tokenizer.ggml.token_type has {len(types)} entries for "
            f"{len(tokens)} tokens"
        )
    return dataclasses.replace(vocabulary, token_types=types or [])


def _byte_level_backend(vocabulary: _Vocabulary) -> tuple[Tokenizer, bool]:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    path = vocabulary.file.path
    stored = vocabulary.values("merges", str)
    if stored is None:
        raise ModelLoadError(f"{path}: a gpt2 vocabulary needs tokenizer.ggml.merges; it has none")
    # "left right", cut at the first space after the first character, as llama.cpp does.
    merges = [(m[:cut], m[cut + 1 :]) for m in stored for cut in (m.find(" ", 1),) if cut > 0]
    name = vocabulary.file.get("tokenizer.ggml.pre")
    pre = PRE_TOKENIZERS.get(name) if isinstance(name, str) else None
    if pre is None:
        described = f"tokenizer.ggml.pre {name!r} is unknown" if name else "no tokenizer.ggml.pre"
        logger.warning(
            "%s: %s; splitting text with llama.cpp's default pre-tokenizer, which may degrade "
            "generation (known: %s)",
            path,
            described,
            ", ".join(sorted(PRE_TOKENIZERS)),
        )
        pre = _DEFAULT
    model = models.BPE(
        vocab={text: index for index, text in enumerate(vocabulary.tokens)},
        merges=merges,
        ignore_merges=pre.ignore_merges,
    )
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend, pre.add_bos


def _sentencepiece_backend(vocabulary: _Vocabulary) -> tuple[Tokenizer, bool]:
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = vocabulary.tokens
    scores = vocabulary.values("scores", (float, int))
    if scores is not None and len(scores) < len(tokens):
        raise ModelLoadError(
            f"{vocabulary.file.path}: tokenizer.ggml.scores has {len(scores)} entries for "
            f"{len(tokens)} tokens"
        )
    unk = _special_token(vocabulary, _KINDS["llama"], "unknown_token_id")
    model = models.BPE(
        vocab={text: index for index, text in enumerate(tokens)},
        merges=sentencepiece_merges(tokens, scores or [0.0] * len(tokens)),
        unk_token=tokens[unk] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = Tokenizer(model)
    add_space_prefix = _flag(vocabulary.file, "tokenizer.ggml.add_space_prefix", True)
    # The normalizer sees each stretch of text between added tokens, so the prefix space lands
    # after every special token, as in llama.cpp.
    escape = normalizers.Replace(" ", "▁")
    prefixed = [normalizers.Prepend("▁"), escape] if add_space_prefix else [escape]
    backend.normalizer = normalizers.Sequence(prefixed)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend, True


_KINDS: dict[str, _Kind] = {
    "gpt2": _Kind(_byte_level_backend, {}),
    "llama": _Kind(
        _sentencepiece_backend,
        {"bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0},
    ),
}
SUPPORTED_TOKENIZER_MODELS: tuple[str, ...] = tuple(_KINDS)
"""The ``tokenizer.ggml.model`` values Brigade builds."""

_SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")


def _added_tokens(vocabulary: _Vocabulary) -> list[tuple[str, bool]]:
    """(text, special) of every token matched whole in text, in id order."""
    # Without token types llama.cpp takes every token as normal.
    types = vocabulary.token_types or itertools.repeat(_NORMAL)
    added = []
    for text, token_type in zip(vocabulary.tokens, types, strict=False):
        if token_type in _SPECIAL_TYPES or text in EOG_TOKEN_TEXTS:
            added.append((text, True))
        elif token_type == _USER_DEFINED:
            added.append((text, False))
    return added


def _special_token(vocabulary: _Vocabulary, kind: _Kind, key: str) -> int | None:
    """The id ``tokenizer.ggml.<key>`` names, llama.cpp's default for the kind, or None."""
    default = kind.default_ids.get(key)
    if default is not None and default >= len(vocabulary.tokens):
        default = None
    value = vocabulary.file.get(f"tokenizer.ggml.{key}")
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{vocabulary.file.path}: tokenizer.ggml.{key} is not an integer")
    if not 0 <= value < len(vocabulary.tokens):
        logger.warning(
            "%s: tokenizer.ggml.%s = %d is outside the vocabulary of %d tokens; using %s",
            vocabulary.file.path,
            key,
            value,
            len(vocabulary.tokens),
            default,
        )
        return default
    return value


def _text(vocabulary: _Vocabulary, token_id: int | None) -> str | None:
    return vocabulary.tokens[token_id] if token_id is not None else None


def _flag(file: GGUFFile, key: str, default: bool) -> bool:
    value = file.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelLoadError(f"{file.path}: {key} is {value!r}, not a boolean")
    return value


def _post_processor(
    vocabulary: _Vocabulary, special: dict[str, int | None], add_bos: bool, add_eos: bool
) -> Any:
    """A TemplateProcessing that adds BOS and/or EOS around each sequence, or None."""
    from tokenizers import processors

    ends: list[tuple[str, int]] = []
    for wanted, flag, key in ((add_bos, "add_bos", "bos"), (add_eos, "add_eos", "eos")):
        token_id = special[f"{key}_token_id"]
        if wanted and token_id is None:
            raise ModelLoadError(
                f"{vocabulary.file.path}: tokenizer.ggml.{flag}_token is true but the file has "
                f"no tokenizer.ggml.{key}_token_id"
            )
        if wanted and token_id is not None:
            ends.append((vocabulary.tokens[token_id], token_id))
    if not ends:
        return None
    bos = [ends[0][0]] if add_bos else []
    eos = [ends[-1][0]] if add_eos else []

    def around(sequence: str, type_id: int) -> list[str]:
        return [f"{piece}:{type_id}" for piece in (*bos, sequence, *eos)]

    try:
        return processors.TemplateProcessing(
            single=around("$A", 0),
            pair=around("$A", 0) + around("$B", 1),
            special_tokens=list(dict.fromkeys(ends)),
        )
    except Exception as error:  # tokenizers raises its own exception type
        raise ModelLoadError(
            f"{vocabulary.file.path}: cannot add BOS/EOS {[text for text, _ in ends]}: {error}"
        ) from error
