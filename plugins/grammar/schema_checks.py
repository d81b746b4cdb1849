"""What structured output refuses before compiling, and how it rewrites JSON schemas.

XGrammar compiles most of JSON Schema and of regular expressions; what it cannot enforce it
would drop without a word, and an answer might then not validate. These checks refuse those
features with a message instead, so ``response_format`` stays a guarantee. Pure Python: run
in the compile worker (``brigade.plugins.grammar.compile_worker``).
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = [
    "CPP_PREFIX",
    "SUPPORTED_FORMATS",
    "UNSUPPORTED_KEYWORDS",
    "check_json_schema",
    "check_regex",
    "describe_kind",
    "lengths_as_patterns",
    "prepare_tag_schemas",
]

SUPPORTED_FORMATS = frozenset(
    {
        "date-time",
        "time",
        "date",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
        "uuid",
    }
)
"""String ``format`` values XGrammar enforces; it would silently ignore others: refused."""

UNSUPPORTED_KEYWORDS = {
    "not": "negation",
    "if": "conditional subschemas",
    "then": "conditional subschemas",
    "else": "conditional subschemas",
    "dependentSchemas": "dependent subschemas",
    "unevaluatedProperties": "unevaluated properties",
    "unevaluatedItems": "unevaluated items",
    "contains": "array contains",
    "minContains": "array contains",
    "maxContains": "array contains",
    "dependentRequired": "dependent required properties",
}
"""JSON-schema keywords XGrammar does not enforce (it would ignore them, not fail)."""

_LOOKAROUND = re.compile(r"\(\?<?[=!]")
"""Lookahead/lookbehind groups, which XGrammar's regex ignores."""

CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (?:Warning: )?")
"""XGrammar's C++ error prefix (``[14:11:21] /project/cpp/file.cc:94: ``)."""

# Where check_json_schema looks for subschemas (keywords it refuses outright are not walked).
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "propertyNames")


def check_json_schema(schema: object, path: str = "#") -> None:
    """Raise ``ValueError`` naming the first keyword XGrammar would not enforce.

    XGrammar compiles most of JSON Schema; what it cannot enforce it would drop without a
    word, and the answer might then not validate. Refusing those keywords keeps
    ``response_format`` a guarantee.
    """
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"the schema at {path} is a {type(schema).__name__}, not an object")
    for keyword, feature in UNSUPPORTED_KEYWORDS.items():
        if keyword in schema:
            raise ValueError(
                f"JSON schema keyword {keyword!r} at {path} ({feature}) is not supported by "
                "structured output"
            )
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise ValueError(
            f"JSON schema keyword 'allOf' with {len(all_of)} subschemas at {path} is not "
            "supported by structured output (merge them into one schema)"
        )
    one_of = schema.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1 and not _disjoint(one_of):
        raise ValueError(
            f"JSON schema keyword 'oneOf' at {path} with branches that may overlap is not "
            "supported by structured output (it could only be enforced as anyOf): use anyOf, "
            "or make the branches disjoint by type or by a required property with a different "
            "const in each"
        )
    if schema.get("uniqueItems") is True:
        raise ValueError(
            f"JSON schema keyword 'uniqueItems' at {path} is not supported by structured output"
        )
    if "multipleOf" in schema and schema.get("type") != "integer":
        raise ValueError(
            f"JSON schema keyword 'multipleOf' at {path} is not supported by structured output "
            'except on integers (add "type": "integer")'
        )
    if ("pattern" in schema or "format" in schema) and (
        "minLength" in schema or "maxLength" in schema
    ):
        raise ValueError(
            f"minLength/maxLength together with pattern or format at {path} are not supported "
            "by structured output (put the length into the pattern, e.g. ^[a-z]{1,8}$)"
        )
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        check_regex(pattern, f"the pattern at {path}")
    fmt = schema.get("format")
    if fmt is not None and fmt not in SUPPORTED_FORMATS:
        raise ValueError(
            f"string format {fmt!r} at {path} is not supported by structured output; "
            f"supported: {', '.join(sorted(SUPPORTED_FORMATS))} (or use 'pattern')"
        )
    for key in _SUBSCHEMA_MAPS:
        children = schema.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                check_json_schema(child, f"{path}/{key}/{name}")
    for key in _SUBSCHEMA_LISTS:
        children = schema.get(key)
        if isinstance(children, list):
            for index, child in enumerate(children):
                check_json_schema(child, f"{path}/{key}/{index}")
    for key in _SUBSCHEMAS:
        if key in schema and isinstance(schema[key], dict | bool):
            check_json_schema(schema[key], f"{path}/{key}")


def check_regex(regex: str, what: str = "the regular expression") -> None:
    """Refuse lookahead and lookbehind, which XGrammar's regex would silently ignore."""
    if _LOOKAROUND.search(regex):
        raise ValueError(
            f"{what} uses lookahead or lookbehind, which is not supported by structured output"
        )


def _disjoint(branches: list[Any]) -> bool:
    """Whether no JSON value can match two ``oneOf`` branches (so anyOf is the same).

    Provable cases only: every branch has one distinct ``type`` (integer and number overlap),
    or every branch requires one property whose ``const`` differs between branches.
    """
    if not all(isinstance(branch, dict) for branch in branches):
        return False
    types = [branch.get("type") for branch in branches]
    if all(isinstance(t, str) for t in types):
        kinds = ["number" if t == "integer" else t for t in types]
        if len(set(kinds)) == len(kinds):
            return True
    common = set.intersection(*(set(branch.get("required", ())) for branch in branches))
    for name in common:
        consts = []
        for branch in branches:
            prop = branch.get("properties", {}).get(name)
            if not isinstance(prop, dict) or "const" not in prop:
                break
            consts.append(json.dumps(prop["const"], sort_keys=True))
        else:
            if len(set(consts)) == len(consts):
                return True
    return False


def prepare_tag_schemas(tag: object, whitespace: int) -> None:
    """Check and rewrite every JSON-schema region of a structural tag, in place, as a
    ``json_schema`` request's schema is; bound its whitespace unless the tag did."""
    if isinstance(tag, dict):
        if tag.get("type") == "json_schema" and "json_schema" in tag:
            check_json_schema(tag["json_schema"])
            tag["json_schema"] = lengths_as_patterns(tag["json_schema"])
            tag.setdefault("max_whitespace_cnt", whitespace)
            return
        for value in tag.values():
            prepare_tag_schemas(value, whitespace)
    elif isinstance(tag, list):
        for value in tag:
            prepare_tag_schemas(value, whitespace)


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are JSON data, not subschemas."""


_JSON_CHARACTER = r"(?:[ -~\u0080-\u07ff]|[\u0800-\u0fff]|[\u1000-\ud7ff]|[\ue000-\uffff])"
"""One character of a string, as an XGrammar pattern that yields valid UTF-8 only.

Written as alternatives because XGrammar 0.2 lets overlong (``E0 80``, ``F0 80``) and surrogate
(``ED A0``) byte sequences through ``.``, negated classes and wide ranges; 4-byte characters
are left out for the same reason."""


def lengths_as_patterns(schema: Any) -> Any:
    """``schema`` with every string length bound (and no pattern or format) as a pattern.

    XGrammar 0.2 compiles ``minLength``/``maxLength`` to a character class that admits raw
    control characters, which JSON forbids in strings (mlc-ai/xgrammar#800), and surrogate
    bytes: the answer would not parse, or not as the string the schema bounds. The same bounds
    as a pattern of :data:`_JSON_CHARACTER` go through its JSON-string-aware regex instead.
    """
    if isinstance(schema, list):
        return [lengths_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {
        key: value if key in _DATA_KEYWORDS else lengths_as_patterns(value)
        for key, value in schema.items()
    }
    low, high = result.get("minLength"), result.get("maxLength")
    bounded = type(low) is int or type(high) is int  # not bool: a property may be named so
    if bounded and "pattern" not in result and "format" not in result:
        result.pop("minLength", None)
        result.pop("maxLength", None)
        low = low if type(low) is int else 0
        high = high if type(high) is int else ""
        result["pattern"] = f"^{_JSON_CHARACTER}{{{low},{high}}}$"
    return result


def describe_kind(kind: str) -> str:
    return {
        "json": "JSON grammar",
        "json_schema": "JSON schema",
        "regex": "regular expression",
        "ebnf": "EBNF grammar",
        "structural_tag": "structural tag",
    }.get(kind, kind)
