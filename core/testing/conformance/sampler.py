"""Conformance of samplers and their logits processors.

:func:`check_sampler` draws thousands of rows at once and checks support sets exactly (a token
outside top-k, the top-p nucleus or the min-p threshold must never appear, every token inside
must), greedy rows, the sampled distribution at several temperatures, seeded rows'
independence from the rest of the batch and log probabilities; drives the sampler's chain as
core does to check that every field it owns (logit_bias, penalties, min_tokens, the
configured processors) changes the tokens as specified; and runs each logits processor of
the chain through a simulated lifecycle. Each failure names the field that was not honoured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from brigade.interfaces import Sampler, SamplerParams, SamplingBatch
from brigade.testing.conformance.logits_processor import run_processor_lifecycle
from brigade.testing.conformance.sampler_batch import make_sampling_batch
from brigade.testing.conformance.sampler_chain import check_chain

__all__ = ["check_sampler", "make_sampling_batch"]

_NUM_DRAWS = 2000
"""Rows drawn at once by the support checks (a 5% token is missed with probability 1e-45)."""


def check_sampler(
    factory: Callable[[SamplerParams, Any], Sampler],
    options: Any,
    *,
    vocab_size: int = 64,
    device: str = "cpu",
) -> None:
    """Check a sampler built as ``factory(SamplerParams(...), options)``.

    ``vocab_size`` must be at least 32 (the support checks keep up to 16 tokens). The
    sampler is also built with two probe processors in ``SamplerParams.logits_processors``,
    which it must place in its chain (see ``Sampler.logits_processors``).
    """
    if vocab_size < 32:
        raise ValueError(f"check_sampler needs vocab_size >= 32, got {vocab_size}")
    params = SamplerParams(max_num_seqs=_NUM_DRAWS, vocab_size=vocab_size, device=device)
    sampler = factory(params, options)
    generator = torch.Generator().manual_seed(0)

    def random_logits(num_rows: int) -> torch.Tensor:
        return torch.randn(num_rows, vocab_size, generator=generator).mul_(3).to(device)

    _check_greedy(sampler, random_logits(64), device)
    _check_temperature(sampler, vocab_size, device)
    _check_supports(sampler, vocab_size, generator, device)
    _check_seeded_rows(sampler, random_logits, device)
    _check_logprobs(sampler, random_logits(16), device)
    check_chain(factory, options, vocab_size, device)
    for processor in sampler.logits_processors():
        run_processor_lifecycle(processor, params, random_logits)


def _sample(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    output = sampler.sample(logits.clone(), batch)  # a sampler may edit logits in place
    ids = output.token_ids
    assert ids.dtype == torch.int64, f"token_ids dtype {ids.dtype}, expected int64"
    assert ids.shape == (logits.shape[0],), f"token_ids shape {tuple(ids.shape)}"
    return ids


def _check_greedy(sampler: Sampler, logits: torch.Tensor, device: str) -> None:
    num_rows = logits.shape[0]
    expected = logits.argmax(dim=-1)
    greedy = _sample(sampler, logits, make_sampling_batch(num_rows, temperature=0, device=device))
    assert torch.equal(greedy, expected), "temperature=0: an all-greedy batch is not the argmax"
    mixed = [0.0 if i % 2 else 1.0 for i in range(num_rows)]
    batch = make_sampling_batch(num_rows, temperature=mixed, top_p=0.9, device=device)
    tokens = _sample(sampler, logits, batch)
    assert torch.equal(tokens[1::2], expected[1::2]), (
        "temperature=0: greedy rows batched with random rows are not the argmax"
    )
    tokens = _sample(sampler, logits, make_sampling_batch(num_rows, top_k=1, device=device))
    assert torch.equal(tokens, expected), "top_k=1: differs from greedy"
    cold = _sample(sampler, logits, make_sampling_batch(num_rows, temperature=1e-3, device=device))
    margin = logits.topk(2, dim=-1).values.diff(dim=-1).abs().squeeze(1)  # [S]
    clear = margin > 0.05  # near-ties may still flip at T=1e-3
    assert torch.equal(cold[clear], expected[clear]), (
        "temperature=1e-3: does not concentrate on the argmax"
    )


def _check_temperature(sampler: Sampler, vocab_size: int, device: str) -> None:
    """Two tokens a logit apart: the first is drawn with probability sigmoid(1 / T)."""
    logits = torch.full((_NUM_DRAWS, vocab_size), float("-inf"), device=device)
    logits[:, 0], logits[:, 1] = 1.0, 0.0
    seeds = {index: index for index in range(_NUM_DRAWS)}  # deterministic draws
    for temperature in (0.5, 2.0):
        batch = make_sampling_batch(_NUM_DRAWS, temperature=temperature, seeds=seeds, device=device)
        tokens = _sample(sampler, logits, batch)
        assert bool(((tokens == 0) | (tokens == 1)).all()), (
            f"temperature={temperature}: sampled a token whose logit is -inf"
        )
        share = float((tokens == 0).double().mean())
        expected = float(torch.sigmoid(torch.tensor(1.0 / temperature)))
        # 0.05 is over 4.5 standard deviations of the share over 2000 draws.
        assert abs(share - expected) < 0.05, (
            f"temperature={temperature}: the better of two tokens a logit apart was drawn "
            f"{share:.3f} of the time, expected {expected:.3f} (softmax(logits / T))"
        )


def _check_supports(
    sampler: Sampler, vocab_size: int, generator: torch.Generator, device: str
) -> None:
    # Logits spread over a range where every kept token has a fair share of the mass.
    values = torch.linspace(1.5, -1.5, vocab_size, dtype=torch.float64)
    order = torch.randperm(vocab_size, generator=generator)
    row = torch.empty(vocab_size, dtype=torch.float64)
    row[order] = values  # row[order[j]] is the j-th largest logit
    probs = row.softmax(-1)[order]  # descending
    cumulative = probs.cumsum(0)
    nucleus = 11  # a p halfway between two cumulative sums leaves no float ambiguity
    top_p = float(cumulative[nucleus - 2] + cumulative[nucleus - 1]) / 2
    assert _nucleus(probs, top_p) == nucleus
    above_min_p = 7
    min_p = float(probs[above_min_p - 1] + probs[above_min_p]) / 2 / float(probs[0])
    cases: list[tuple[str, dict[str, Any], int]] = [
        ("top_k=5", {"top_k": 5}, 5),
        (f"top_p={top_p:.4f}", {"top_p": top_p}, nucleus),
        (f"min_p={min_p:.4f}", {"min_p": min_p}, above_min_p),
        # top-p after top-k measures the renormalised top-k mass (HF and vLLM order)
        ("top_k=16 then top_p", {"top_k": 16, "top_p": top_p}, _nucleus(probs[:16], top_p)),
        ("top_p with min_p", {"top_p": top_p, "min_p": min_p}, above_min_p),
    ]
    logits = row.float().expand(_NUM_DRAWS, vocab_size).to(device)
    for label, knobs, size in cases:
        batch = make_sampling_batch(_NUM_DRAWS, device=device, **knobs)
        drawn = set(_sample(sampler, logits, batch).unique().tolist())
        expected = set(order[:size].tolist())
        assert drawn <= expected, f"{label}: sampled tokens outside the support: {drawn - expected}"
        assert drawn == expected, f"{label}: support tokens never sampled: {expected - drawn}"


def _nucleus(probs: torch.Tensor, top_p: float) -> int:
    """Size of the minimal nucleus of descending ``probs`` (renormalised) reaching ``top_p``."""
    cumulative = probs.cumsum(0) / probs.sum()
    size = int((cumulative < top_p).sum()) + 1
    margin = float((cumulative - top_p).abs().min())
    assert margin > 1e-4, f"top_p={top_p} is too close to a cumulative sum for float32"
    return size


def _check_seeded_rows(
    sampler: Sampler, random_logits: Callable[[int], torch.Tensor], device: str
) -> None:
    steps = [random_logits(1).div_(3) for _ in range(6)]  # flat enough that tokens vary

    def run(num_rows: int, position: int, others: float, seeds: dict[int, int]) -> list[int]:
        """The seeded row's tokens, at temperature 1 among rows at temperature ``others``."""
        temperature = [others] * num_rows
        temperature[position] = 1.0
        tokens = []
        for step_logits in steps:
            logits = random_logits(num_rows)
            logits[position] = step_logits[0]
            batch = make_sampling_batch(
                num_rows, temperature=temperature, seeds=seeds, device=device
            )
            tokens.append(int(_sample(sampler, logits, batch)[position]))
            torch.rand(7)  # move the default generator between steps
        return tokens

    # Seeds are fresh generators per run, advanced across steps as core's would be.
    alone = run(1, 0, 1.0, {0: 1234})
    seeds = {0: 99, 3: 1234, 5: 7}
    assert run(8, 3, 0.7, seeds) == alone, "seed: a seeded row changed with batch composition"
    assert run(5, 3, 0.0, {3: 1234}) == alone, "seed: a seeded row changed next to greedy rows"
    others = {run(1, 0, 1.0, {0: seed})[0] for seed in range(1, 40)}
    assert len(others) > 1, "seed: different seeds always give the same token"


def _check_logprobs(sampler: Sampler, logits: torch.Tensor, device: str) -> None:
    num_rows = logits.shape[0]
    reference = logits.double().cpu().log_softmax(dim=-1)
    plain = make_sampling_batch(num_rows, device=device)
    assert sampler.sample(logits.clone(), plain).logprobs is None, (
        "logprobs returned although no row asked for them"
    )
    for num_logprobs, temperature in ((0, 1.0), (3, 0.0), (5, 0.6)):
        batch = make_sampling_batch(
            num_rows, temperature=temperature, max_num_logprobs=num_logprobs, device=device
        )
        output = sampler.sample(logits.clone(), batch)
        label = f"logprobs={num_logprobs}, temperature={temperature}"
        values, ids = output.logprobs, output.logprob_token_ids
        assert values is not None, f"{label}: no logprobs returned"
        assert ids is not None, f"{label}: no logprob_token_ids returned"
        shape = (num_rows, 1 + num_logprobs)
        assert values.shape == shape, f"{label}: logprobs shape {tuple(values.shape)}"
        assert ids.shape == shape, f"{label}: logprob_token_ids shape {tuple(ids.shape)}"
        assert values.dtype == torch.float32, f"{label}: logprobs dtype {values.dtype}"
        assert ids.dtype == torch.int64, f"{label}: logprob_token_ids dtype {ids.dtype}"
        assert torch.equal(ids[:, 0], output.token_ids), f"{label}: column 0 is not the sample"
        expected = reference.gather(1, ids.cpu()).float()
        assert torch.allclose(values.cpu(), expected, atol=1e-4), (
            f"{label}: not log_softmax of the logits before temperature"
        )
        top = values[:, 1:]
        assert (top[:, :-1] >= top[:, 1:]).all(), f"{label}: top-N not sorted descending"
        if num_logprobs:
            best = reference.topk(num_logprobs, dim=-1).values.float()
            assert torch.allclose(top.cpu(), best, atol=1e-4), f"{label}: not the top-N"
