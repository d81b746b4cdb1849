"""The ``plain-torch`` sampler: greedy, temperature, top-k, top-p, min-p and seeds in torch.

Every row is handled by whole-batch torch operations; the only Python loop is over the rows
that carry their own seed (one uniform draw each). A token is drawn by inverse transform: one
uniform ``u`` per row picks the first token whose cumulative probability exceeds ``u``, so a
seeded row draws one number from its own generator per step and its tokens do not depend on
what else is batched.

Cost: greedy is one ``max`` over the vocabulary; sampling adds a softmax and a cumulative
sum. Top-k and top-p sort each row's logits, the price of plain torch (Brigade's built-in
sampler filters without sorting in C++).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from brigade.interfaces import (
    LogitsProcessor,
    NoOptions,
    SampleOutput,
    Sampler,
    SamplerParams,
    SamplingBatch,
)

from brigade_example_stations.request_stages import BiasAndPenalties, MinTokensMask

__all__ = ["PlainTorchSampler"]

_MIN_TEMPERATURE = 1e-6
"""Positive temperatures are clamped here so ``logits / T`` stays finite in float32."""


class PlainTorchSampler(Sampler):
    """Samples after the chain: the request's bias and penalties, the configured processors,
    then ``min_tokens`` (the order ``Sampler.logits_processors`` asks for)."""

    def __init__(self, params: SamplerParams, options: NoOptions) -> None:
        self.params = params
        self.options = options
        self._chain: tuple[LogitsProcessor, ...] = (
            BiasAndPenalties(params),
            *params.logits_processors,
            MinTokensMask(params),
        )

    def logits_processors(self) -> Sequence[LogitsProcessor]:
        """Bias and penalties, the configured processors in config order, min_tokens."""
        return self._chain

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """One token per row of ``logits`` [S, vocab]; -1 for a row with no distribution."""
        all_logprobs = logits.log_softmax(dim=-1) if batch.max_num_logprobs is not None else None
        greedy_ids = _first_maximum(logits)  # [S]
        if batch.all_greedy:
            token_ids = greedy_ids
        else:
            drawn = _draw(_filter(logits, batch), batch.generators)  # [S]
            token_ids = torch.where(batch.temperature == 0, greedy_ids, drawn)
        if all_logprobs is None or batch.max_num_logprobs is None:
            return SampleOutput(token_ids)
        top_logprobs, top_ids = all_logprobs.topk(batch.max_num_logprobs, dim=-1)  # [S, N]
        sampled = token_ids.unsqueeze(1)  # [S, 1]
        picked = all_logprobs.gather(1, sampled.clamp_min(0))  # [S, 1]; -1 rows fail in core
        logprobs = torch.cat([picked, top_logprobs], dim=1)  # [S, 1 + N]
        return SampleOutput(token_ids, logprobs, torch.cat([sampled, top_ids], dim=1))


def _first_maximum(logits: torch.Tensor) -> torch.Tensor:
    """[S] index of each row's first maximum; -1 where there is none (NaN, all -inf)."""
    best = logits.max(dim=-1)  # a NaN propagates to the maximum
    undefined = best.values.isnan() | best.values.isneginf()  # [S]
    return best.indices.masked_fill(undefined, -1)


def _filter(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Tempered logits [S, vocab] with every token outside top-k, top-p and min-p at -inf.

    Greedy rows are left at temperature 1 (their token is the argmax anyway).
    """
    temperature = torch.where(batch.temperature == 0, 1.0, batch.temperature)  # [S]
    logits = logits / temperature.clamp_min(_MIN_TEMPERATURE).unsqueeze(1)
    if batch.any_top_k or batch.any_top_p:
        # sorted_logits: [S, vocab] descending; order maps sorted positions to token ids.
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab_size = logits.shape[-1]
        if batch.any_top_k:
            top_k = batch.top_k.masked_fill(batch.top_k <= 0, vocab_size).clamp_max(vocab_size)
            kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))  # [S, 1]
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if batch.any_top_p:
            probs = sorted_logits.softmax(dim=-1)  # [S, vocab], renormalised after top-k
            above = probs.cumsum(dim=-1) - probs  # [S, vocab] mass of the tokens before each
            # The nucleus is the shortest head reaching p: a token whose predecessors already
            # reach p is outside it (the first token never is).
            outside = above >= batch.top_p.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if batch.any_min_p:
        # p_i >= min_p * p_max  <=>  logit_i >= max logit + log(min_p): no softmax needed.
        floor = logits.amax(dim=-1, keepdim=True) + batch.min_p.log().unsqueeze(1)  # [S, 1]
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


def _draw(logits: torch.Tensor, generators: Mapping[int, torch.Generator]) -> torch.Tensor:
    """[S] tokens drawn from ``softmax(logits)`` by inverse transform; -1 for a row without
    a distribution."""
    num_rows = logits.shape[0]
    uniforms = torch.rand(num_rows, dtype=torch.float64, device=logits.device)  # [S]
    for index, generator in generators.items():
        uniforms[index] = torch.rand(
            (), dtype=torch.float64, generator=generator, device=logits.device
        )
    cumulative = logits.softmax(dim=-1).cumsum(dim=-1)  # [S, vocab]
    total = cumulative[:, -1:]  # [S, 1], ~1; NaN for a row without a distribution
    target = uniforms.to(cumulative.dtype).unsqueeze(1) * total  # [S, 1]
    # Strictly below the total, so the search stops at the last token with any weight.
    target = torch.minimum(target, total.nextafter(torch.zeros_like(total)))
    drawn = torch.searchsorted(cumulative, target, right=True).squeeze(1)  # [S]
    drawn = drawn.clamp_max(logits.shape[-1] - 1)
    return drawn.masked_fill(total.squeeze(1).isnan(), -1)
