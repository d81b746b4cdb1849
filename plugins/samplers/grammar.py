"""Structured output on XGrammar: the grammar backend and the grammar logits processor.

:class:`GrammarBackend` is engine-level: it builds XGrammar's tokenizer info from the model's
tokenizer (lazily, on the first structured request), compiles grammars on a small thread pool
so that the step loop never waits for a cold schema, and caches the compiled grammars by
their :class:`~brigade.interfaces.StructuredOutput` (LRU, failures included, so a bad schema
sent again fails fast).

:class:`GrammarProcessor` is the ``LogitsProcessor`` stage: one ``GrammarMatcher`` per
constrained persistent row. Each step the host fills the token bitmask of the constrained
rows being sampled (:meth:`~GrammarProcessor.begin_step`, overlapping the forward pass on a
GPU), copies it to the device once and masks those rows' logits in one call; unconstrained
rows in the same batch are untouched. Matchers advance on accepted tokens, are rebuilt from
the emitted tokens when a preempted request comes back, roll back for speculative decoding,
and report a row as finished as soon as its grammar cannot go on.

Any third-party sampler can reuse the stage: construct a :class:`GrammarProcessor` and return
it from ``logits_processors()``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import re
import threading
from collections.abc import Sequence
from typing import Any

import torch

from brigade.interfaces import (
    LogitsProcessor,
    Request,
    SamplerParams,
    SamplingParams,
    StructuredOutput,
)

__all__ = ["GrammarBackend", "GrammarProcessor", "check_json_schema"]

logger = logging.getLogger(__name__)

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

_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (?:Warning: )?")
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


class GrammarBackend:
    """Tokenizer info, compiler, compile pool and compiled-grammar cache of one engine.

    Thread-safe: :meth:`compile` may be called from the engine thread and from the server's
    event loop at once.
    """

    def __init__(
        self,
        params: SamplerParams,
        *,
        max_whitespace: int = 0,
        compile_threads: int = 2,
        cache_size: int = 256,
    ) -> None:
        self.params = params
        self.max_whitespace = max_whitespace
        self.cache_size = cache_size
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=compile_threads, thread_name_prefix="brigade-grammar"
        )
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()
        self._compiler: Any = None
        self._cache: collections.OrderedDict[StructuredOutput, concurrent.futures.Future[Any]] = (
            collections.OrderedDict()
        )
        self.num_compiled = 0
        """Grammars compiled so far (cache misses)."""

    def compile(self, spec: StructuredOutput) -> concurrent.futures.Future[Any]:
        """The compiled grammar for ``spec``, as a future (done at once on a cache hit).

        A future that fails raises ``ValueError`` with the reason (invalid schema, regex or
        grammar, or a feature structured output cannot enforce).
        """
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self.cache_size:
                oldest = next(iter(self._cache))
                if not self._cache[oldest].done():
                    break  # never drop a compile in flight
                del self._cache[oldest]
            return future

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutput) -> Any:
        compiler = self._get_compiler()
        self.num_compiled += 1
        try:
            return self._compile_with(compiler, spec)
        except ValueError:
            raise
        except Exception as exc:  # XGrammar raises RuntimeError and its own errors
            message = _CPP_PREFIX.sub("", str(exc).strip())
            raise ValueError(f"invalid {_describe(spec.kind)}: {message}") from None

    def _compile_with(self, compiler: Any, spec: StructuredOutput) -> Any:
        whitespace: dict[str, Any] = (
            {"any_whitespace": True, "max_whitespace_cnt": self.max_whitespace}
            if self.max_whitespace
            else {"any_whitespace": False}
        )
        if spec.kind == "json":
            return compiler.compile_json_schema(
                '{"type": "object"}', strict_mode=False, **whitespace
            )
        if spec.kind == "json_schema":
            schema = json.loads(spec.spec)
            check_json_schema(schema)
            return compiler.compile_json_schema(
                json.dumps(_lengths_as_patterns(schema)), **whitespace
            )
        if spec.kind == "regex":
            check_regex(spec.spec)
            return compiler.compile_regex(spec.spec)
        if spec.kind == "ebnf":
            return compiler.compile_grammar(spec.spec)
        if spec.kind == "structural_tag":
            tag = json.loads(spec.spec)
            _prepare_tag_schemas(tag, max(1, self.max_whitespace))
            return compiler.compile_structural_tag(json.dumps(tag))
        raise ValueError(f"unknown structured output kind {spec.kind!r}")

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._build_compiler()
            return self._compiler

    def _build_compiler(self) -> Any:
        import xgrammar as xgr

        checkpoint = self.params.checkpoint
        tokenizer = checkpoint.tokenizer() if checkpoint is not None else None
        if tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer; this engine has none")
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer,
            vocab_size=self.params.vocab_size,
            stop_token_ids=list(self.params.eos_token_ids) or None,
        )
        return xgr.GrammarCompiler(info, max_threads=2)


def _prepare_tag_schemas(tag: object, whitespace: int) -> None:
    """Check and rewrite every JSON-schema region of a structural tag, in place, as a
    ``json_schema`` request's schema is; bound its whitespace unless the tag did."""
    if isinstance(tag, dict):
        if tag.get("type") == "json_schema" and "json_schema" in tag:
            check_json_schema(tag["json_schema"])
            tag["json_schema"] = _lengths_as_patterns(tag["json_schema"])
            tag.setdefault("max_whitespace_cnt", whitespace)
            return
        for value in tag.values():
            _prepare_tag_schemas(value, whitespace)
    elif isinstance(tag, list):
        for value in tag:
            _prepare_tag_schemas(value, whitespace)


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are JSON data, not subschemas."""


_JSON_CHARACTER = r"(?:[ -~\u0080-\u07ff]|[\u0800-\u0fff]|[\u1000-\ud7ff]|[\ue000-\uffff])"
"""One character of a string, as an XGrammar pattern that yields valid UTF-8 only.

Written as alternatives because XGrammar 0.2 lets overlong (``E0 80``, ``F0 80``) and surrogate
(``ED A0``) byte sequences through ``.``, negated classes and wide ranges; 4-byte characters
are left out for the same reason."""


def _lengths_as_patterns(schema: Any) -> Any:
    """``schema`` with every string length bound (and no pattern or format) as a pattern.

    XGrammar 0.2 compiles ``minLength``/``maxLength`` to a character class that admits raw
    control characters, which JSON forbids in strings (mlc-ai/xgrammar#800), and surrogate
    bytes: the answer would not parse, or not as the string the schema bounds. The same bounds
    as a pattern of :data:`_JSON_CHARACTER` go through its JSON-string-aware regex instead.
    """
    if isinstance(schema, list):
        return [_lengths_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {
        key: value if key in _DATA_KEYWORDS else _lengths_as_patterns(value)
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


def _describe(kind: str) -> str:
    return {
        "json": "JSON grammar",
        "json_schema": "JSON schema",
        "regex": "regular expression",
        "ebnf": "EBNF grammar",
        "structural_tag": "structural tag",
    }.get(kind, kind)


class GrammarProcessor(LogitsProcessor):
    """Masks constrained rows' logits to the tokens their grammar allows next."""

    structured_output = True

    def __init__(self, params: SamplerParams, backend: GrammarBackend) -> None:
        import xgrammar as xgr

        self.params = params
        self.backend = backend
        self._xgr = xgr
        self._matchers: dict[int, Any] = {}
        self._requests: dict[int, Request] = {}
        self._preempted: dict[str, tuple[Request, Any, int]] = {}
        """Preempted requests' matchers, with the output length they had accepted."""
        # Host bitmask, one row per sampled row of a step: -1 (all allowed) unless filled.
        self._bitmask = xgr.allocate_token_bitmask(params.max_num_seqs, params.vocab_size)
        self._scratch = xgr.allocate_token_bitmask(1, params.vocab_size)
        self._non_stop = torch.full_like(self._scratch[0], -1)
        for token in params.eos_token_ids:
            if 0 <= token < params.vocab_size:
                self._non_stop[token // 32] &= ~(1 << (token % 32))
        self._step: tuple[list[int], torch.Tensor] | None = None
        self._finished: list[int] = []

    # -- requests -----------------------------------------------------------------------

    def prepare(self, params: SamplingParams) -> concurrent.futures.Future[Any] | None:
        """Compile (or find in the cache) the request's grammar, off the step loop."""
        spec = params.structured_output
        return None if spec is None else self.backend.compile(spec)

    def add(self, row: int, request: Request) -> None:
        """The row's matcher: a preempted request's own, kept with its state, else a new one
        that replays the tokens already emitted."""
        spec = request.sampling_params.structured_output
        if spec is None:
            return
        kept = self._preempted.pop(request.request_id, None)
        if kept is not None and kept[2] == request.num_output_tokens:
            self._matchers[row], self._requests[row] = kept[1], request
            return
        compiled = self.backend.compile(spec).result()  # ready: core gates until it is
        matcher = self._xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        for token in request.output_token_ids:
            if not matcher.accept_token(token):
                raise RuntimeError(
                    f"request {request.request_id!r}: emitted token {token} does not match "
                    "its grammar"
                )
        self._matchers[row], self._requests[row] = matcher, request

    def remove(self, row: int) -> None:
        """Forget the row; a request leaving it unfinished (preempted) keeps its matcher."""
        matcher = self._matchers.pop(row, None)
        request = self._requests.pop(row, None)
        if matcher is None or request is None:
            return
        # Requests that finished while preempted never come back: drop their matchers.
        for request_id, (other, _, _) in list(self._preempted.items()):
            if other.is_finished:
                del self._preempted[request_id]
        if not request.is_finished:
            self._preempted[request.request_id] = (request, matcher, request.num_output_tokens)

    @property
    def is_active(self) -> bool:
        return bool(self._matchers)

    # -- the step -----------------------------------------------------------------------

    def begin_step(self, rows: Sequence[int]) -> None:
        """Fill the bitmasks of the constrained rows among ``rows`` and start their copy."""
        matchers = self._matchers
        indices = [index for index, row in enumerate(rows) if row in matchers]
        if not indices:
            self._step = None
            return
        bitmask = self._bitmask[: len(rows)]
        for index in indices:
            matchers[rows[index]].fill_next_token_bitmask(self._bitmask, index)
        device = torch.device(self.params.device)
        self._step = (indices, bitmask.to(device, non_blocking=True))

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Set disallowed tokens of the constrained rows to -inf, in one call."""
        if self._step is None:
            return logits
        indices, bitmask = self._step
        self._step = None
        self._xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.params.vocab_size, indices=indices
        )
        return logits

    def accept_batch(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        matchers = self._matchers
        for row, token in zip(rows, token_ids, strict=True):
            matcher = matchers.get(row)
            if matcher is None:
                continue
            if not matcher.accept_token(token):
                # Only reachable if another stage or the sampler ignored the mask: end the
                # row rather than let it continue unconstrained.
                logger.error("row %d: token %d rejected by its grammar; finishing it", row, token)
                self._finished.append(row)
            elif matcher.is_terminated():
                # It took a stop token. Core finishes on EOS anyway, unless ignore_eos: the
                # grammar is over either way.
                self._finished.append(row)
            elif matcher.is_completed() and not self._can_continue(matcher):
                self._finished.append(row)

    def finished_rows(self) -> Sequence[int]:
        finished, self._finished = self._finished, []
        return finished

    def accept(self, row: int, token_ids: Sequence[int]) -> None:
        matcher = self._matchers.get(row)
        if matcher is not None:
            for token in token_ids:
                matcher.accept_token(token)

    def rollback(self, row: int, num_tokens: int) -> None:
        """Undo the row's last ``num_tokens`` accepted tokens."""
        matcher = self._matchers.get(row)
        if matcher is not None and num_tokens:
            matcher.rollback(num_tokens)

    def _can_continue(self, matcher: Any) -> bool:
        """Whether the grammar allows any token other than a stop token next."""
        matcher.fill_next_token_bitmask(self._scratch, 0)
        return bool((self._scratch[0] & self._non_stop).any())
