"""The grammar a request asks for: ``response_format``, or one of vLLM's structured-output
fields (``structured_outputs``, ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar``), as the ``StructuredOutput`` the grammar station compiles.

``response_format`` takes OpenAI's ``text``, ``json_object`` and ``json_schema`` types plus two
Brigade extensions: ``{"type": "regex", "regex": "..."}`` and ``{"type": "ebnf", "ebnf":
"..."}`` (XGrammar EBNF, root rule ``root``). A request gives one of these fields at most;
every check raises ``ProtocolError`` with ``param`` set to the field's path.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from brigade.interfaces import StructuredOutput
from brigade.server.errors import ProtocolError
from brigade.server.tools import schema_key

__all__ = [
    "RESPONSE_FORMATS",
    "GuidedFields",
    "one_grammar",
    "response_format_grammar",
    "vllm_grammar",
]

RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "ebnf")
_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


class GuidedFields(Protocol):
    """vLLM's structured-output fields of a request (``protocol``'s generation requests)."""

    structured_outputs: Any
    guided_json: Any
    guided_regex: str | None
    guided_choice: list[str] | None
    guided_grammar: str | None


def response_format_grammar(response_format: Any) -> StructuredOutput | None:
    """``response_format`` as a grammar (None for text); ``ProtocolError`` when malformed."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise ProtocolError(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}; got {kind!r}.",
            param="response_format.type",
            code="unsupported_value",
        )
    assert isinstance(response_format, dict)
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ProtocolError(
                'json_schema response format needs "json_schema": {"name": ..., "schema": {...}}.',
                param="response_format.json_schema",
            )
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict | bool):
            raise ProtocolError(
                "the schema must be a JSON object.", param="response_format.json_schema.schema"
            )
        # The answer lists its keys in the schema's order, as OpenAI's does (schema_key).
        return StructuredOutput("json_schema", json.dumps(schema_key(schema)))
    text = response_format.get(kind)
    if not isinstance(text, str) or not text:
        raise ProtocolError(
            f'a {kind} response format needs "{kind}": a non-empty string.',
            param=f"response_format.{kind}",
        )
    return StructuredOutput(kind, text)


def vllm_grammar(fields: GuidedFields) -> tuple[str, StructuredOutput] | None:
    """vLLM's ``structured_outputs`` or ``guided_*`` field as the request's grammar, with
    the field's name; None when the request sets none."""
    given: list[tuple[str, str, Any]] = [
        (name, name.removeprefix("guided_"), getattr(fields, name))
        for name in _GUIDED_FIELDS
        if getattr(fields, name) is not None
    ]
    outputs = fields.structured_outputs
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise ProtocolError("structured_outputs must be an object.", param="structured_outputs")
        for key, value in outputs.items():
            if key in _STRUCTURED_OUTPUTS_KEYS and value not in (None, False):
                given.append((f"structured_outputs.{key}", key, value))
            elif key not in _STRUCTURED_OUTPUTS_KEYS and value not in (None, False, ""):
                raise ProtocolError(
                    f"structured_outputs.{key} is not supported; give one of "
                    f"{', '.join(_STRUCTURED_OUTPUTS_KEYS)}.",
                    param=f"structured_outputs.{key}",
                )
    if not given:
        return None
    if len(given) > 1:
        raise ProtocolError(
            f"give one structured-output field, not {given[0][0]} and {given[1][0]}.",
            param=given[1][0],
        )
    param, kind, value = given[0]
    return param, _guided_grammar(param, kind, value)


def _guided_grammar(param: str, kind: str, value: Any) -> StructuredOutput:
    if kind == "json_object":
        return StructuredOutput("json")
    if kind == "json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except ValueError:
                raise ProtocolError(f"{param} is not valid JSON.", param=param) from None
        if not isinstance(schema, dict | bool):
            raise ProtocolError(f"{param} must be a JSON schema (an object).", param=param)
        return StructuredOutput("json_schema", json.dumps(schema_key(schema)))
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(item, str) and item for item in value)
        ):
            raise ProtocolError(f"{param} must be a list of non-empty strings.", param=param)
        alternatives = " | ".join(json.dumps(item, ensure_ascii=False) for item in value)
        return StructuredOutput("ebnf", f"root ::= {alternatives}")
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"{param} must be a non-empty string.", param=param)
    return StructuredOutput("regex" if kind == "regex" else "ebnf", value)


def one_grammar(
    response_format: StructuredOutput | None, guided: tuple[str, StructuredOutput] | None
) -> StructuredOutput | None:
    """The request's one grammar: ``response_format``'s or the vLLM field's (400 if both)."""
    if guided is None:
        return response_format
    if response_format is not None:
        raise ProtocolError(f"give response_format or {guided[0]}, not both.", param=guided[0])
    return guided[1]
