"""A sampler's logits-processor chain against each request's sampling fields.

A request's ``logit_bias``, penalties and ``min_tokens`` reach no one but the stages of the
sampler's chain (``Sampler.logits_processors``), and the configured processors reach the
sampler as ``SamplerParams.logits_processors`` for it to place there. :func:`check_chain`
drives the chain and the sampler as core does (``add``, ``begin_step``, ``apply``,
``sample``, ``accept_batch``) with greedy requests whose tokens each field changes, and
compares them with a reference of the documented semantics, so that a sampler that drops a
field fails with the field's name. Two probe processors, configured the way core configures
any, check that the sampler applies them, in config order, after the request's own bias and
penalties and before ``min_tokens`` and any grammar mask.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import torch

from brigade.interfaces import LogitsProcessor, Request, Sampler, SamplerParams, SamplingParams
from brigade.testing.conformance.sampler_batch import make_sampling_batch

__all__ = ["check_chain"]

_NUM_STEPS = 4
_LIFTED_LOGIT = 10.0
"""What the probe writes over the stop token's logit (above every other logit)."""


class _Probe(LogitsProcessor):
    """A configured processor that records what it sees and, for probe requests, edits it.

    ``probe-ban`` rows get their top token masked, ``probe-lift`` rows their top token set to
    :data:`_LIFTED_LOGIT`; every row's first logits are recorded.
    """

    needs_tokens = False

    def __init__(self, top_token: int) -> None:
        self.top_token = top_token
        self.requests: dict[int, str] = {}
        self.seen: dict[str, torch.Tensor] = {}
        """Request id -> the first logits row this stage received for it."""

    def add(self, row: int, request: Request) -> None:
        if request.request_id.startswith("probe-"):
            self.requests[row] = request.request_id

    def remove(self, row: int) -> None:
        self.requests.pop(row, None)

    @property
    def is_active(self) -> bool:
        return bool(self.requests)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        for index, row in enumerate(rows.tolist()):
            request_id = self.requests.get(row)
            if request_id is None:
                continue
            self.seen.setdefault(request_id, logits[index].detach().cpu().clone())
            if request_id == "probe-ban":
                logits[index, self.top_token] = float("-inf")
            elif request_id == "probe-lift":
                logits[index, self.top_token] = _LIFTED_LOGIT
        return logits


def check_chain(
    factory: Callable[[SamplerParams, Any], Sampler], options: Any, vocab_size: int, device: str
) -> None:
    """Check that the sampler built by ``factory`` honours every field its chain owns."""
    generator = torch.Generator().manual_seed(1)
    order = torch.randperm(vocab_size, generator=generator)
    top = order[:8].tolist()
    """The eight best tokens, best first; every other token sits far below them."""
    base = torch.full((vocab_size,), -3.0)
    base[order[:8]] = torch.arange(8) * -0.25 + 3.0  # 3.0, 2.75, ..., 1.25
    acting, passive = _Probe(top[0]), _Probe(top[0])
    params = SamplerParams(
        max_num_seqs=64, vocab_size=vocab_size, device=device, logits_processors=(acting, passive)
    )
    sampler = factory(params, options)
    chain = list(sampler.logits_processors())
    _check_placement(chain, [acting, passive])

    prompt, eos = [top[0], top[1]], frozenset({top[0]})
    cases: list[tuple[str, SamplingParams]] = [
        ("logit_bias", SamplingParams(logit_bias={top[0]: -1.0})),
        ("logit_bias", SamplingParams(logit_bias={top[6]: 2.0})),
        ("presence_penalty", SamplingParams(presence_penalty=1.0)),
        ("frequency_penalty", SamplingParams(frequency_penalty=0.4)),
        ("repetition_penalty", SamplingParams(repetition_penalty=2.0)),
        ("min_tokens", SamplingParams(min_tokens=3, stop_token_ids=(top[1],))),
        ("plain", SamplingParams()),
    ]
    probes: list[tuple[str, SamplingParams]] = [
        ("probe-ban", SamplingParams(logit_bias={top[0]: 50.0})),
        ("probe-lift", SamplingParams(min_tokens=3)),
        ("probe-order", SamplingParams(logit_bias={top[5]: 0.6}, repetition_penalty=2.0)),
    ]
    requests = [
        Request(request_id, list(prompt), sampling, eos_token_ids=eos)
        for request_id, sampling in [*cases, *probes]
    ]
    rows = [2 * index + 5 for index in range(len(requests))][::-1]  # gaps, descending
    tokens = _run(sampler, chain, requests, rows, base, device)

    _check_fields(cases, requests, tokens, base)
    probe_tokens = dict(zip([name for name, _ in probes], tokens[len(cases) :], strict=True))
    _check_probes(probe_tokens, acting, base, top)


def _check_fields(
    cases: Sequence[tuple[str, SamplingParams]],
    requests: Sequence[Request],
    tokens: Sequence[list[int]],
    base: torch.Tensor,
) -> None:
    """Each field's request sampled what the reference samples, which differs from what the
    last case, the plain request, samples (so the case tests its field)."""
    plain = _reference(base, requests[len(cases) - 1])
    for (field, sampling), request, got in zip(cases, requests, tokens, strict=False):
        expected = _reference(base, request)
        if field != "plain" and expected == plain:
            raise AssertionError(f"conformance kit: the {field} case does not change the tokens")
        value = _describe(field, sampling)
        assert got == expected, (
            f"{field}: a greedy request with {value} sampled {got}, expected {expected}"
            + (" (the field was ignored)" if got == plain and field != "plain" else "")
        )


def _check_probes(
    probe_tokens: dict[str, list[int]], acting: _Probe, base: torch.Tensor, top: list[int]
) -> None:
    """The configured processors' edits (``acting``'s) took effect, before ``min_tokens``'
    mask, and they saw the logits with the request's own bias and penalties applied."""
    assert top[0] not in probe_tokens["probe-ban"], (
        f"logits_processors: a configured processor (SamplerParams.logits_processors) bans token "
        f"{top[0]} for a request, yet the sampler emitted it: {probe_tokens['probe-ban']}"
    )
    assert top[0] not in probe_tokens["probe-lift"][:3], (
        f"min_tokens: a configured processor set stop token {top[0]}'s logit to "
        f"{_LIFTED_LOGIT} and it was emitted before min_tokens=3 "
        f"({probe_tokens['probe-lift']}); mask the stop tokens after the configured processors"
    )
    seen = acting.seen["probe-order"].double()
    expected_bias = float(base[top[5]]) + 0.6
    expected_penalised = float(base[top[0]]) / 2.0
    assert abs(float(seen[top[5]]) - expected_bias) < 1e-5, (
        f"logits_processors: configured processors must see the logits after the request's "
        f"logit_bias; token {top[5]} with bias 0.6 reached them as {float(seen[top[5]]):.4f}, "
        f"expected {expected_bias:.4f}"
    )
    assert abs(float(seen[top[0]]) - expected_penalised) < 1e-5, (
        f"logits_processors: configured processors must see the logits after the request's "
        f"penalties; prompt token {top[0]} with repetition_penalty=2.0 reached them as "
        f"{float(seen[top[0]]):.4f}, expected {expected_penalised:.4f}"
    )


def _check_placement(
    chain: Sequence[LogitsProcessor], configured: Sequence[LogitsProcessor]
) -> None:
    positions = []
    for index, processor in enumerate(configured):
        found = [i for i, stage in enumerate(chain) if stage is processor]
        assert len(found) == 1, (
            f"logits_processors: configured processor {index} (SamplerParams.logits_processors) "
            f"appears {len(found)} times in the sampler's logits_processors(), expected once"
        )
        positions.append(found[0])
    assert positions == sorted(positions), (
        "logits_processors: the sampler's chain does not keep the configured processors in "
        "config order"
    )


def _run(
    sampler: Sampler,
    chain: Sequence[LogitsProcessor],
    requests: Sequence[Request],
    rows: Sequence[int],
    base: torch.Tensor,
    device: str,
) -> list[list[int]]:
    """Greedy tokens of each request over the steps, every step batched as core does."""
    for row, request in zip(rows, requests, strict=True):
        for processor in chain:
            processor.add(row, request)
    row_list = list(rows)
    row_tensor = torch.tensor(row_list, device=device)
    batch = make_sampling_batch(len(row_list), temperature=0.0, rows=row_list, device=device)
    for _ in range(_NUM_STEPS):
        logits = base.expand(len(row_list), -1).clone().to(device)  # [S, vocab]
        active = [processor for processor in chain if processor.is_active]
        for processor in active:
            processor.begin_step(row_list)
        for processor in active:
            logits = processor.apply(logits, row_tensor)
        step_tokens = sampler.sample(logits, batch).token_ids.tolist()
        for request, token in zip(requests, step_tokens, strict=True):
            request.output_token_ids.append(token)
        for processor in chain:
            if processor.needs_tokens:
                processor.accept_batch(row_list, step_tokens)
    for row in row_list:
        for processor in chain:
            processor.remove(row)
    return [list(request.output_token_ids) for request in requests]


def _reference(base: torch.Tensor, request: Request) -> list[int]:
    """The documented semantics, one request alone: logit_bias, repetition penalty (prompt
    and output), presence and frequency penalties (output), min_tokens, then the argmax."""
    params = request.sampling_params
    output: list[int] = []
    for _ in range(_NUM_STEPS):
        logits = base.double().clone()
        for token, bias in (params.logit_bias or {}).items():
            logits[token] += bias
        for token in set(request.prompt_token_ids) | set(output):
            value = float(logits[token])
            r = params.repetition_penalty
            logits[token] = value / r if value > 0 else value * r
        for token, count in collections.Counter(output).items():
            logits[token] -= params.presence_penalty + params.frequency_penalty * count
        if len(output) < params.min_tokens:
            stops = set(params.stop_token_ids)
            if not params.ignore_eos:
                stops |= request.eos_token_ids
            logits[sorted(stops)] = float("-inf")
        output.append(int(logits.argmax()))
    return output


def _describe(field: str, sampling: SamplingParams) -> str:
    if field == "plain":
        return "no penalties, bias or min_tokens"
    if field == "min_tokens":
        return f"min_tokens={sampling.min_tokens} (stop ids and EOS masked until then)"
    return f"{field}={getattr(sampling, field)!r}"
