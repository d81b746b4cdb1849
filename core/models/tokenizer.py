"""Deterministic byte-level BPE tokenizer for locally created test models.

The tokenizer is trained on ``data/corpus.txt`` (shipped with the package) so that model
creation works fully offline.  Training takes well under a second and its result is cached
for the lifetime of the process, because test suites create many models in a row.
"""

from __future__ import annotations

import functools
import os
import pathlib
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

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
    "build_tokenizer",
    "save_tokenizer",
    "special_token_id",
    "tokenizer_json",
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
