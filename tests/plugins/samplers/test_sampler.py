"""The standard sampler and its logits processors: conformance, distributions, numerics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from brigade.interfaces import LogitsProcessor, Request, SamplerParams, SamplingParams
from brigade.plugins.samplers import standard
from brigade.plugins.samplers.processors import (
    LogitBiasProcessor,
    MinTokensProcessor,
    PenaltiesProcessor,
)
from brigade.plugins.samplers.standard import StandardSampler, StandardSamplerOptions
from brigade.testing.conformance.sampler import check_sampler, make_sampling_batch

VOCAB = 16
PARAMS = SamplerParams(max_num_seqs=8, vocab_size=VOCAB, device="cpu")
NUM_DRAWS = 50_000


def request(
    prompt: Sequence[int] = (1, 2),
    output: Sequence[int] = (),
    eos: Sequence[int] = (),
    **sampling: Any,
) -> Request:
    return Request(
        "r",
        list(prompt),
        SamplingParams(max_tokens=64, **sampling),
        eos_token_ids=frozenset(eos),
        output_token_ids=list(output),
    )


def sampler() -> StandardSampler:
    return StandardSampler(PARAMS, StandardSamplerOptions())


def run_chain(
    processors: Sequence[LogitsProcessor], logits: torch.Tensor, rows: list[int]
) -> torch.Tensor:
    """What core does before sampling: every active stage, in order."""
    logits = logits.clone()
    for processor in processors:
        if processor.is_active:
            logits = processor.apply(logits, torch.tensor(rows))
    return logits


def frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=VOCAB).double() / tokens.numel()


def fixed_logits() -> torch.Tensor:
    return torch.linspace(2.0, -2.5, VOCAB)[torch.randperm(VOCAB, generator=torch.Generator())]


@pytest.fixture(params=["kernel", "portable"])
def draw(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test using it runs with the C++ draw (cpu_sample.cpp) and with the portable one."""
    if request.param == "kernel":
        assert standard._draw_kernel(torch.zeros(1, VOCAB)) is not None, "no C++ draw here"
    else:
        monkeypatch.setattr(standard, "_draw_kernel", lambda logits: None)
    return str(request.param)


def test_standard_sampler_conforms(draw: str) -> None:
    check_sampler(StandardSampler, StandardSamplerOptions())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_empirical_distribution_matches_softmax(temperature: float, draw: str) -> None:
    torch.manual_seed(0)
    logits = fixed_logits()
    batch = make_sampling_batch(NUM_DRAWS, temperature=temperature)
    tokens = sampler().sample(logits.expand(NUM_DRAWS, VOCAB).clone(), batch).token_ids
    expected = (logits.double() / temperature).softmax(-1)
    total_variation = 0.5 * float((frequencies(tokens) - expected).abs().sum())
    assert total_variation < 0.02


def test_seeded_rows_follow_the_distribution_too(draw: str) -> None:
    logits = fixed_logits()
    num_rows = 5000
    batch = make_sampling_batch(num_rows, seeds={i: 1000 + i for i in range(num_rows)})
    tokens = sampler().sample(logits.expand(num_rows, VOCAB).clone(), batch).token_ids
    total_variation = 0.5 * float((frequencies(tokens) - logits.double().softmax(-1)).abs().sum())
    assert total_variation < 0.05


def test_top_p_keeps_exactly_the_minimal_nucleus_after_temperature(draw: str) -> None:
    torch.manual_seed(1)
    logits, temperature, top_p = fixed_logits(), 0.7, 0.8
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]  # mass strictly above each token
    nucleus = set(order[mass_before < top_p].tolist())
    batch = make_sampling_batch(NUM_DRAWS, temperature=temperature, top_p=top_p)
    tokens = sampler().sample(logits.expand(NUM_DRAWS, VOCAB).clone(), batch).token_ids
    assert set(tokens.unique().tolist()) == nucleus
    expected = torch.zeros(VOCAB, dtype=torch.float64)
    expected[list(nucleus)] = probs[list(nucleus)] / probs[list(nucleus)].sum()
    assert 0.5 * float((frequencies(tokens) - expected).abs().sum()) < 0.02


def test_min_p_keeps_tokens_at_or_above_the_scaled_threshold(draw: str) -> None:
    torch.manual_seed(2)
    logits, temperature, min_p = fixed_logits(), 1.5, 0.3
    probs = (logits.double() / temperature).softmax(-1)
    kept = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    assert 1 < len(kept) < VOCAB
    batch = make_sampling_batch(NUM_DRAWS, temperature=temperature, min_p=min_p)
    tokens = sampler().sample(logits.expand(NUM_DRAWS, VOCAB).clone(), batch).token_ids
    assert set(tokens.unique().tolist()) == kept


def test_penalties_numerically() -> None:
    penalties = PenaltiesProcessor(PARAMS)
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0] + [0.0] * (VOCAB - 6))
    rep = request((0, 1), repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    additive = request((2,), presence_penalty=1.0, frequency_penalty=0.5)
    penalties.add(4, rep)
    penalties.add(6, additive)
    for token in (3, 3, 4):
        penalties.accept_batch([4, 6], [token, token])
    out = run_chain([penalties], logits.expand(3, VOCAB), [4, 6, 2])
    # repetition over prompt (0, 1) and output (3, 4): x > 0 -> x / 2, else x * 2;
    # presence/frequency over output only: 3 -> -(0.5 + 2 * 0.25), 4 -> -(0.5 + 0.25)
    assert out[0, :6].tolist() == [1.0, -2.0, 0.5, 0.5, -4.75, 1.0]
    # no repetition penalty: prompt token 2 untouched; 3 -> -(1 + 2 * 0.5), 4 -> -(1 + 0.5)
    assert out[1, :6].tolist() == [2.0, -1.0, 0.5, 1.0, -3.5, 1.0]
    assert torch.equal(out[2], logits)  # row 2 never added
    # The row is reused after a preemption: emitted tokens count, the old counts do not.
    penalties.remove(4)
    penalties.add(4, request((5,), output=(2, 2), repetition_penalty=1.5, frequency_penalty=0.1))
    out = run_chain([penalties], logits.unsqueeze(0), [4])
    expected = logits.clone()
    expected[5] = 1.0 / 1.5
    expected[2] = 0.5 / 1.5 - 0.2
    assert torch.allclose(out[0], expected)


def test_logit_bias_adds_to_its_rows_only() -> None:
    bias = LogitBiasProcessor(PARAMS)
    bias.add(1, request(logit_bias={3: 4.0, 0: -100.0}))
    bias.add(5, request(logit_bias={3: -1.5}))
    logits = torch.randn(3, VOCAB)
    out = run_chain([bias], logits, [5, 0, 1])
    expected = logits.clone()
    expected[0, 3] -= 1.5
    expected[2, 3] += 4.0
    expected[2, 0] -= 100.0
    assert torch.equal(out, expected)
    bias.remove(1)
    bias.remove(5)
    assert not bias.is_active
    with pytest.raises(ValueError, match=r"outside the vocabulary.*\[16\]"):
        bias.add(2, request(logit_bias={VOCAB: 1.0}))


def test_min_tokens_masks_stop_ids_then_unmasks() -> None:
    min_tokens = MinTokensProcessor(PARAMS)
    min_tokens.add(0, request(eos=(7,), min_tokens=2, stop_token_ids=(9,)))
    min_tokens.add(1, request(eos=(7,), min_tokens=3, stop_token_ids=(9,), ignore_eos=True))
    min_tokens.add(2, request(eos=(7,), output=(1, 1, 1), min_tokens=3))  # preempted, done
    logits = torch.zeros(3, VOCAB)
    out = run_chain([min_tokens], logits, [0, 1, 2])
    assert torch.isinf(out[0, [7, 9]]).all()
    assert torch.isinf(out[1, 9])
    assert out[1, 7] == 0.0  # ignore_eos: EOS is an ordinary token
    assert torch.isfinite(out[0, :7]).all()
    assert torch.equal(out[2], logits[2])
    min_tokens.accept_batch([0, 1, 2], [3, 3, 3])
    min_tokens.accept_batch([1, 2], [3, 3])  # row 0 not sampled this step
    assert torch.isinf(run_chain([min_tokens], logits, [0, 1, 2])[0, 7])
    min_tokens.accept_batch([0, 1], [4, 4])
    assert not min_tokens.is_active
    assert torch.equal(run_chain([min_tokens], logits, [0, 1, 2]), logits)


def test_min_tokens_through_the_sampler_never_emits_eos_early() -> None:
    chain = sampler()
    chain_processors = chain.logits_processors()
    for processor in chain_processors:
        processor.add(0, request(eos=(0,), min_tokens=3, logit_bias={0: 100.0}))
    emitted = []
    for _ in range(4):
        logits = run_chain(chain_processors, torch.zeros(1, VOCAB), [0])
        token = int(chain.sample(logits, make_sampling_batch(1, temperature=0)).token_ids[0])
        emitted.append(token)
        for processor in chain_processors:
            if processor.needs_tokens:
                processor.accept_batch([0], [token])
    assert 0 not in emitted[:3]
    assert emitted[3] == 0


def test_seeded_output_independent_of_batch_composition(draw: str) -> None:
    torch.manual_seed(3)
    steps = [torch.randn(VOCAB) for _ in range(20)]

    def tokens(num_rows: int, position: int, seed: int, **others: Any) -> list[int]:
        chain = sampler()
        generator = torch.Generator().manual_seed(seed)  # lives as long as the request
        out = []
        for step in steps:
            logits = torch.randn(num_rows, VOCAB) * 2
            logits[position] = step
            batch = make_sampling_batch(num_rows, generators={position: generator}, **others)
            out.append(int(chain.sample(logits, batch).token_ids[position]))
        return out

    alone = tokens(1, 0, seed=42)
    assert tokens(7, 4, seed=42, top_k=[0, 3, 0, 5, 0, 2, 0]) == alone
    assert tokens(3, 2, seed=42, temperature=[0.0, 0.3, 1.0]) == alone
    assert tokens(1, 0, seed=43) != alone


def drawn(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """The draw the sampler takes here (see the ``draw`` fixture), with chosen uniforms."""
    kernel = standard._draw_kernel(logits)
    if kernel is None:
        return standard._draw(logits.clone(), temperature, uniforms).tolist()
    off = torch.zeros(logits.shape[0])  # no top-k, top-p or min-p
    return kernel(logits, temperature, uniforms, off.long(), off + 1.0, off).tolist()


def test_draw_picks_the_token_whose_cumulative_interval_holds_u(draw: str) -> None:
    generator = torch.Generator().manual_seed(4)
    rows, vocab = 64, 5003  # several blocks of the C++ draw and a partial one
    logits = torch.randn(rows, vocab, generator=generator) * 4
    logits[::3, ::2] = float("-inf")  # masked entries between the others
    temperature = torch.rand(rows, generator=generator) * 1.7 + 0.3
    uniforms = torch.rand(rows, generator=generator, dtype=torch.float64)
    probs = (logits.double() / temperature.double().unsqueeze(1)).softmax(-1)
    above = probs.cumsum(-1)  # [rows, vocab]: mass up to and including each token
    for row, token in enumerate(drawn(logits, temperature, uniforms)):
        u = float(uniforms[row])
        assert probs[row, token] > 0
        assert (
            float(above[row, token] - probs[row, token]) - 1e-5
            <= u
            <= float(above[row, token]) + 1e-5
        )


def test_draw_at_the_edges(draw: str) -> None:
    vocab, allowed = 1000, [3, 500, 998]  # one block of the C++ draw and a partial one
    logits = torch.full((6, vocab), float("-inf"))
    logits[:, allowed] = torch.tensor([0.5, 2.0, -1.0])
    logits[4, 17] = float("nan")
    logits[5] = torch.randn(vocab)
    logits[5, [7, 9]] = 10.0  # a tie for the maximum: the first one
    logits[3] = float("-inf")
    temperature = torch.tensor([1.0, 1.0, 0.8, 1.0, 1.0, 0.0])
    below_one = float(
        torch.tensor(1.0, dtype=torch.float64).nextafter(torch.tensor(0.0, dtype=torch.float64))
    )
    uniforms = torch.tensor([0.0, below_one, 0.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    tokens = drawn(logits, temperature, uniforms)
    assert tokens[0] == 3  # u = 0: the first token with any weight
    assert tokens[1] == 998  # u just below 1: the last one, never a masked token after it
    assert tokens[2] in allowed
    assert tokens[3:5] == [-1, -1]  # no distribution: every logit -inf; a NaN
    assert tokens[5] == 7


def kept_distribution(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The filters' semantics in float64: top-k (ties kept), the minimal top-p nucleus of what
    is left, then min-p; the renormalised distribution over what stays."""
    x = logits.double().clone()
    if top_k:
        x[x < x.topk(top_k).values[-1]] = float("-inf")
    if top_p < 1:
        probs = x.softmax(-1)
        order = probs.argsort(descending=True, stable=True)
        before = probs[order].cumsum(0) - probs[order]  # mass strictly above each token
        x[order[before >= top_p]] = float("-inf")
    if min_p:
        probs = x.softmax(-1)
        x[probs < min_p * probs.max()] = float("-inf")
    return x.softmax(-1)


@pytest.mark.parametrize(
    ("shape", "top_k", "top_p", "min_p"),
    [
        ("peaky", 50, 1.0, 0.0),  # fewer than k tokens near the top: the C++ draw widens its cut
        ("peaky", 0, 0.9, 0.0),
        ("long tail", 0, 0.95, 0.0),  # the nucleus reaches far into the tail
        ("peaky", 0, 1.0, 0.05),
        ("long tail", 200, 0.97, 0.0005),
    ],
)
def test_filters_on_a_large_vocabulary(
    shape: str, top_k: int, top_p: float, min_p: float, draw: str
) -> None:
    torch.manual_seed(6)
    vocab, rows = 3001, 4000
    if shape == "peaky":
        logits = torch.randn(vocab) * 8
    else:  # one token well ahead of 3000 that share a sizeable mass far below it
        logits = torch.randn(vocab) * 0.05 + 10.0
        logits[1234] = 20.0
    expected = kept_distribution(logits, top_k, top_p, min_p)
    batch = make_sampling_batch(rows, top_k=top_k, top_p=top_p, min_p=min_p)
    tokens = sampler().sample(logits.expand(rows, vocab).clone(), batch).token_ids
    drawn = torch.bincount(tokens, minlength=vocab).double() / rows
    assert set(tokens.unique().tolist()) <= set(expected.nonzero().flatten().tolist())
    likeliest = expected.topk(5).indices
    assert (drawn[likeliest] - expected[likeliest]).abs().max() < 0.03


def test_processors_stay_inactive_for_plain_requests() -> None:
    chain = sampler()
    plain = request(eos=(3,), temperature=0.7, top_p=0.9, seed=5, stop_token_ids=(4,))
    for row, processor in enumerate(chain.logits_processors()):
        processor.add(row, plain)
        assert not processor.is_active, type(processor).__name__
    penalised = request(presence_penalty=0.1)
    penalties = next(p for p in chain.logits_processors() if isinstance(p, PenaltiesProcessor))
    penalties.add(7, penalised)
    assert penalties.is_active
    penalties.remove(7)
    assert not penalties.is_active


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_the_portable_draw_conforms() -> None:
    check_sampler(StandardSampler, StandardSamplerOptions(), device="cuda")


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_the_draw_at_the_edges() -> None:
    logits = torch.full((4, 1000), float("-inf"))
    logits[:, [3, 500, 998]] = torch.tensor([0.5, 2.0, -1.0])
    logits[2, 17] = float("nan")
    logits[3] = float("-inf")
    temperature = torch.tensor([1.0, 1.0, 1.0, 1.0])
    uniforms = torch.tensor([0.0, 1.0 - 2**-53, 0.5, 0.5], dtype=torch.float64)
    tokens = standard._draw(logits.cuda(), temperature.cuda(), uniforms.cuda())
    assert tokens.device.type == "cuda"
    assert tokens.tolist() == [3, 998, -1, -1]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p"), [(50, 1.0, 0.0), (0, 0.9, 0.05), (200, 0.97, 0.0)]
)
def test_on_cuda_the_filters_keep_what_they_should(top_k: int, top_p: float, min_p: float) -> None:
    torch.manual_seed(6)
    vocab, rows = 3001, 4000
    logits = torch.randn(vocab) * 8
    expected = kept_distribution(logits, top_k, top_p, min_p)
    params = SamplerParams(max_num_seqs=rows, vocab_size=vocab, device="cuda")
    batch = make_sampling_batch(rows, top_k=top_k, top_p=top_p, min_p=min_p, device="cuda")
    on_gpu = logits.cuda().expand(rows, vocab).clone()
    tokens = StandardSampler(params, StandardSamplerOptions()).sample(on_gpu, batch).token_ids
    drawn = torch.bincount(tokens.cpu(), minlength=vocab).double() / rows
    assert set(tokens.unique().tolist()) <= set(expected.nonzero().flatten().tolist())
    likeliest = expected.topk(5).indices
    assert (drawn[likeliest] - expected[likeliest]).abs().max() < 0.03
