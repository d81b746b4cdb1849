"""Conformance of a proposer, driven through the lifecycle core gives it.

:func:`check_proposer` feeds synthetic requests whose text repeats (so a proposer that looks
for patterns finds some) and checks what core relies on: one draft per slot, each at most
``max_tokens`` ints in the vocabulary; the requests are left untouched; and every call keeps
working as tokens grow by one or by several per step, as requests skip steps, interleave, are
observed and removed, and as a request id comes back after its request was removed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from brigade.interfaces import DraftSlot, Proposer, ProposerParams, Request, SamplingParams

__all__ = ["check_proposer"]

_PATTERN = (3, 1, 4, 1, 5, 9, 2, 6)
"""The text the synthetic requests repeat, with noise (ids mod the vocabulary)."""


def check_proposer(proposer: Proposer, params: ProposerParams) -> None:
    """Run ``proposer`` (built with ``params``) through requests that grow, interleave, skip
    steps, are observed, removed and replaced by a request with the same id; check every
    answer of :meth:`Proposer.propose`. Raises AssertionError naming the first violation."""
    assert isinstance(proposer, Proposer), f"{type(proposer).__name__} is not a Proposer"
    assert params.num_speculative_tokens >= 1, "params.num_speculative_tokens must be >= 1"
    rng = random.Random(0)
    _propose(proposer, params, [], "with no slots")

    # One request, one token per step, every max_tokens from 1 to num_speculative_tokens.
    single = _request("conformance-single", _text(rng, params, 40))
    for step in range(24):
        max_tokens = 1 + step % params.num_speculative_tokens
        _step(proposer, params, rng, [DraftSlot(single, max_tokens)], f"single step {step}", 1)

    # Several requests, interleaved in a shuffled order, some skipping steps, gaining several
    # tokens per step (accepted drafts, or steps the proposer did not see).
    live = [_request(f"conformance-{i}", _text(rng, params, 1 + 17 * i)) for i in range(4)]
    for step in range(30):
        batch = [request for request in live if rng.random() < 0.7]
        rng.shuffle(batch)
        slots = [DraftSlot(r, rng.randint(1, params.num_speculative_tokens)) for r in batch]
        _step(proposer, params, rng, slots, f"interleaved step {step}", 4)
        for request in live:
            if request not in batch and rng.random() < 0.3:
                request.output_token_ids.extend(_text(rng, params, rng.randint(1, 6)))

    # Remove every request; a request removed before the proposer ever saw it too.
    for request in [*live, single, _request("conformance-unseen", [1, 2, 3])]:
        proposer.remove(request)

    # The same ids again, with other (shorter) texts: their state must start fresh.
    reused = [_request(r.request_id, _text(rng, params, 3 + i)) for i, r in enumerate(live)]
    for step in range(10):
        slots = [DraftSlot(r, params.num_speculative_tokens) for r in reused]
        _step(proposer, params, rng, slots, f"after reusing ids, step {step}", 3)
    for request in reused:
        proposer.remove(request)
    _propose(proposer, params, [], "with no slots, after every request left")


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=100_000))


def _text(rng: random.Random, params: ProposerParams, length: int) -> list[int]:
    """``length`` tokens of the repeating pattern, one in five replaced by a random token."""
    vocab = params.vocab_size
    return [
        rng.randrange(vocab) if rng.random() < 0.2 else _PATTERN[i % len(_PATTERN)] % vocab
        for i in range(length)
    ]


def _step(
    proposer: Proposer,
    params: ProposerParams,
    rng: random.Random,
    slots: Sequence[DraftSlot],
    when: str,
    max_gain: int,
) -> None:
    """Propose, accept a random prefix of each draft (as verification would), append the
    accepted drafts and one sampled token, then observe, as core does."""
    drafts = _propose(proposer, params, slots, when)
    for slot, draft in zip(slots, drafts, strict=True):
        accepted = rng.randint(0, len(draft))
        request = slot.request
        request.output_token_ids.extend(draft[:accepted])
        request.output_token_ids.extend(_text(rng, params, rng.randint(1, max_gain)))
        proposer.observe(request, len(draft), accepted)


def _propose(
    proposer: Proposer, params: ProposerParams, slots: Sequence[DraftSlot], when: str
) -> list[list[int]]:
    before = [(list(s.request.prompt_token_ids), list(s.request.output_token_ids)) for s in slots]
    drafts = proposer.propose(slots)
    after = [(s.request.prompt_token_ids, s.request.output_token_ids) for s in slots]
    assert after == before, f"propose changed a request's tokens ({when}); requests are read-only"
    assert isinstance(drafts, Sequence), (
        f"propose returned {type(drafts).__name__} ({when}), not a sequence of drafts"
    )
    assert len(drafts) == len(slots), (
        f"propose returned {len(drafts)} drafts for {len(slots)} slots ({when})"
    )
    checked = []
    for slot, draft in zip(slots, drafts, strict=True):
        name = f"the draft of {slot.request.request_id!r} ({when})"
        is_sequence = isinstance(draft, Sequence) and not isinstance(draft, str | bytes)
        assert is_sequence, f"{name} is a {type(draft).__name__}, not a sequence of token ids"
        assert len(draft) <= slot.max_tokens, (
            f"{name} has {len(draft)} tokens; the slot allows at most {slot.max_tokens}"
        )
        for token in draft:
            is_int = isinstance(token, int) and not isinstance(token, bool)
            assert is_int, f"{name} holds {token!r}, not an int"
            assert 0 <= token < params.vocab_size, (
                f"{name} holds {token}, outside the vocabulary [0, {params.vocab_size})"
            )
        checked.append(list(draft))
    return checked
