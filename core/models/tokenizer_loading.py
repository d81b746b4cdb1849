"""The served model's tokenizer, built from files rather than from a tokenizer class name.

A Hugging Face directory's ``tokenizer_config.json`` names a class that changes between
transformers major versions (``LlamaTokenizerFast`` and ``PreTrainedTokenizerFast`` in 4.x,
``TokenizersBackend`` in 5.x), so ``AutoTokenizer`` fails on folders written by the other
major version. Brigade instead reads ``tokenizer.json`` with the ``tokenizers`` library, takes
special tokens and the chat template from the configs (``chat_template.jinja``,
``chat_template.json`` or ``tokenizer_config.json``; ``special_tokens_map.json`` for older
folders), and wraps the result in transformers' ``PreTrainedTokenizerFast``, which both major
versions provide. GGUF files describe their tokenizer in metadata; ``brigade.models.
gguf_tokenizer`` turns that into the same :class:`TokenizerSpec`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from brigade.errors import ModelLoadError
from brigade.user_json import read_json_file

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "TokenizerSpec",
    "build_tokenizer",
    "hf_tokenizer_spec",
    "read_chat_template",
    "render_chat_prompt",
]

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """Everything the wrapped tokenizer is made of."""

    backend: Tokenizer
    """The ``tokenizers`` tokenizer: normalizer, pre-tokenizer, model, post-processor
    (whether BOS is added), decoder and the added (special) tokens."""
    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None
    model_max_length: int | None = None
    source: str = ""
    """Where it came from, for messages."""


def build_tokenizer(spec: TokenizerSpec, chat_template: str = "") -> PreTrainedTokenizerFast:
    """The transformers tokenizer for ``spec``; ``chat_template`` (a file path or the template
    itself), when given, replaces the model's own."""
    from transformers import PreTrainedTokenizerFast

    template = read_chat_template(chat_template) if chat_template else spec.chat_template
    specials = {key: getattr(spec, key) for key in _SPECIAL_KEYS if getattr(spec, key)}
    kwargs: dict[str, Any] = {}
    if spec.model_max_length:
        kwargs["model_max_length"] = spec.model_max_length
    return PreTrainedTokenizerFast(
        tokenizer_object=spec.backend,
        chat_template=template,
        # Decoding must be lossless: the detokenizer's deltas add up to decode(ids).
        clean_up_tokenization_spaces=False,
        padding_side="left",
        **specials,
        **kwargs,
    )


def read_chat_template(value: str) -> str:
    """``value`` is a path to a Jinja file when such a file exists, else the template itself
    (as vLLM's ``--chat-template`` reads it)."""
    candidate = Path(value).expanduser()
    looks_like_path = "{" not in value and len(value) < 4096
    if looks_like_path and candidate.is_file():
        return _read_template(candidate)
    if looks_like_path and ("/" in value or value.endswith((".jinja", ".j2", ".txt"))):
        raise ModelLoadError(f"chat template file {candidate} does not exist")
    return value


def _read_template(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"chat template {file}: cannot read ({error})") from error


def render_chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of ``messages`` through the model's chat template.

    Rendered to text first, then encoded without adding special tokens (what transformers'
    ``apply_chat_template(tokenize=True)`` does), so the result does not depend on that
    method's return type, which changed in transformers 5.
    """
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **template_kwargs,
    )
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def hf_tokenizer_spec(directory: Path) -> TokenizerSpec:
    """Read a Hugging Face model directory's tokenizer files (transformers 4.x or 5.x)."""
    from tokenizers import Tokenizer

    file = directory / "tokenizer.json"
    if not file.is_file():
        raise ModelLoadError(
            f"{directory} has no tokenizer.json: Brigade reads the fast-tokenizer file. Write "
            "it with transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
        )
    try:
        backend = Tokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises its own exception type
        raise ModelLoadError(f"{file} is not a valid tokenizer file: {error}") from error
    config = _read_json_object(directory / "tokenizer_config.json")
    specials_map = _read_json_object(directory / "special_tokens_map.json")
    specials = {
        key: _token_text(config.get(key)) or _token_text(specials_map.get(key))
        for key in _SPECIAL_KEYS
    }
    max_length = config.get("model_max_length")
    return TokenizerSpec(
        backend=backend,
        chat_template=_directory_chat_template(directory, config),
        # Configs write "no limit" as 1e30; anything beyond int64 means none.
        model_max_length=max_length if isinstance(max_length, int) and max_length < 2**62 else None,
        source=str(directory),
        **specials,
    )


def _read_json_object(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        value = read_json_file(file)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{file} is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise ModelLoadError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_text(value: Any) -> str | None:
    """A special token as configs write it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _directory_chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return _read_template(jinja)
    template_json = _read_json_object(directory / "chat_template.json")
    template: Any = template_json.get("chat_template", config.get("chat_template"))
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None
