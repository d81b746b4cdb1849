"""Deterministic tokenizers for locally created test models.

Two kinds, both trained on ``data/corpus.txt`` (shipped with the package) so that model
creation works fully offline:

- ``"bpe"``: byte-level BPE with ChatML special tokens (Qwen/SmolLM style), the default.
- ``"spm"``: a SentencePiece-style BPE laid out like Llama 2's (``<unk>``, ``<s>``, ``</s>``,
  the 256 ``<0xNN>`` byte tokens, then the learned pieces; ``▁`` for spaces; byte fallback),
  with the ``tokenizer.json`` Hugging Face writes for such a model.

Training takes well under a second and its result is cached for the lifetime of the process,
because test suites create many models in a row.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "CORPUS_PATH",
    "EOS_TOKEN",
    "IM_END_TOKEN",
    "IM_START_TOKEN",
    "MAX_VOCAB_SIZE",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "SPM_BOS_TOKEN",
    "SPM_CHAT_TEMPLATE",
    "SPM_EOS_TOKEN",
    "SPM_UNK_TOKEN",
    "TOKENIZER_KINDS",
    "TokenizerKind",
    "build_spm_tokenizer",
    "build_tokenizer",
    "save_spm_tokenizer",
    "save_tokenizer",
    "special_token_id",
    "spm_tokenizer_json",
    "tokenizer_json",
    "tokenizer_kind",
]

CORPUS_PATH = pathlib.Path(__file__).with_name("data") / "corpus.txt"

EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|begin_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Order defines the ids: special tokens occupy ids 0..4, before any BPE token.
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, BOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)

# The created models have vocab_size 4000; the tokenizer (special tokens included) must never
# produce an id outside the embedding table.  Fewer tokens are fine: unused rows are harmless.
MAX_VOCAB_SIZE = 4000

# ChatML.  The template never inserts BOS: the tokenizer does not add BOS either, so that a
# prompt rendered as text and then encoded is identical to the tokenized template.
# Tools follow the Hermes convention (as Qwen2.5/Qwen3 do): the tool list goes into the system
# turn, calls are <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks in the
# assistant turn, and results come back in a user turn as <tool_response> blocks.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\\n\\n' }}"
    "{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '\\n<tool_call>\\n{\"name\": ' + (call['function']['name'] | tojson) + "
    "', \"arguments\": ' + (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def special_token_id(token: str) -> int:
    """Return the fixed id of one of :data:`SPECIAL_TOKENS`.

    Raises:
        ValueError: if ``token`` is not one of the special tokens.
    """
    try:
        return SPECIAL_TOKENS.index(token)
    except ValueError:
        raise ValueError(
            f"unknown special token {token!r}; expected one of {list(SPECIAL_TOKENS)}"
        ) from None


@functools.cache
def tokenizer_json() -> str:
    """Train the BPE tokenizer on the bundled corpus and return its ``tokenizer.json`` text.

    The result is deterministic (the ``tokenizers`` BPE trainer breaks count ties by pair
    order, independent of thread count) and cached per process.
    """
    text = CORPUS_PATH.read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: encode(" x") and encode("x") must differ, and decode must return the
    # exact input (required for a lossless round trip).
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=MAX_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols are in the vocabulary, so any UTF-8 input can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Lines keep their newline so that "\n" merges (e.g. indentation in code) are learned.
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > MAX_VOCAB_SIZE:  # pragma: no cover - guards against a trainer behaviour change
        raise RuntimeError(f"trained vocabulary has {size} tokens, more than {MAX_VOCAB_SIZE}")
    for index, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != index:  # pragma: no cover - same guard
            raise RuntimeError(f"special token {token!r} did not get id {index}")
    return tokenizer.to_str()


def build_tokenizer(model_max_length: int = 4096) -> PreTrainedTokenizerFast:
    """Return a fresh ``PreTrainedTokenizerFast`` wrapping the trained tokenizer.

    BOS is declared but not added automatically (Qwen-style); EOS is ``<|endoftext|>``; chat
    turns end with ``<|im_end|>``.
    """
    # Imported lazily: transformers is slow to import and tokenizer_json() does not need it.
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(tokenizer_json())
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
        # Cleanup would rewrite " ." to "." and break lossless decoding.
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )


def save_tokenizer(out_dir: str | os.PathLike[str], model_max_length: int = 4096) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

    The chat template is stored inside ``tokenizer_config.json`` (not a separate
    ``chat_template.jinja``) so that older loaders and non-HF readers find it.
    """
    tokenizer = build_tokenizer(model_max_length=model_max_length)
    tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)


SPM_UNK_TOKEN = "<unk>"
SPM_BOS_TOKEN = "<s>"
SPM_EOS_TOKEN = "</s>"
_SPM_CONTROL_TOKENS = (SPM_UNK_TOKEN, SPM_BOS_TOKEN, SPM_EOS_TOKEN)
"""Ids 0, 1, 2, as in Llama 2; the ChatML tokens come after the learned pieces."""
_SPM_BYTE_TOKENS = tuple(f"<0x{byte:02X}>" for byte in range(256))
_SPM_CHAT_TOKENS = (IM_START_TOKEN, IM_END_TOKEN)
_SPACE = "\u2581"  # "▁", SentencePiece's visible space

# Llama 2 and Mistral templates open with the BOS token; the tokenizer also adds BOS to plain
# prompts, and chat prompts are encoded without adding special tokens, so BOS appears once.
SPM_CHAT_TEMPLATE = "{{- bos_token }}" + CHAT_TEMPLATE


@functools.cache
def spm_tokenizer_json() -> str:
    """Train the SentencePiece-style tokenizer on the bundled corpus; its ``tokenizer.json``.

    Pieces are learned inside words (a piece may start with ``▁`` but never spans two words),
    from lines without their newline, so ``"\\n"`` falls back to ``<0x0A>`` as in Llama 2.
    The pieces get SentencePiece's scores (learned order, then the single characters) and the
    merges are derived from those scores as Hugging Face's SentencePiece conversion does.
    Deterministic and cached per process.
    """
    from brigade.models.gguf_tokenizer import sentencepiece_merges

    trainee = Tokenizer(models.BPE())
    trainee.normalizer = _spm_normalizer()
    trainee.pre_tokenizer = pre_tokenizers.Split(_SPACE, behavior="merged_with_next")
    fixed = len(_SPM_CONTROL_TOKENS) + len(_SPM_BYTE_TOKENS) + len(_SPM_CHAT_TOKENS)
    trainer = trainers.BpeTrainer(vocab_size=MAX_VOCAB_SIZE - fixed, show_progress=False)
    text = CORPUS_PATH.read_text(encoding="utf-8")
    trainee.train_from_iterator(text.splitlines(), trainer=trainer)
    learned = json.loads(trainee.to_str())["model"]
    pieces = list(dict.fromkeys("".join(pair) for pair in learned["merges"]))
    merged = set(pieces)
    characters = [token for token in learned["vocab"] if token not in merged]
    tokens = [*_SPM_CONTROL_TOKENS, *_SPM_BYTE_TOKENS, *pieces, *characters]
    scores = [0.0] * (len(_SPM_CONTROL_TOKENS) + len(_SPM_BYTE_TOKENS))
    scores += [-float(rank) for rank in range(len(pieces) + len(characters))]

    tokenizer = Tokenizer(
        models.BPE(
            vocab={token: index for index, token in enumerate(tokens)},
            merges=sentencepiece_merges(tokens, scores),
            unk_token=SPM_UNK_TOKEN,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tokenizer.normalizer = _spm_normalizer()
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace(_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    bos_id = _SPM_CONTROL_TOKENS.index(SPM_BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{SPM_BOS_TOKEN}:0 $A:0",
        pair=f"{SPM_BOS_TOKEN}:0 $A:0 {SPM_BOS_TOKEN}:1 $B:1",
        special_tokens=[(SPM_BOS_TOKEN, bos_id)],
    )
    specials = (*_SPM_CONTROL_TOKENS, *_SPM_CHAT_TOKENS)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > MAX_VOCAB_SIZE:  # pragma: no cover - guards against a trainer behaviour change
        raise RuntimeError(f"trained vocabulary has {size} tokens, more than {MAX_VOCAB_SIZE}")
    return tokenizer.to_str()


def _spm_normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence([normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)])


def build_spm_tokenizer(model_max_length: int = 4096) -> PreTrainedTokenizerFast:
    """Return a fresh ``PreTrainedTokenizerFast`` wrapping the SentencePiece-style tokenizer.

    BOS ``<s>`` is added to every encoding (as Llama 2 does); EOS is ``</s>``; ``<unk>`` pads;
    chat turns use the ChatML tokens and end with ``<|im_end|>``.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(spm_tokenizer_json()),
        bos_token=SPM_BOS_TOKEN,
        eos_token=SPM_EOS_TOKEN,
        unk_token=SPM_UNK_TOKEN,
        pad_token=SPM_UNK_TOKEN,
        additional_special_tokens=list(_SPM_CHAT_TOKENS),
        model_max_length=model_max_length,
        chat_template=SPM_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )


def save_spm_tokenizer(out_dir: str | os.PathLike[str], model_max_length: int = 4096) -> None:
    """Write the SentencePiece-style tokenizer's files, as :func:`save_tokenizer` does."""
    tokenizer = build_spm_tokenizer(model_max_length=model_max_length)
    tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)


@dataclasses.dataclass(frozen=True)
class TokenizerKind:
    """One tokenizer ``create_model`` can write, and the special tokens a config names."""

    tokenizer_json: Callable[[], str]
    save: Callable[[str | os.PathLike[str], int], None]
    bos_token: str
    eos_token: str
    pad_token: str
    stop_tokens: tuple[str, ...]
    """Tokens that end generation (generation_config's eos_token_id): plain text's EOS and the
    end of a chat turn."""

    def token_id(self, token: str) -> int:
        """The id of one of the tokenizer's special tokens.

        Raises:
            ValueError: ``token`` is not one of its special tokens.
        """
        ids = _added_token_ids(self.tokenizer_json())
        if token not in ids:
            raise ValueError(f"unknown special token {token!r}; expected one of {list(ids)}")
        return ids[token]


@functools.cache
def _added_token_ids(tokenizer_json_text: str) -> dict[str, int]:
    added = json.loads(tokenizer_json_text)["added_tokens"]
    return {entry["content"]: entry["id"] for entry in added}


_KINDS: dict[str, TokenizerKind] = {
    "bpe": TokenizerKind(
        tokenizer_json, save_tokenizer, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, (EOS_TOKEN, IM_END_TOKEN)
    ),
    "spm": TokenizerKind(
        spm_tokenizer_json,
        save_spm_tokenizer,
        SPM_BOS_TOKEN,
        SPM_EOS_TOKEN,
        SPM_UNK_TOKEN,
        (SPM_EOS_TOKEN, IM_END_TOKEN),
    ),
}
TOKENIZER_KINDS: tuple[str, ...] = tuple(_KINDS)


def tokenizer_kind(name: str) -> TokenizerKind:
    """The tokenizer kind called ``name`` (one of :data:`TOKENIZER_KINDS`).

    Raises:
        ValueError: ``name`` is not a known kind.
    """
    if name not in _KINDS:
        raise ValueError(f"unknown tokenizer {name!r}; expected one of {list(TOKENIZER_KINDS)}")
    return _KINDS[name]
