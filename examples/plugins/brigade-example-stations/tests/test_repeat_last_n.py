"""The repeat-last-n processor: the logits processor conformance suite, then its window."""

from __future__ import annotations

import pytest
import torch
from brigade.interfaces import Request, SamplerParams, SamplingParams
from brigade.testing.conformance import check_logits_processor

from brigade_example_stations import RepeatLastNOptions, RepeatLastNProcessor

PARAMS = SamplerParams(max_num_seqs=8, vocab_size=16, device="cpu")


def requests_with_extra() -> list[Request]:
    """Requests the processor treats differently: options, overrides, off."""
    return [
        Request("default", [1, 2, 3, 2, 5], SamplingParams()),
        Request("short", [1, 2, 3, 4, 5], SamplingParams(), extra={"repeat_last_n": 2}),
        Request("harsh", [6, 7], SamplingParams(), extra={"repeat_penalty": 3}),
        Request("off", [1, 2, 3], SamplingParams(), extra={"repeat_last_n": 0}),
    ]


@pytest.mark.parametrize(
    "options",
    [RepeatLastNOptions(), RepeatLastNOptions(last_n=3, penalty=2.0), RepeatLastNOptions(last_n=0)],
    ids=["defaults", "window-3", "off-by-default"],
)
def test_repeat_last_n_conforms(options: RepeatLastNOptions) -> None:
    check_logits_processor(RepeatLastNProcessor, options, requests=requests_with_extra())


def penalised_tokens(processor: RepeatLastNProcessor, row: int) -> set[int]:
    logits = torch.full((1, PARAMS.vocab_size), 2.0)
    edited = processor.apply(logits.clone(), torch.tensor([row]))
    return set((edited[0] != logits[0]).nonzero().flatten().tolist())


def test_only_the_last_n_tokens_are_penalised_and_the_window_slides() -> None:
    processor = RepeatLastNProcessor(PARAMS, RepeatLastNOptions(last_n=3, penalty=2.0))
    processor.add(5, Request("r", [1, 2, 3, 4], SamplingParams()))
    assert penalised_tokens(processor, 5) == {2, 3, 4}
    processor.accept_batch([5], [9])
    assert penalised_tokens(processor, 5) == {3, 4, 9}
    processor.rollback(5, 1)
    assert penalised_tokens(processor, 5) == {2, 3, 4}


def test_a_positive_logit_is_divided_and_a_negative_one_multiplied_once() -> None:
    processor = RepeatLastNProcessor(PARAMS, RepeatLastNOptions(last_n=8, penalty=2.0))
    processor.add(0, Request("r", [3, 3, 3, 4], SamplingParams()))
    logits = torch.zeros(1, PARAMS.vocab_size)
    logits[0, 3], logits[0, 4] = 4.0, -1.0
    edited = processor.apply(logits.clone(), torch.tensor([0]))
    assert edited[0, 3].item() == 2.0
    assert edited[0, 4].item() == -2.0


def test_a_bad_override_fails_that_request_with_the_key_and_what_is_allowed() -> None:
    processor = RepeatLastNProcessor(PARAMS, RepeatLastNOptions())
    request = Request("r", [1], SamplingParams(), extra={"repeat_last_n": "lots"})
    with pytest.raises(ValueError, match=r"extra.repeat_last_n must be an integer from 0 to 512"):
        processor.add(0, request)
    assert not processor.is_active
