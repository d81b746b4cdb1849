"""The speculation station's rules, on requests alone: the step's draft budget goes to the
likeliest drafts first, draft lengths adapt, low acceptance pauses a request, the limits of a
request are respected and a proposer that breaks the contract is ignored."""

from __future__ import annotations

from collections.abc import Sequence

from brigade.interfaces import (
    DraftSlot,
    NoOptions,
    Proposer,
    ProposerParams,
    Request,
    RequestStatus,
    SamplingParams,
)
from brigade.options import build_options
from brigade.speculative import PAUSE_STEPS, Speculation, Verified, verify
from brigade.stations import SpeculativeSettings

PARAMS = ProposerParams(num_speculative_tokens=4, vocab_size=100, max_num_seqs=8, max_model_len=64)


class Fixed(Proposer):
    """Proposes ``max_tokens`` copies of 7 for every slot; remembers the slots."""

    def __init__(self) -> None:
        super().__init__(PARAMS, NoOptions())
        self.slots: list[DraftSlot] = []

    def propose(self, slots: Sequence[DraftSlot]) -> list[list[int]]:
        self.slots = list(slots)
        return [[7] * slot.max_tokens for slot in slots]


def station(**settings: object) -> tuple[Speculation, Fixed]:
    proposer = Fixed()
    values = build_options(SpeculativeSettings, settings, "[speculative]")
    return (
        Speculation(proposer, "fixed", values, vocab_size=100, max_model_len=64, processors=()),
        proposer,
    )


def decoding(request_id: str, max_tokens: int = 32, output: int = 3) -> Request:
    request = Request(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    request.output_token_ids = [5] * output
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = request.num_tokens - 1
    return request


def test_verify_accepts_while_the_samples_match() -> None:
    assert verify([4, 5, 6, 9], [4, 5, 6]) == Verified([4, 5, 6, 9], 3, 3)
    assert verify([4, 8, 6, 9], [4, 5, 6]) == Verified([4, 8], 3, 1)
    assert verify([3, 5], [4]) == Verified([3], 1, 0)


def test_the_step_budget_goes_to_the_best_acceptance_first() -> None:
    spec, _ = station(max_tokens_per_step=7, num_speculative_tokens=4)
    good, bad = decoding("good"), decoding("bad")
    spec.observe(good, Verified([7] * 5, 4, 4))
    spec.observe(bad, Verified([7], 4, 0))
    spec.propose([bad, good])
    assert len(good.draft_token_ids) == 4  # 7 tokens - 2 rows = 5 drafts: 4 to the best
    assert len(bad.draft_token_ids) == 1
    spec.propose([bad, good, decoding("c"), decoding("d"), decoding("e"), decoding("f")])
    assert len(good.draft_token_ids) == 1, "one draft left for six rows"
    assert bad.draft_token_ids == []
    spec.propose([decoding(str(i)) for i in range(7)])  # no room at all
    spec, proposer = station(max_batch_size=2, max_tokens_per_step=64)
    spec.propose([decoding("a"), decoding("b"), decoding("c")])
    assert proposer.slots == [], "more requests than max_batch_size"


def test_draft_length_adapts_and_low_acceptance_pauses() -> None:
    spec, proposer = station(max_tokens_per_step=64, num_speculative_tokens=4)
    request = decoding("r")
    spec.propose([request])
    assert proposer.slots[0].max_tokens == 4
    spec.observe(request, Verified([7, 7, 1], 4, 2))
    spec.propose([request])
    assert proposer.slots[0].max_tokens == 3, "accepted + 1 after a rejection"
    spec.observe(request, Verified([7] * 4, 3, 3))
    spec.propose([request])
    assert proposer.slots[0].max_tokens == 4, "one more after a full acceptance"
    for _ in range(20):  # rejections until the moving average falls below 0.1
        spec.observe(request, Verified([1], 1, 0))
        if spec._paused:
            break
    assert spec._paused == {"r": PAUSE_STEPS}
    for _ in range(PAUSE_STEPS - 1):
        proposer.slots = []
        spec.propose([request])
        assert proposer.slots == []
        assert request.draft_token_ids == []
    spec.propose([request])
    assert [slot.max_tokens for slot in proposer.slots] == [1], "back with one draft"


def test_a_request_never_drafts_past_its_limits() -> None:
    spec, proposer = station(max_tokens_per_step=64, num_speculative_tokens=4)
    near_max_tokens = decoding("a", max_tokens=5, output=3)  # 2 more tokens: 1 draft
    near_max_len = decoding("b", max_tokens=100, output=58)  # 61 of 64 tokens: 2 drafts
    at_max_tokens = decoding("c", max_tokens=4, output=3)
    prefilling = decoding("d")
    prefilling.num_computed_tokens = 2
    spec.propose([near_max_tokens, near_max_len, at_max_tokens, prefilling])
    assert {s.request.request_id: s.max_tokens for s in proposer.slots} == {"a": 1, "b": 2}


class Garbage(Fixed):
    def propose(self, slots: Sequence[DraftSlot]) -> list[list[int]]:
        return [[100] for _ in slots]  # outside the vocabulary


def test_drafts_that_break_the_contract_are_dropped() -> None:
    settings = build_options(SpeculativeSettings, {}, "[speculative]")
    spec = Speculation(
        Garbage(), "garbage", settings, vocab_size=100, max_model_len=64, processors=()
    )
    request = decoding("r")
    request.draft_token_ids = [3]  # stale drafts of an earlier step are cleared too
    spec.propose([request])
    assert request.draft_token_ids == []
