"""JSON that a user wrote (a model's config.json and tokenizer files, a vLLM flag's value),
read so that every way it can be wrong is a ``ValueError`` with a message.

``json.loads`` raises ``JSONDecodeError`` (a ``ValueError``) for text that is not JSON, but
``RecursionError`` for arrays or objects nested deeper than Python's recursion limit and
``UnicodeDecodeError`` for bytes that are not UTF-8; a caller that catches ``ValueError``
would let the first through as a traceback. Here each is a ``ValueError`` saying what is
wrong, which callers turn into their own error (``ModelLoadError``, a flag's error).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["loads_json", "read_json_file"]


def loads_json(text: str | bytes) -> Any:
    """``json.loads(text)``; ``ValueError`` for anything that is not JSON Brigade can read:
    invalid JSON, bytes that are not UTF-8, nesting past the recursion limit, an integer of
    more digits than Python converts."""
    try:
        return json.loads(text, parse_int=_integer)
    except RecursionError:
        raise ValueError(
            "arrays or objects nested too deeply to read; no model file or setting nests like that"
        ) from None


def _integer(digits: str) -> int:
    """An integer literal, refused past the digits Python converts (its own message names a
    Python setting, not the file's problem)."""
    limit = sys.get_int_max_str_digits()
    if limit and len(digits.lstrip("-")) > limit:
        raise ValueError(
            f"an integer of {len(digits.lstrip('-'))} digits (at most {limit} can be read); no "
            "model file or setting holds such a number"
        )
    return int(digits)


def read_json_file(file: Path) -> Any:
    """The JSON value in ``file`` (UTF-8); ``OSError`` when it cannot be read, ``ValueError``
    (see :func:`loads_json`) when it is not JSON Brigade can read."""
    return loads_json(file.read_bytes())
