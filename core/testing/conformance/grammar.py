"""Conformance of grammar backends: compile, refuse, mask, accept, roll back, terminate.

Driven with a real model's tokenizer (any ``Checkpoint`` with one) and no forward pass, on
small grammars whose allowed tokens the check can name from the tokenizer itself.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable
from typing import Any

import torch

from brigade.interfaces import (
    Checkpoint,
    GrammarBackend,
    GrammarMatcher,
    GrammarParams,
    StructuredOutput,
)

__all__ = ["check_grammar_backend"]

GrammarFactory = Callable[[GrammarParams, Any], GrammarBackend]

COMPILE_TIMEOUT_S = 120.0
DIGITS = StructuredOutput(
    "json_schema", json.dumps({"type": "integer", "minimum": 0, "maximum": 9})
)
"""One digit: after it, nothing but a stop token may follow."""
INVALID = StructuredOutput("regex", "(unclosed")


def check_grammar_backend(
    factory: GrammarFactory, options: Any, checkpoint: Checkpoint, *, vocab_size: int
) -> None:
    """The behaviour every grammar backend must show with ``checkpoint``'s tokenizer."""
    tokenizer = checkpoint.tokenizer()
    assert tokenizer is not None, "check_grammar_backend needs a checkpoint with a tokenizer"
    eos = tuple(sorted(checkpoint.eos_token_ids))
    backend = factory(GrammarParams(vocab_size, eos, "cpu", checkpoint=checkpoint), options)
    try:
        _check_compile(backend)
        digit = _single_token(tokenizer, "7")
        letter = _single_token(tokenizer, "x")
        compiled = backend.compile(DIGITS).result(timeout=COMPILE_TIMEOUT_S)
        matcher = backend.matcher(compiled)
        start = _allowed(matcher, vocab_size)
        assert start[digit], "a one-digit grammar does not allow the token '7' first"
        assert not start[letter], "a one-digit grammar allows the token 'x'"
        assert not matcher.accept(letter), "accept() took a token the grammar forbids"
        assert torch.equal(_allowed(matcher, vocab_size), start), (
            "a refused token changed the matcher's state"
        )
        assert not matcher.is_terminated(), "terminated before any token"
        assert matcher.accept(digit), "accept() refused an allowed token"
        after = _allowed(matcher, vocab_size)
        assert not after[digit], "a second digit is allowed after the grammar's one digit"
        assert all(after[token] for token in eos if token < vocab_size), (
            "a complete grammar must allow the model's stop tokens"
        )
        assert matcher.is_terminated(), (
            "is_terminated() is False although the grammar allows nothing but a stop token"
        )
        matcher.rollback(1)
        assert torch.equal(_allowed(matcher, vocab_size), start), "rollback(1) did not restore"
        assert not matcher.is_terminated(), "terminated after rolling back its only token"
        other = backend.matcher(compiled)
        assert torch.equal(_allowed(other, vocab_size), start), "matchers share state"
        _check_apply(backend, matcher, vocab_size)
    finally:
        backend.shutdown()


def _check_compile(backend: GrammarBackend) -> None:
    future = backend.compile(INVALID)
    assert isinstance(future, concurrent.futures.Future), "compile() must return a Future"
    try:
        future.result(timeout=COMPILE_TIMEOUT_S)
    except ValueError:
        pass
    else:
        raise AssertionError("an invalid regex compiled; its future must fail with ValueError")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # thread-safe
        futures = list(pool.map(backend.compile, [DIGITS] * 4))
    for compiled in futures:
        compiled.result(timeout=COMPILE_TIMEOUT_S)


def _check_apply(backend: GrammarBackend, matcher: GrammarMatcher, vocab_size: int) -> None:
    bitmask = torch.full((3, -(-vocab_size // 32)), -1, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 1)
    logits = torch.zeros(3, vocab_size)
    backend.apply_bitmask(logits, bitmask, [1])
    allowed = _allowed(matcher, vocab_size)
    assert torch.equal(torch.isfinite(logits[1]), allowed), "apply_bitmask masked other tokens"
    assert torch.isfinite(logits[0]).all(), "apply_bitmask touched a row it was not given"
    assert torch.isfinite(logits[2]).all(), "apply_bitmask touched a row it was not given"


def _allowed(matcher: GrammarMatcher, vocab_size: int) -> torch.Tensor:
    """[vocab] bool: what the matcher's bitmask allows now."""
    bitmask = torch.full((1, -(-vocab_size // 32)), -1, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((bitmask[0].unsqueeze(-1) >> shifts) & 1).bool().flatten()
    return bits[:vocab_size]


def _single_token(tokenizer: Any, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, f"the check needs {text!r} to be one token; this tokenizer gives {ids}"
    return int(ids[0])
