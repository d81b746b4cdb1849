"""Typed option schemas for plugins and stations.

A plugin declares its options as a plain dataclass whose fields all have defaults. Fields made
with :func:`option` carry a help text and optional bounds, which the config loader enforces and
``brigade plugins`` prints::

    @dataclass(frozen=True)
    class MyOptions:
        window: int = option(64, help="tokens looked at", ge=1)
        mode: str = option("fast", help="speed/quality trade-off", choices=("fast", "exact"))

Supported field types: ``bool``, ``int``, ``float``, ``str``, ``X | None`` of those, and
``tuple[X, ...]`` (written as a TOML array).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["NoOptions", "option", "option_help"]


def option(
    default: Any,
    *,
    help: str,  # noqa: A002 - mirrors argparse's keyword, the name users expect
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: tuple[Any, ...] | None = None,
    pattern: str | None = None,
) -> Any:
    """Declare one option field: its default, a help text and the values it allows.

    ``pattern`` is a regular expression a string value must match in full; say in ``help``
    what it means, since the message shows it as written.
    """
    metadata = {
        "help": help,
        "ge": ge,
        "gt": gt,
        "le": le,
        "lt": lt,
        "choices": choices,
        "pattern": pattern,
    }
    return dataclasses.field(default=default, metadata=metadata)


def option_help(field: dataclasses.Field[Any]) -> str:
    """The help text of one option field, with its bounds spelled out."""
    meta = field.metadata
    parts = [meta.get("help", "")]
    bounds = [
        f"{symbol} {meta[key]}"
        for key, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
        if meta.get(key) is not None
    ]
    if bounds:
        parts.append(f"({', '.join(bounds)})")
    if meta.get("pattern"):
        parts.append(f"(matching {meta['pattern']})")
    if meta.get("choices"):
        parts.append("(one of " + ", ".join(repr(c) for c in meta["choices"]) + ")")
    return " ".join(p for p in parts if p)


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """Options type of a plugin that takes none."""
