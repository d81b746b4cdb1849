"""Validation of option tables against a plugin's or station's typed schema."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

from brigade.errors import ConfigError

__all__ = ["build_options", "describe_type", "option_defaults", "unknown_key_error"]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def build_options(options_type: type, table: Mapping[str, Any], where: str) -> Any:
    """Instantiate ``options_type`` from ``table``, or raise ``ConfigError`` naming ``where``.

    ``where`` locates the table for the message, e.g. ``"engine.toml [kv]"``.
    """
    fields = {f.name: f for f in dataclasses.fields(options_type)}
    hints = typing.get_type_hints(options_type)
    values: dict[str, Any] = {}
    for key, value in table.items():
        field = fields.get(key)
        if field is None:
            raise unknown_key_error(where, key, list(fields))
        values[key] = _check_value(value, hints[key], field, f"{where} {key}")
    try:
        return options_type(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def option_defaults(options_type: type) -> dict[str, Any]:
    """Each option's default value, in declaration order."""
    instance = options_type()
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(options_type)}


def describe_type(annotation: Any) -> str:
    """A short human name for an option type ('int', 'str or none', 'array of int')."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(annotation))
    if origin is tuple:
        return f"array of {describe_type(typing.get_args(annotation)[0])}"
    if annotation is type(None):
        return "none"
    return getattr(annotation, "__name__", str(annotation))


def unknown_key_error(where: str, key: str, allowed: list[str]) -> ConfigError:
    """The error for a key no schema declares, with the allowed keys and a likely typo fix."""
    if not allowed:
        return ConfigError(f"{where}: unknown key {key!r}; this table takes no options")
    message = f"{where}: unknown key {key!r}; allowed: {', '.join(allowed)}"
    close = difflib.get_close_matches(key, allowed, n=1)
    return ConfigError(f"{message} (did you mean {close[0]!r}?)" if close else message)


def _check_value(value: Any, annotation: Any, field: dataclasses.Field[Any], where: str) -> Any:
    value = _coerce(value, annotation, where)
    _check_number(value, where)
    meta = field.metadata
    choices = meta.get("choices")
    if choices and value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{where} = {value!r} is not allowed; one of {allowed}")
    pattern = meta.get("pattern")
    if pattern and isinstance(value, str) and not re.fullmatch(pattern, value):
        raise ConfigError(f"{where} = {value!r} is not allowed; it must match {pattern}")
    bounds = (
        ("ge", ">=", float.__ge__),
        ("gt", ">", float.__gt__),
        ("le", "<=", float.__le__),
        ("lt", "<", float.__lt__),
    )
    for key, symbol, compare in bounds:
        limit = meta.get(key)
        if (
            limit is not None
            and isinstance(value, int | float)
            and not compare(float(value), float(limit))
        ):
            raise ConfigError(f"{where} = {value!r} is out of range; must be {symbol} {limit}")
    return value


def _check_number(value: Any, where: str) -> None:
    """Numbers a machine can hold: integers within 64 bits (what torch and the kernels take;
    a larger one overflows deep inside them), floats that are finite; in arrays too."""
    if isinstance(value, tuple):
        for index, item in enumerate(value):
            _check_number(item, f"{where}[{index}]")
    elif (
        isinstance(value, int)
        and not isinstance(value, bool)
        and not INT64_MIN <= value <= INT64_MAX
    ):
        raise ConfigError(
            f"{where} = {value} is out of range; an integer setting must fit in 64 bits "
            f"({INT64_MIN} to {INT64_MAX})"
        )
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where} = {value!r} is not allowed; it must be a finite number")


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check ``value`` against ``annotation``; ints widen to float, arrays become tuples."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(annotation):
            return None
        for option in typing.get_args(annotation):
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ConfigError:
                continue
        raise _type_error(value, annotation, where)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise _type_error(value, annotation, where)
        item_type = typing.get_args(annotation)[0]
        return tuple(_coerce(v, item_type, f"{where}[{i}]") for i, v in enumerate(value))
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is int and isinstance(value, bool):
        raise _type_error(value, annotation, where)
    if annotation in (bool, int, float, str) and isinstance(value, annotation):
        return value
    raise _type_error(value, annotation, where)


def _type_error(value: Any, annotation: Any, where: str) -> ConfigError:
    return ConfigError(
        f"{where}: expected {describe_type(annotation)}, got {type(value).__name__} {value!r}"
    )
