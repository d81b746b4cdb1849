"""The plain-torch sampler: Brigade's sampler conformance suite, plus what its stages do."""

from __future__ import annotations

import pytest
import torch
from brigade.interfaces import NoOptions, Request, SamplerParams, SamplingParams
from brigade.testing.conformance import (
    check_logits_processor,
    check_sampler,
    make_sampling_batch,
)

from brigade_example_stations import PlainTorchSampler
from brigade_example_stations.request_stages import BiasAndPenalties, MinTokensMask


def test_plain_torch_sampler_conforms() -> None:
    check_sampler(PlainTorchSampler, NoOptions())


def test_its_request_stages_pass_the_logits_processor_check() -> None:
    check_logits_processor(lambda params, _: BiasAndPenalties(params), None)
    check_logits_processor(lambda params, _: MinTokensMask(params), None)


def test_a_row_without_a_distribution_is_answered_minus_one() -> None:
    sampler = PlainTorchSampler(SamplerParams(max_num_seqs=4, vocab_size=8, device="cpu"), None)
    logits = torch.zeros(3, 8)
    logits[1] = float("-inf")
    logits[2, 3] = float("nan")
    for temperature in (0.0, 1.0):
        batch = make_sampling_batch(3, temperature=temperature)
        assert sampler.sample(logits.clone(), batch).token_ids.tolist()[1:] == [-1, -1]


def test_a_bias_outside_the_vocabulary_fails_the_request_with_a_reason() -> None:
    stage = BiasAndPenalties(SamplerParams(max_num_seqs=4, vocab_size=8, device="cpu"))
    request = Request("r", [1, 2], SamplingParams(logit_bias={9: 1.0}))
    with pytest.raises(ValueError, match=r"logit_bias of request r .*0 to 7"):
        stage.add(0, request)
