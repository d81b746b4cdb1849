"""The n-gram prompt-lookup proposer: what it drafts, from which occurrence, incrementally."""

from __future__ import annotations

import random

import pytest

from brigade.interfaces import DraftSlot, ProposerParams, Request, SamplingParams
from brigade.plugins.proposers.ngram import NgramOptions, NgramProposer
from brigade.testing.conformance import check_proposer

PARAMS = ProposerParams(
    num_speculative_tokens=5, vocab_size=1000, max_num_seqs=8, max_model_len=4096
)


def make_request(
    prompt: list[int], output: list[int] | None = None, request_id: str = "r"
) -> Request:
    return Request(
        request_id, prompt, SamplingParams(max_tokens=1000), output_token_ids=output or []
    )


def draft(proposer: NgramProposer, request: Request, max_tokens: int = 5) -> list[int]:
    (tokens,) = proposer.propose([DraftSlot(request, max_tokens)])
    return list(tokens)


def test_conforms() -> None:
    check_proposer(NgramProposer(PARAMS, NgramOptions()), PARAMS)
    check_proposer(NgramProposer(PARAMS, NgramOptions(min_n=1, max_n=1)), PARAMS)


def test_drafts_the_continuation_of_the_latest_occurrence() -> None:
    proposer = NgramProposer(PARAMS, NgramOptions(min_n=2, max_n=3))
    request = make_request([1, 2, 3, 10, 20, 1, 2, 3, 11, 21, 9], [1, 2, 3])
    assert draft(proposer, request, 2) == [11, 21]


def test_prefers_the_longer_ngram() -> None:
    proposer = NgramProposer(PARAMS, NgramOptions(min_n=2, max_n=3))
    # (2, 3) last occurred before 50, but (5, 2, 3) only before 40.
    request = make_request([5, 2, 3, 40, 6, 2, 3, 50, 5, 2, 3])
    assert draft(proposer, request, 1) == [40]


def test_respects_max_tokens_and_the_end_of_the_text() -> None:
    proposer = NgramProposer(PARAMS, NgramOptions())
    request = make_request([7, 8, 1, 2, 3, 4, 5, 6, 7, 8])
    assert draft(proposer, request, 3) == [1, 2, 3]
    assert draft(proposer, request, 5) == [1, 2, 3, 4, 5]
    # Fewer than max_tokens follow the earlier (7, 8): the draft stops at the last token.
    assert draft(proposer, make_request([9, 7, 8, 1, 7, 8], request_id="short"), 5) == [1, 7, 8]


def test_proposes_nothing_without_a_match() -> None:
    proposer = NgramProposer(PARAMS, NgramOptions(min_n=2, max_n=4))
    assert draft(proposer, make_request([1, 2, 3, 4, 5, 6, 7, 2])) == []  # only a 1-gram repeats
    assert draft(proposer, make_request([4], request_id="short")) == []


def test_indexing_over_many_calls_matches_one_call() -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(6) for _ in range(300)]
    incremental = NgramProposer(PARAMS, NgramOptions())
    request = make_request(tokens[:5])
    position = 5
    while position < len(tokens):
        position = min(len(tokens), position + rng.randint(1, 4))
        request.output_token_ids[:] = tokens[5:position]
        at_once = NgramProposer(PARAMS, NgramOptions())
        expected = draft(at_once, make_request(tokens[:position]))
        assert draft(incremental, request) == expected, f"after {position} tokens"


def test_a_removed_id_starts_fresh() -> None:
    proposer = NgramProposer(PARAMS, NgramOptions())
    old = make_request([1, 2, 3, 9, 1, 2, 3], request_id="same")
    assert draft(proposer, old) == [9, 1, 2, 3]
    proposer.remove(old)
    assert draft(proposer, make_request([4, 5], request_id="same")) == []


def test_min_n_above_max_n_is_refused() -> None:
    with pytest.raises(ValueError, match=r"min_n \(3\) must not exceed max_n \(2\)"):
        NgramOptions(min_n=3, max_n=2)
