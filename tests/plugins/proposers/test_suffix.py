"""The suffix-decoding proposer: drafts from the request's own text and from finished
requests, weighed by counts, with a bounded, exactly evicted corpus."""

from __future__ import annotations

import random

from brigade.interfaces import DraftSlot, ProposerParams, Request, SamplingParams
from brigade.plugins.proposers.suffix import SuffixOptions, SuffixProposer
from brigade.testing.conformance import check_proposer

PARAMS = ProposerParams(
    num_speculative_tokens=5, vocab_size=1000, max_num_seqs=8, max_model_len=4096
)
UNLIMITED = {"max_spec_factor": 64.0}
"""Lets a short match draft up to max_tokens, to test the probability rule alone."""


def make_request(
    prompt: list[int], output: list[int] | None = None, request_id: str = "r"
) -> Request:
    return Request(
        request_id, prompt, SamplingParams(max_tokens=1000), output_token_ids=output or []
    )


def draft(proposer: SuffixProposer, request: Request, max_tokens: int = 5) -> list[int]:
    (tokens,) = proposer.propose([DraftSlot(request, max_tokens)])
    return list(tokens)


def finish(proposer: SuffixProposer, output: list[int], prompt: list[int] | None = None) -> None:
    """A request that generated ``output`` leaves the engine."""
    proposer.remove(make_request(prompt or [900, 901], output, request_id=f"done-{output[:4]}"))


def test_conforms() -> None:
    check_proposer(SuffixProposer(PARAMS, SuffixOptions()), PARAMS)
    small = SuffixOptions(
        max_depth=3, max_cached_requests=2, max_request_tokens=8, index_prompts=True
    )
    check_proposer(SuffixProposer(PARAMS, small), PARAMS)


def test_drafts_a_pattern_the_request_repeats() -> None:
    proposer = SuffixProposer(PARAMS, SuffixOptions())
    pattern = list(range(10, 18))
    request = make_request(pattern * 3, [10, 11])
    assert draft(proposer, request) == [12, 13, 14, 15, 16]
    assert draft(proposer, request, 2) == [12, 13]
    request.output_token_ids.extend([12, 13, 14, 15, 16, 17])
    assert draft(proposer, request, 3) == [10, 11, 12]


def test_learns_from_a_finished_request() -> None:
    proposer = SuffixProposer(PARAMS, SuffixOptions())
    earlier = list(range(100, 140))
    prompt, output = [1, 2, 3], list(range(100, 106))
    assert draft(proposer, make_request(prompt, output, "before")) == []
    finish(proposer, earlier)
    assert draft(proposer, make_request(prompt, output, "after")) == [106, 107, 108, 109, 110]


def test_the_longest_match_wins_and_the_request_wins_a_tie() -> None:
    own = [1, 2, 60, 9, 1, 2]  # (1, 2) was followed by 60; (9, 1, 2) has no follower yet
    tie = SuffixProposer(PARAMS, SuffixOptions())
    finish(tie, [5, 1, 2, 70, 71])  # (1, 2) -> 70 too: a 2-token match in both
    assert draft(tie, make_request(own), 1) == [60]
    longer = SuffixProposer(PARAMS, SuffixOptions())
    finish(longer, [9, 1, 2, 70, 71])  # (9, 1, 2) -> 70: a 3-token match
    assert draft(longer, make_request(own), 1) == [70]


def test_drafts_the_most_frequent_continuation_while_probable_enough() -> None:
    shared = [50, 51, 52, 53]
    outputs = [[*shared, 60, 61, 62], [*shared, 70, 71, 72]]
    request = make_request([1, 2, 3], [50, 51])

    def drafts(min_probability: float, finished: list[list[int]]) -> list[int]:
        proposer = SuffixProposer(
            PARAMS, SuffixOptions(min_probability=min_probability, **UNLIMITED)
        )
        for output in finished:
            finish(proposer, output)
        return draft(proposer, request)

    # After 53 the corpus saw 60 once and 70 once: the draft is worth 0.5 from there on.
    assert drafts(0.6, outputs) == [52, 53]
    assert drafts(0.4, outputs) == [52, 53, 60, 61, 62]  # a tie goes to the lower id
    # 70 twice out of three: the more frequent continuation, worth 2/3.
    assert drafts(0.6, [*outputs, [*shared, 70, 71, 72]]) == [52, 53, 70, 71, 72]
    # At the fork itself nothing is probable enough.
    at_fork = SuffixProposer(PARAMS, SuffixOptions(min_probability=0.6, **UNLIMITED))
    for output in outputs:
        finish(at_fork, output)
    assert draft(at_fork, make_request([1, 2, 3], shared)) == []


def test_a_short_match_drafts_few_tokens() -> None:
    def drafts(max_spec_factor: float) -> list[int]:
        proposer = SuffixProposer(PARAMS, SuffixOptions(max_spec_factor=max_spec_factor))
        finish(proposer, [5, 6, 7, 8, 9])
        return draft(proposer, make_request([1, 2, 3], [5]))  # matches (5,) only

    assert drafts(1.0) == [6]
    assert drafts(3.0) == [6, 7, 8]


def test_never_drafts_beyond_the_vocabulary() -> None:
    params = ProposerParams(
        num_speculative_tokens=5, vocab_size=100, max_num_seqs=8, max_model_len=512
    )
    proposer = SuffixProposer(params, SuffixOptions(**UNLIMITED))
    assert draft(proposer, make_request([1, 2, 3, 150, 4, 1, 2])) == [3]


def test_prompts_join_the_corpus_only_when_asked() -> None:
    prompt = list(range(200, 220))
    request = make_request([1], list(range(200, 206)))
    for index_prompts, expected in ((False, []), (True, [206, 207, 208, 209, 210])):
        proposer = SuffixProposer(PARAMS, SuffixOptions(index_prompts=index_prompts))
        finish(proposer, [7, 8, 9], prompt=prompt)
        assert draft(proposer, request) == expected


def test_an_evicted_request_leaves_no_trace() -> None:
    rng = random.Random(3)
    outputs = [[rng.randrange(8) for _ in range(60)] for _ in range(5)]
    options = SuffixOptions(max_cached_requests=2, min_probability=0.3)
    proposer = SuffixProposer(PARAMS, options)
    for output in outputs:
        finish(proposer, output)
    fresh = SuffixProposer(PARAMS, options)
    for output in outputs[-2:]:
        finish(fresh, output)
    assert proposer._corpus.contexts == fresh._corpus.contexts
    for number, output in enumerate(outputs):
        for end in range(1, len(output), 3):
            probe = make_request([999], output[:end], request_id=f"probe-{number}-{end}")
            assert draft(proposer, probe) == draft(fresh, probe), f"after {output[:end]}"
    assert proposer._corpus.contexts != SuffixProposer(PARAMS, options)._corpus.contexts


def test_memory_stays_bounded() -> None:
    options = SuffixOptions(max_depth=4, max_request_tokens=64, max_cached_requests=3)
    proposer = SuffixProposer(PARAMS, options)
    rng = random.Random(5)
    request = make_request([rng.randrange(50) for _ in range(10)], request_id="long")
    for _ in range(400):
        request.output_token_ids.extend(rng.randrange(50) for _ in range(rng.randint(1, 5)))
        draft(proposer, request)
        assert len(proposer._indexes["long"].counts.contexts) <= 64 * 4
    # The sliding window counts exactly what an index of its last 64 tokens would.
    last = (request.prompt_token_ids + request.output_token_ids)[-64:]
    window = SuffixProposer(PARAMS, options)
    draft(window, make_request(last, request_id="window"))
    assert proposer._indexes["long"].counts.contexts == window._indexes["window"].counts.contexts
    for number in range(10):
        finish(proposer, [rng.randrange(50) for _ in range(200)], prompt=[number])
    assert len(proposer._cached) == 3
    assert all(len(text) == 64 for text in proposer._cached)
    assert len(proposer._corpus.contexts) <= 3 * 64 * 4


def test_a_removed_id_starts_fresh() -> None:
    proposer = SuffixProposer(PARAMS, SuffixOptions(max_cached_requests=0))
    old = make_request([1, 2, 3, 9, 1, 2], request_id="same")
    assert draft(proposer, old, 2) == [3, 9]
    proposer.remove(old)
    assert draft(proposer, make_request([4, 5, 1, 2], request_id="same")) == []
