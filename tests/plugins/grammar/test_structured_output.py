"""Structured output end to end on random-weight tiny models: every answer finishes (reason
``stop``, never cut at ``max_tokens``) and matches its JSON schema, regex or EBNF grammar,
greedy and sampled, batched with unconstrained requests that stay untouched; bad grammars are
refused before anything runs; a request whose grammar compiles waits without KV pages; matchers
survive preemption and roll back."""

from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from brigade import LLM
from brigade.errors import ConfigError, RequestError
from brigade.grammar import GrammarManager
from brigade.interfaces import (
    DraftSlot,
    GrammarParams,
    NoOptions,
    Proposer,
    ProposerParams,
    Request,
    RequestStatus,
    SamplingParams,
    StructuredOutput,
)
from brigade.models.create import create_model
from brigade.plugins.grammar.xgrammar import XGrammarBackend, XGrammarMatcher, XGrammarOptions
from brigade.registry import load_registry
from brigade.testing.conformance import check_grammar_backend
from brigade.testing.parity import assert_same_greedy_outputs

MAX_TOKENS = 256
"""Generous for every grammar below (answers run 2-60 tokens), so a cut answer is a bug."""
LOGPROB_ATOL = 1e-4
"""Two brigade runs of one model: log probabilities of a near-tie (as in test_engine)."""
SEEDS = (1, 2, 3, 4)
VOCAB = (10, 4000)
"""Prompt token ids: the tiny models' vocabulary without the special tokens."""


def _integer(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


def _object(properties: dict[str, Any], *required: str, **more: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), **more}


# Bounded schemas: every string has a maxLength, enum or pattern and every array a maxItems,
# so even a random model reaches the end of the grammar.
SCHEMAS: dict[str, dict[str, Any]] = {
    "flat_required": _object(
        {"name": {"type": "string", "maxLength": 8}, "age": _integer(0, 120)},
        "name",
        "age",
        additionalProperties=False,
    ),
    "optional_properties": _object(
        {
            "id": _integer(1, 9999),
            "note": {"type": "string", "maxLength": 6},
            "flag": {"type": "boolean"},
        },
        "id",
        additionalProperties=False,
    ),
    "nested_objects": _object(
        {
            "user": _object(
                {
                    "first": {"type": "string", "minLength": 1, "maxLength": 5},
                    "address": _object(
                        {
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                            "city": {"enum": ["Paris", "Lyon", "Nice"]},
                        },
                        "zip",
                        "city",
                    ),
                },
                "first",
                "address",
            )
        },
        "user",
    ),
    "array_min_max_items": _object(
        {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 4},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "tags",
    ),
    "top_level_array": {"type": "array", "items": _integer(-5, 5), "minItems": 2, "maxItems": 4},
    "array_of_objects": {
        "type": "array",
        "items": _object({"x": _integer(0, 9), "y": _integer(0, 9)}, "x", "y"),
        "minItems": 1,
        "maxItems": 3,
    },
    "string_enum": _object({"color": {"enum": ["red", "green", "blue"]}}, "color"),
    "mixed_enum": {"enum": ["a", 1, True, None, 2.5, {"k": "v"}]},
    "integer_bounds": _object(
        {
            "small": _integer(-10, 10),
            "big": _integer(1000, 100000),
            "exclusive": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
        },
        "small",
        "big",
        "exclusive",
    ),
    "number_bounds": _object(
        {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "celsius": {"type": "number", "exclusiveMinimum": -40.5, "exclusiveMaximum": 60},
        },
        "ratio",
        "celsius",
    ),
    "string_patterns": _object(
        {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
            "hex": {"type": "string", "pattern": "^0x[0-9a-f]{1,4}$"},
        },
        "date",
        "code",
        "hex",
    ),
    "string_lengths": _object(
        {
            "exactly3": {"type": "string", "minLength": 3, "maxLength": 3},
            "upTo2": {"type": "string", "maxLength": 2},
            "twoToFour": {"type": "string", "minLength": 2, "maxLength": 4},
        },
        "exactly3",
        "upTo2",
        "twoToFour",
    ),
    "const_values": _object(
        {
            "version": {"const": 2},
            "kind": {"const": "event"},
            "meta": {"const": {"a": [1, 2]}},
            "n": _integer(0, 3),
        },
        "version",
        "kind",
        "meta",
        "n",
    ),
    "any_of": _object(
        {
            "value": {
                "anyOf": [
                    _integer(0, 50),
                    {"type": "string", "maxLength": 3},
                    {"type": "boolean"},
                ]
            }
        },
        "value",
    ),
    "one_of_disjoint": {
        "oneOf": [
            _object(
                {"kind": {"const": "circle"}, "radius": _integer(1, 9)},
                "kind",
                "radius",
                additionalProperties=False,
            ),
            _object(
                {"kind": {"const": "square"}, "side": _integer(1, 9)},
                "kind",
                "side",
                additionalProperties=False,
            ),
        ]
    },
    "defs_and_refs": {
        "$defs": {"point": _object({"x": _integer(-9, 9), "y": _integer(-9, 9)}, "x", "y")},
        **_object({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
        "required": ["start", "end"],
    },
    "nullable_types": _object(
        {
            "maybe_int": {"type": ["integer", "null"], "minimum": 0, "maximum": 99},
            "maybe_str": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]},
        },
        "maybe_int",
        "maybe_str",
    ),
    "booleans_and_null": _object(
        {"ok": {"type": "boolean"}, "done": {"type": "boolean"}, "nothing": {"type": "null"}},
        "ok",
        "done",
        "nothing",
    ),
    "tuple_prefix_items": {
        "type": "array",
        "prefixItems": [
            {"type": "string", "maxLength": 3},
            _integer(0, 9),
            {"type": "boolean"},
        ],
        "items": False,
    },
    "additional_properties_typed": _object(
        {"base": _integer(0, 9)},
        "base",
        additionalProperties={"type": "boolean"},
        propertyNames={"pattern": "^[a-z]{1,4}$"},
        maxProperties=3,
    ),
    "nested_refs": {
        "$defs": {
            "leaf": _integer(0, 9),
            "pair": _object(
                {"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}},
                "left",
                "right",
            ),
        },
        "type": "array",
        "items": {"$ref": "#/$defs/pair"},
        "minItems": 2,
        "maxItems": 2,
    },
    "nested_arrays": {
        "type": "array",
        "items": {"type": "array", "items": {"enum": ["x", "y", 0]}, "minItems": 1, "maxItems": 2},
        "minItems": 1,
        "maxItems": 3,
    },
    # A format jsonschema checks without extra packages, and one XGrammar enforces exactly
    # (its "date" lets 09-31 through and its "ipv4" leading zeros: not used here).
    "uuid_format": _object(
        {
            "id": {"type": "string", "format": "uuid"},
            "parent": {"anyOf": [{"type": "string", "format": "uuid"}, {"type": "null"}]},
        },
        "id",
        "parent",
    ),
}

REGEXES = (
    r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)",
    r"\d{3}-\d{4}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,2}",
    r"-?(0|[1-9][0-9]{0,3})\.[0-9]{2}",
    r"\((\d,){2}\d\)",
)

ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= number | "(" inner ")"
inner ::= number (("+" | "-") number){0,2}
number ::= "0" | [1-9] [0-9]{0,2}
"""
_NUMBER = r"(0|[1-9][0-9]{0,2})"
_FACTOR = rf"({_NUMBER}|\({_NUMBER}([+-]{_NUMBER}){{0,2}}\))"
_TERM = rf"{_FACTOR}([*/]{_FACTOR}){{0,2}}"
ARITHMETIC_REGEX = rf"{_TERM}([+-]{_TERM}){{0,3}}"
"""The language of ARITHMETIC (its nesting is bounded, so a regex can say it exactly)."""

LIST_GRAMMAR = r"""
root ::= "[" item (", " item){0,4} "]"
item ::= "\"" [a-z]{1,4} "\"" | [1-9] [0-9]?
"""


def schema_output(name: str) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(SCHEMAS[name]))


def make_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*VOCAB) for _ in range(rng.randint(3, 24))] for _ in range(count)]


def variants(structured: StructuredOutput, **extra: Any) -> list[SamplingParams]:
    """Greedy plus temperature 1.0 under each of SEEDS."""
    settings = [(0.0, None)] + [(1.0, seed) for seed in SEEDS]
    return [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=temperature,
            seed=seed,
            structured_output=structured,
            **extra,
        )
        for temperature, seed in settings
    ]


def assert_valid_json(text: str, schema: dict[str, Any], label: str) -> Any:
    """Parse strictly (a raw control character in a string is not JSON) and validate."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise AssertionError(f"{label}: not JSON ({exc}): {text!r}") from None
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    assert error is None, f"{label}: {text!r} does not match its schema: {error.message}"
    return value


def completion(output: Any) -> Any:
    (only,) = output.outputs
    return only


def assert_stopped(output: Any, label: str) -> None:
    result = completion(output)
    assert result.finish_reason == "stop", (
        f"{label}: finished with {result.finish_reason!r} after {len(result.token_ids)} tokens: "
        f"{result.text[:120]!r}"
    )


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        arch: create_model(root / arch, arch, overrides={"num_hidden_layers": 2})
        for arch in ("llama", "qwen3")
    }


def make_llm(model_dir: Path, *settings: str) -> LLM:
    base = [f"model.path={model_dir}", "model.dtype=float32", "kv.page_size=4"]
    return LLM(overrides=[*base, "kv.num_pages=2048", *settings])


@pytest.fixture(scope="module")
def llm(model_dirs: dict[str, Path]) -> LLM:
    return make_llm(model_dirs["llama"])


# -- JSON schemas ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_schema_answer_finishes_and_validates(arch: str, model_dirs: dict) -> None:
    llm = make_llm(model_dirs[arch])
    names = [name for name in SCHEMAS for _ in range(1 + len(SEEDS))]
    params = [p for name in SCHEMAS for p in variants(schema_output(name))]
    outputs = llm.generate(make_prompts(len(params)), params, use_tqdm=False)
    texts = set()
    for name, param, output in zip(names, params, outputs, strict=True):
        label = f"{name} {arch} seed={param.seed}"
        assert_stopped(output, label)
        assert_valid_json(completion(output).text, SCHEMAS[name], label)
        texts.add(completion(output).text)
    # Sampling must explore: most schemas give different answers under different seeds.
    assert len(texts) > 2 * len(SCHEMAS), f"only {len(texts)} distinct answers"
    assert not llm.engine.has_unfinished()


def test_length_bounded_strings_are_valid_json_strings(llm: LLM) -> None:
    # XGrammar's own minLength/maxLength class lets raw control characters and broken UTF-8
    # through; sampled from a random model they show up within a few dozen answers.
    words = {"type": "string", "minLength": 4, "maxLength": 8}
    schema = {"type": "array", "items": words, "minItems": 4, "maxItems": 4}
    structured = StructuredOutput("json_schema", json.dumps(schema))
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, structured_output=structured
        )
        for seed in range(48)
    ]
    outputs = llm.generate(make_prompts(len(params), seed=7), params, use_tqdm=False)
    for param, output in zip(params, outputs, strict=True):
        text = completion(output).text
        assert_stopped(output, f"seed {param.seed}")
        assert "\ufffd" not in text, f"seed {param.seed}: invalid UTF-8 in {text!r}"
        assert_valid_json(text, schema, f"seed {param.seed}")


SPECULATING = ("speculative.max_tokens_per_step=4096", "speculative.max_batch_size=256")


class AnswerProposer(Proposer):
    """Drafts the tokens a run without speculation generated after the same tokens."""

    def __init__(
        self, params: ProposerParams, answers: dict[tuple[int, ...], list[int]], shift: int = 0
    ) -> None:
        super().__init__(params, NoOptions())
        self.answers = answers
        self.shift = shift
        """Added to each drafted id: 0 drafts the answer, 1 a wrong (mostly masked) token."""

    def propose(self, slots: Sequence[DraftSlot]) -> list[list[int]]:
        drafts = []
        for slot in slots:
            request = slot.request
            answer = self.answers.get(tuple(request.prompt_token_ids), [])
            done = request.num_output_tokens
            on_path = answer[:done] == request.output_token_ids
            guess = answer[done : done + slot.max_tokens] if on_path else []
            drafts.append([(t + self.shift) % self.params.vocab_size for t in guess])
        return drafts


def answer_llm(model_dir: Path, answers: dict[tuple[int, ...], list[int]], shift: int = 0) -> LLM:
    registry = load_registry()
    registry.add("proposer", "answers", lambda p, _: AnswerProposer(p, answers, shift))
    base = [f"model.path={model_dir}", "model.dtype=float32", "kv.page_size=4"]
    return LLM(
        overrides=[*base, "kv.num_pages=2048", "speculative.plugin=answers", *SPECULATING],
        registry=registry,
    )


@pytest.mark.parametrize("shift", [0, 1], ids=["right drafts", "wrong drafts"])
def test_constrained_requests_speculate_and_stay_valid(
    llm: LLM, model_dirs: dict, shift: int
) -> None:
    """The grammar is walked through each request's drafts, so the logits at a draft's
    position are masked as if the drafts before it had been accepted, and rolled back after."""
    names = list(SCHEMAS)
    prompts = make_prompts(len(names), seed=21)
    greedy = [
        SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, structured_output=schema_output(n), logprobs=2
        )
        for n in names
    ]
    reference = llm.generate(prompts, greedy, use_tqdm=False)
    answers = {
        tuple(p): list(completion(o).token_ids) for p, o in zip(prompts, reference, strict=True)
    }
    speculating = answer_llm(model_dirs["llama"], answers, shift)
    outputs = speculating.generate(prompts, greedy, use_tqdm=False)
    assert_same_greedy_outputs(
        [(completion(o).token_ids, completion(o).logprobs) for o in outputs],
        [(completion(o).token_ids, completion(o).logprobs) for o in reference],
        atol=LOGPROB_ATOL,
        label=f"constrained, shift {shift}",
    )
    for name, output in zip(names, outputs, strict=True):
        assert_stopped(output, name)
        assert_valid_json(completion(output).text, SCHEMAS[name], name)
    spec = speculating.engine.stats().speculative
    assert spec is not None
    if shift == 0:
        assert spec.acceptance_rate > 0.9, spec
        assert spec.mean_accepted_length > 2, spec
    else:
        assert spec.num_drafts > len(names), spec
        assert spec.num_accepted == 0, spec
    # Sampled answers (each seed its own stream) validate too.
    sampled = [p for name in names[:6] for p in variants(schema_output(name))[1:]]
    outputs = speculating.generate(make_prompts(len(sampled), seed=22), sampled, use_tqdm=False)
    for param, output in zip(sampled, outputs, strict=True):
        label = f"{param.structured_output} seed {param.seed}"
        assert_stopped(output, label)
        assert_valid_json(completion(output).text, json.loads(param.structured_output.spec), label)
    assert not speculating.engine.has_unfinished()


@pytest.mark.parametrize("speculating", [False, True], ids=["plain", "speculating"])
def test_unconstrained_requests_in_a_mixed_batch_are_untouched(
    llm: LLM, model_dirs: dict, speculating: bool
) -> None:
    """Also with speculation on: the free requests verify drafts beside constrained rows (the
    grammar station sees several logits rows per speculating request)."""
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    free_prompts = make_prompts(4, seed=11)
    alone = [completion(llm.generate([p], free, use_tqdm=False)[0]) for p in free_prompts]
    if speculating:
        answers = {tuple(p): list(c.token_ids) for p, c in zip(free_prompts, alone, strict=True)}
        llm = answer_llm(model_dirs["llama"], answers)

    names = list(SCHEMAS)[:12]
    constrained = [p for name in names for p in variants(schema_output(name), logprobs=2)]
    constrained_prompts = make_prompts(len(constrained), seed=12)
    # Interleave: free requests sit between constrained rows, greedy and sampled.
    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    free_at: list[int] = []
    step = len(constrained) // len(free_prompts)
    for index, (prompt, param) in enumerate(zip(constrained_prompts, constrained, strict=True)):
        if index % step == 1 and len(free_at) < len(free_prompts):
            free_at.append(len(prompts))
            prompts.append(free_prompts[len(free_at) - 1])
            params.append(free)
        prompts.append(prompt)
        params.append(param)
    outputs = llm.generate(prompts, params, use_tqdm=False)

    mixed = [completion(outputs[index]) for index in free_at]
    assert_same_greedy_outputs(
        [(c.token_ids, c.logprobs) for c in mixed],
        [(c.token_ids, c.logprobs) for c in alone],
        atol=LOGPROB_ATOL,
        label="unconstrained in a mixed batch",
    )
    for ours, reference in zip(mixed, alone, strict=True):
        assert len(ours.token_ids) == free.max_tokens
        # A mask applied to the wrong row would renormalise its distribution.
        for mine, theirs in zip(ours.logprobs, reference.logprobs, strict=True):
            if mine.token_id != theirs.token_id:
                break
            assert mine.logprob == pytest.approx(theirs.logprob, abs=LOGPROB_ATOL)
    constrained_outputs = [o for i, o in enumerate(outputs) if i not in free_at]
    for name, output in zip(
        [n for n in names for _ in range(1 + len(SEEDS))], constrained_outputs, strict=True
    ):
        assert_stopped(output, name)
        assert_valid_json(completion(output).text, SCHEMAS[name], name)
    spec = llm.engine.stats().speculative
    if speculating:
        assert spec is not None
        assert spec.num_accepted > len(free_prompts), "the free requests never speculated"


def test_n_children_with_a_seed_each_validate(llm: LLM) -> None:
    name = "integer_bounds"
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=1.0, seed=7, n=6, structured_output=schema_output(name)
    )
    first = llm.generate(make_prompts(1, seed=3), params, use_tqdm=False)[0]
    assert len(first.outputs) == 6
    for child in first.outputs:
        assert child.finish_reason == "stop", child
        assert_valid_json(child.text, SCHEMAS[name], f"{name} child {child.index}")
    assert len({child.text for child in first.outputs}) > 1, "children should differ"
    again = llm.generate(make_prompts(1, seed=3), params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]


def test_whitespace_option_still_validates(model_dirs: dict) -> None:
    llm = make_llm(model_dirs["llama"], "grammar.max_whitespace=4")
    names = [n for n in SCHEMAS if n not in ("mixed_enum", "string_enum")][:14]
    params = [p for name in names for p in variants(schema_output(name))]
    outputs = llm.generate(make_prompts(len(params), seed=5), params, use_tqdm=False)
    loose = 0
    for name, output in zip(
        [n for n in names for _ in range(1 + len(SEEDS))], outputs, strict=True
    ):
        assert_stopped(output, name)
        value = assert_valid_json(completion(output).text, SCHEMAS[name], name)
        compact = json.dumps(value, ensure_ascii=False)
        loose += completion(output).text != compact and any(
            ch in completion(output).text for ch in "\n\t\r"
        )
    # The option must have taken effect: the random model uses the extra whitespace.
    assert loose > 0, "no answer used whitespace beyond the compact separators"


# -- regex, EBNF, any JSON object ------------------------------------------------------------


def test_regex_answers_fullmatch(llm: LLM) -> None:
    params = [p for regex in REGEXES for p in variants(StructuredOutput("regex", regex))]
    outputs = llm.generate(make_prompts(len(params), seed=21), params, use_tqdm=False)
    for param, output in zip(params, outputs, strict=True):
        regex = param.structured_output.spec  # type: ignore[union-attr]
        assert_stopped(output, regex)
        assert re.fullmatch(regex, completion(output).text), (regex, completion(output).text)


def evaluate(text: str) -> float:
    """A tiny recursive-descent evaluator of ARITHMETIC's expressions (ints, + - * /, parens);
    it raises ``ValueError`` on anything else."""
    tokens: Iterator[str] = iter(re.findall(r"\d+|[-+*/()]|\S", text))
    current = [next(tokens, "")]

    def advance() -> str:
        token, current[0] = current[0], next(tokens, "")
        return token

    def factor() -> float:
        token = advance()
        if token == "(":
            value = expr()
            if advance() != ")":
                raise ValueError(f"unclosed parenthesis in {text!r}")
            return value
        if not token.isdigit():
            raise ValueError(f"expected a number in {text!r}, got {token!r}")
        return float(token)

    def term() -> float:
        value = factor()
        while current[0] in ("*", "/"):
            right = factor() if advance() == "*" else 1 / max(factor(), 1e-9)
            value *= right
        return value

    def expr() -> float:
        value = term()
        while current[0] in ("+", "-"):
            value = value + term() if advance() == "+" else value - term()
        return value

    value = expr()
    if current[0]:
        raise ValueError(f"trailing {current[0]!r} in {text!r}")
    return value


def test_ebnf_answers_parse(llm: LLM) -> None:
    arithmetic = variants(StructuredOutput("ebnf", ARITHMETIC)) * 2
    lists = variants(StructuredOutput("ebnf", LIST_GRAMMAR))
    params = arithmetic + lists
    outputs = llm.generate(make_prompts(len(params), seed=31), params, use_tqdm=False)
    operators = 0
    for output in outputs[: len(arithmetic)]:
        text = completion(output).text
        assert_stopped(output, "arithmetic")
        assert re.fullmatch(ARITHMETIC_REGEX, text), text
        evaluate(text)
        operators += any(op in text for op in "+-*/")
    assert operators, "no answer used an operator: the grammar was not exercised"
    for output in outputs[len(arithmetic) :]:
        assert_stopped(output, "list")
        items = json.loads(completion(output).text)
        assert 1 <= len(items) <= 5, items
        for item in items:
            assert (isinstance(item, str) and re.fullmatch("[a-z]{1,4}", item)) or (
                isinstance(item, int) and 1 <= item <= 99
            ), items


def test_any_json_object_with_a_bias_towards_closing(llm: LLM) -> None:
    # Keys and strings are unbounded in a JSON object: push the tokens made only of quotes,
    # colons, braces and spaces so that strings and objects close within the budget.
    closing = {
        token: 8.0
        for token in range(*VOCAB)
        if (text := llm.tokenizer.decode([token]))
        and set(text) <= set('":} ')
        and ('"' in text or "}" in text)
    }
    assert closing
    any_object = StructuredOutput("json")
    params = variants(any_object, logit_bias=closing) * 4
    outputs = llm.generate(make_prompts(len(params), seed=41), params, use_tqdm=False)
    values = []
    for output in outputs:
        assert_stopped(output, "json object")
        value = json.loads(completion(output).text)
        assert isinstance(value, dict), value
        values.append(value)
    assert any(values), "every answer was {}: the grammar was not exercised"


# -- refusals --------------------------------------------------------------------------------

INVALID = {
    "broken schema": (
        StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": 7}}}'),
        "JSON schema",
    ),
    "regex": (StructuredOutput("regex", "[a-z"), "regular expression"),
    "ebnf syntax": (StructuredOutput("ebnf", 'root ::= "a" |'), "EBNF"),
    "ebnf without root": (StructuredOutput("ebnf", 'start ::= "a"'), "root"),
    "not": (StructuredOutput("json_schema", '{"not": {"type": "string"}}'), "'not'"),
    "if": (
        StructuredOutput(
            "json_schema",
            '{"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}',
        ),
        "'if'",
    ),
    "unknown format": (
        StructuredOutput("json_schema", '{"type": "string", "format": "colour"}'),
        "'colour'",
    ),
    "allOf of two": (
        StructuredOutput(
            "json_schema",
            '{"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 3}]}',
        ),
        "allOf",
    ),
    "nested not": (
        StructuredOutput(
            "json_schema",
            '{"type": "object", "properties": {"a": {"not": {"const": 1}}}, "required": ["a"]}',
        ),
        "#/properties/a",
    ),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_an_invalid_grammar_is_refused_with_the_reason(case: str, llm: LLM) -> None:
    structured, reason = INVALID[case]
    steps = llm.engine.num_steps
    good = SamplingParams(max_tokens=4, structured_output=schema_output("string_enum"))
    bad = SamplingParams(max_tokens=4, structured_output=structured)
    with pytest.raises(RequestError, match=r"^prompt 1: ") as raised:
        llm.generate(make_prompts(2), [good, bad], use_tqdm=False)
    assert reason in str(raised.value), str(raised.value)
    assert "Traceback" not in str(raised.value)
    # Nothing ran, nothing is left behind.
    assert llm.engine.num_steps == steps
    assert not llm.engine.has_unfinished()
    assert not llm.engine.requests
    # Sent again, the cached failure refuses the request as it is added.
    with pytest.raises(RequestError, match=re.escape(reason)):
        llm.engine.add_request(f"again-{case}", make_prompts(1)[0], bad)
    assert not llm.engine.has_unfinished()


def test_a_spec_that_is_not_json_is_refused_on_construction() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutput("json_schema", "{type: object}")
    with pytest.raises(ValueError, match="kind"):
        StructuredOutput("yaml", "a: 1")


def test_the_1x_xgrammar_sampler_is_refused_with_where_it_went(model_dirs: dict) -> None:
    with pytest.raises(ConfigError, match=r"structured output is its own station now") as raised:
        make_llm(model_dirs["llama"], "sampler.plugin=xgrammar")
    assert '[grammar] plugin = "xgrammar"' in str(raised.value)


def test_structured_output_is_the_grammar_station_next_to_any_sampler(llm: LLM) -> None:
    engine = llm.engine
    assert engine.sampler_name == "standard"
    assert engine.config.plugin("grammar") == "xgrammar"
    assert engine.grammar is not None
    assert engine.processors[-1] is engine.grammar


# -- the readiness gate ----------------------------------------------------------------------


@pytest.fixture
def slow_compiles(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Grammars compiled from now on wait for the returned event (set it to release them)."""
    assert llm.engine.grammar is not None
    backend = llm.engine.grammar.backend
    assert isinstance(backend, XGrammarBackend)
    release = threading.Event()
    pool = backend._pool
    original = pool._compile_here

    def wait_then_compile(job: Any) -> None:
        if not release.wait(timeout=60):
            raise TimeoutError("the test never released the compile")
        original(job)

    monkeypatch.setattr(pool, "_compile_here", wait_then_compile)
    yield release
    release.set()


def test_a_compiling_grammar_gates_its_request_without_pages(
    llm: LLM, slow_compiles: threading.Event
) -> None:
    engine = llm.engine
    # A schema no other test compiles, so the cache cannot answer.
    schema = _object({"gate": _integer(0, 999), "ok": {"type": "boolean"}}, "gate", "ok")
    structured = StructuredOutput("json_schema", json.dumps(schema))
    free = engine.add_request(
        "free", make_prompts(1, seed=51)[0], SamplingParams(max_tokens=20, ignore_eos=True)
    )
    gated = engine.add_request(
        "gated",
        make_prompts(1, seed=52)[0],
        SamplingParams(max_tokens=64, structured_output=structured),
    )
    assert gated.status is RequestStatus.WAITING_FOR_GRAMMAR
    for step in range(1, 6):
        updates = {u.request.request_id: u for u in engine.step()}
        assert set(updates) == {"free"}, f"step {step}: {sorted(updates)}"
        assert len(free.output_token_ids) == step  # a token every step
        assert not gated.output_token_ids
        assert engine.kv.block_table(gated) == ()
        assert gated.num_computed_tokens == 0
        stats = engine.stats()
        assert (stats.num_running, stats.num_waiting) == (1, 1)
        held = stats.num_pages - stats.num_free_pages
        assert held == len(engine.kv.block_table(free)) > 0  # the free request's pages only

    slow_compiles.set()
    tokens: list[int] = []
    for _ in range(200):
        for update in engine.step():
            if update.request is gated:
                tokens.extend(update.new_token_ids)
        if not engine.has_unfinished():
            break
    assert gated.status.name == "FINISHED_STOPPED", gated.status
    text = llm.tokenizer.decode(tokens, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)
    assert len(free.output_token_ids) == 20
    assert engine.kv.num_free_pages() == engine.stats().num_pages


def test_a_grammar_that_fails_after_the_request_was_queued_refuses_it(
    llm: LLM, slow_compiles: threading.Event
) -> None:
    engine = llm.engine
    bad = StructuredOutput("regex", "(unclosed")
    request = engine.add_request(
        "late-failure", make_prompts(1)[0], SamplingParams(max_tokens=8, structured_output=bad)
    )
    assert engine.step() == []  # waiting for its grammar, nothing else to run
    assert engine.has_unfinished()
    slow_compiles.set()
    grammar = engine.admit(request.prompt_token_ids, request.sampling_params).grammar
    grammar.exception(timeout=30)  # type: ignore[union-attr]
    (update,) = engine.step()
    assert update.request is request
    assert update.finished
    assert update.new_token_ids == []
    assert update.error is not None
    assert "regular expression" in update.error
    assert not engine.has_unfinished()
    assert not engine.requests


# -- preemption and rollback -----------------------------------------------------------------


@pytest.fixture(scope="module")
def preemption_case(model_dirs: dict) -> tuple[list[str], list[list[int]], list, list]:
    """Constrained greedy requests and their answers from a pool that holds them all."""
    names = ["nested_objects", "integer_bounds", "string_patterns", "array_of_objects"] * 2
    prompts = make_prompts(len(names), seed=61)
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2, structured_output=schema_output(n)
        )
        for n in names
    ]
    roomy = make_llm(model_dirs["qwen3"], "kv.enable_prefix_caching=false")
    return names, prompts, params, roomy.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_requests_resume_their_grammar(
    mode: str, model_dirs: dict, preemption_case: tuple
) -> None:
    names, prompts, params, reference = preemption_case
    # 24 pages of 4 tokens: about two of these sequences at once.
    small = make_llm(
        model_dirs["qwen3"],
        "kv.num_pages=24",
        "kv.enable_prefix_caching=false",
        f"scheduler.preemption={mode}",
    )
    ours = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.stats().num_preemptions > 0
    for name, output in zip(names, ours, strict=True):
        assert_stopped(output, f"{name} preempted")
        assert_valid_json(completion(output).text, SCHEMAS[name], f"{name} preempted")
    assert_same_greedy_outputs(
        [(completion(o).token_ids, completion(o).logprobs) for o in ours],
        [(completion(o).token_ids, completion(o).logprobs) for o in reference],
        atol=LOGPROB_ATOL,
        label=f"small pool, {mode}",
    )
    assert small.engine.kv.num_free_pages() == 24


def allowed_tokens(processor: GrammarManager, row: int, vocab_size: int) -> torch.Tensor:
    """The row's mask as the sampler sees it: True where the grammar allows the token."""
    processor.begin_step([row])
    logits = processor.apply(torch.zeros(1, vocab_size), torch.tensor([row]))
    return torch.isfinite(logits[0])


def grammar_stage(llm: LLM) -> tuple[XGrammarBackend, GrammarManager]:
    """A grammar backend and core's manager of 4 rows for ``llm``'s model, outside its engine."""
    engine = llm.engine
    params = GrammarParams(
        engine.vocab_size,
        tuple(sorted(engine.eos_token_ids)),
        "cpu",
        checkpoint=engine.checkpoint,
    )
    backend = XGrammarBackend(params, XGrammarOptions())
    manager = GrammarManager(
        backend,
        "xgrammar",
        max_num_seqs=4,
        vocab_size=engine.vocab_size,
        device=torch.device("cpu"),
    )
    return backend, manager


def test_rollback_restores_the_mask(llm: LLM) -> None:
    engine = llm.engine
    backend, processor = grammar_stage(llm)
    name = "nested_objects"
    request = Request(
        "r", [5, 6], SamplingParams(structured_output=schema_output(name)), engine.eos_token_ids
    )
    processor.add(2, request)
    tokenizer = llm.tokenizer
    answer = '{"user": {"first": "ab", "address": {"zip": "12345", "city": "Nice"}}}'
    tokens = tokenizer.encode(answer, add_special_tokens=False)
    masks = [allowed_tokens(processor, 2, engine.vocab_size)]
    for token in tokens:
        assert masks[-1][token], f"{tokenizer.decode([token])!r} should be allowed"
        processor.accept_batch([2], [token])
        masks.append(allowed_tokens(processor, 2, engine.vocab_size))
    assert processor.finished_rows() == {2}  # the grammar completed on the last token
    assert len({tuple(m.nonzero().flatten().tolist()) for m in masks}) > 3, "masks should vary"
    for back in (1, 5, len(tokens) - 3):
        processor.rollback(2, back)
        assert torch.equal(
            allowed_tokens(processor, 2, engine.vocab_size), masks[len(tokens) - back]
        ), f"rollback({back})"
        for token in tokens[len(tokens) - back :]:
            processor.accept_batch([2], [token])
        processor.finished_rows()
    processor.remove(2)
    assert not processor.is_active
    backend.shutdown()


def test_a_preempted_request_keeps_its_matcher(llm: LLM) -> None:
    engine = llm.engine
    backend, processor = grammar_stage(llm)
    request = Request(
        "r",
        [5, 6],
        SamplingParams(structured_output=schema_output("nested_objects")),
        engine.eos_token_ids,
    )
    processor.add(1, request)
    for token in llm.tokenizer.encode('{"user": {"first": "a', add_special_tokens=False):
        processor.accept_batch([1], [token])
        request.output_token_ids.append(token)
    before = allowed_tokens(processor, 1, engine.vocab_size)
    kept = processor._rows[1]
    request.status = RequestStatus.PREEMPTED
    processor.remove(1)
    assert not processor.is_active
    backend._cache.clear()  # even with the grammar evicted, nothing is recompiled
    compiled = backend.num_compiled
    request.status = RequestStatus.RUNNING
    processor.add(3, request)
    assert processor._rows[3] is kept, "the preempted request's matcher comes back"
    assert backend.num_compiled == compiled
    assert torch.equal(allowed_tokens(processor, 3, engine.vocab_size), before)
    request.status = RequestStatus.FINISHED_ABORTED
    processor.remove(3)
    processor.drop(request)  # what the engine does when a request ends
    assert not processor._lanes, "a finished request's matcher is not kept"
    backend.shutdown()


# -- edge cases --------------------------------------------------------------------------------


def test_ignore_eos_still_ends_a_completed_grammar(model_dirs: dict) -> None:
    llm = make_llm(model_dirs["llama"])
    structured = StructuredOutput("json_schema", json.dumps(_integer(0, 100000)))
    params = [
        SamplingParams(
            max_tokens=12, temperature=1.0, seed=s, ignore_eos=True, structured_output=structured
        )
        for s in range(12)
    ]
    outputs = llm.generate(make_prompts(len(params)), params, use_tqdm=False)
    for output in outputs:
        assert_stopped(output, "ignore_eos")
        assert 0 <= int(completion(output).text) <= 100000


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
        {"type": "string", "format": "email", "maxLength": 8},
        {"type": "array", "items": _integer(0, 3), "uniqueItems": True},
        {"type": "array", "items": _integer(0, 3), "contains": {"const": 3}},
        {"type": "number", "multipleOf": 0.5},
        {
            "type": "object",
            "properties": {"a": _integer(0, 3), "b": _integer(0, 3)},
            "dependentRequired": {"a": ["b"]},
        },
        {"oneOf": [_integer(0, 3), {"type": "number"}]},
        {"type": "string", "pattern": "^(?!ab)[a-z]{2}$"},
    ],
    ids=[
        "pattern+maxLength",
        "format+maxLength",
        "uniqueItems",
        "contains",
        "multipleOf",
        "dependentRequired",
        "overlapping-oneOf",
        "lookahead",
    ],
)
def test_keywords_xgrammar_would_ignore_are_refused(schema: dict, llm: LLM) -> None:
    params = SamplingParams(structured_output=StructuredOutput("json_schema", json.dumps(schema)))
    with pytest.raises(RequestError, match="not supported"):
        llm.generate(make_prompts(1), params, use_tqdm=False)


# -- the grammar backend contract -------------------------------------------------------------


def test_the_xgrammar_backend_conforms(llm: LLM) -> None:
    engine = llm.engine
    check_grammar_backend(
        XGrammarBackend, XGrammarOptions(), engine.checkpoint, vocab_size=engine.vocab_size
    )


class _NeverEnds(XGrammarMatcher):
    def is_terminated(self) -> bool:
        return False


class _NeverEndingBackend(XGrammarBackend):
    """Its matchers never report a finished grammar (the request would run to max_tokens)."""

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        inner = super().matcher(compiled)
        return _NeverEnds(inner._matcher, inner._non_stop, inner._scratch)


def test_the_grammar_check_fails_a_matcher_that_never_terminates(llm: LLM) -> None:
    engine = llm.engine
    with pytest.raises(AssertionError, match="is_terminated"):
        check_grammar_backend(
            _NeverEndingBackend,
            XGrammarOptions(),
            engine.checkpoint,
            vocab_size=engine.vocab_size,
        )
