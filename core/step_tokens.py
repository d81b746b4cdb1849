"""What a step's sampled tokens become, for ``EngineCore``: each speculating request's verdict
on its drafts, the tokens written to the persistent batch and given to the logits processors,
and the scheduler's plan trimmed to what the step really computed."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

from brigade.grammar import GrammarManager
from brigade.interfaces import Request, SchedulerOutput
from brigade.persistent_batch import PersistentBatch, StepPlan
from brigade.sampling_stage import SampledTokens, SamplingStage, TokenLogprob
from brigade.speculative import Speculation, Verified, verify

__all__ = ["accepted_plan", "asked", "held_back", "record_tokens", "verify_drafts", "without"]


def verify_drafts(
    plan: StepPlan, sampled: SampledTokens
) -> tuple[
    list[list[int]],
    list[list[TokenLogprob | None]] | None,
    dict[int, str],
    list[Verified],
]:
    """Per sampled request of a step with drafts: the tokens it emits (accepted drafts, then
    the next sampled one), their logprobs, why it failed (its emitted position failed) and the
    verdict."""
    tokens: list[list[int]] = []
    logprobs: list[list[TokenLogprob | None]] | None = None if sampled.logprobs is None else []
    failures: dict[int, str] = {}
    verified: list[Verified] = []
    for index, (request, num_drafts, offset) in enumerate(
        zip(plan.sampled, plan.draft_counts, plan.logits_offsets, strict=True)
    ):
        samples = sampled.token_ids[offset : offset + 1 + num_drafts]
        checked = request.draft_token_ids[:num_drafts] if sampled.drafts_checked else []
        verdict = verify(samples, checked)
        last = offset + verdict.num_accepted  # a failed row never equals a draft
        if last in sampled.failures:
            failures[index] = sampled.failures[last]
        tokens.append(verdict.token_ids)
        if logprobs is not None:
            assert sampled.logprobs is not None
            logprobs.append(sampled.logprobs[offset : last + 1])
        verified.append(verdict)
    return tokens, logprobs, failures, verified


def record_tokens(
    batch: PersistentBatch,
    sampling: SamplingStage,
    grammar: GrammarManager | None,
    requests: Sequence[Request],
    rows: list[int],
    tokens: list[list[int]],
) -> tuple[dict[int, str], dict[int, int]]:
    """Write the step's tokens to the batch and give them to the logits processors.

    Returns the index of each request a processor failed for -> why, and the index of each
    request whose grammar completed -> after how many of its tokens (nothing but a stop
    token could follow them: the rest are dropped). With one token per request the grammar
    takes them off the step thread: a grammar that completed shows in the next step
    (``GrammarManager.take_ended``).
    """
    if all(len(new) == 1 for new in tokens):
        firsts = [new[0] for new in tokens]
        batch.append_tokens(rows, [request.num_tokens for request in requests], firsts)
        return sampling.accept(rows, firsts, one_per_row=True), {}
    flat_rows: list[int] = []
    positions: list[int] = []
    flat_tokens: list[int] = []
    for row, request, new in zip(rows, requests, tokens, strict=True):
        flat_rows.extend([row] * len(new))
        positions.extend(range(request.num_tokens, request.num_tokens + len(new)))
        flat_tokens.extend(new)
    batch.append_tokens(flat_rows, positions, flat_tokens)
    rejected: dict[int, str] = {}
    complete: dict[int, int] = {}
    for position in range(max(map(len, tokens))):  # one batch call per position
        indices = [
            i
            for i, new in enumerate(tokens)
            if len(new) > position and i not in rejected and i not in complete
        ]
        if not indices:
            break
        failures = sampling.accept(
            [rows[i] for i in indices], [tokens[i][position] for i in indices]
        )
        for subset_index, error in failures.items():
            rejected.setdefault(indices[subset_index], error)
        if grammar is not None:
            done = sampling.finished_rows(grammar)
            complete.update((i, position + 1) for i in indices if rows[i] in done)
    return rejected, complete


def accepted_plan(
    speculation: Speculation,
    output: SchedulerOutput,
    requests: Sequence[Request],
    verified: list[Verified],
    failed: Mapping[Request, str],
) -> SchedulerOutput:
    """Tell the speculation station what was accepted; the step's plan with each speculating
    request computing only its accepted drafts (the rest of its KV is rewritten by later
    steps)."""
    accepted: dict[int, int] = {}
    for request, verdict in zip(requests, verified, strict=True):
        if verdict.num_drafts and request not in failed:
            speculation.observe(request, verdict)
            accepted[id(request)] = verdict.num_accepted
    scheduled = tuple(
        dataclasses.replace(
            item,
            num_new_tokens=1 + accepted.get(id(item.request), 0),
            num_draft_tokens=accepted.get(id(item.request), 0),
        )
        if item.num_draft_tokens
        else item
        for item in output.scheduled
    )
    return dataclasses.replace(output, scheduled=scheduled)


def asked(logprobs: list[TokenLogprob | None]) -> list[TokenLogprob] | None:
    """A request's logprobs for its new tokens; None when it did not ask for them."""
    if logprobs[0] is None:
        return None
    return logprobs  # type: ignore[return-value]  # a request asks for all or none


def without(output: SchedulerOutput, requests: Collection[Request]) -> SchedulerOutput:
    """``output`` less the entries of ``requests`` (which failed in this step)."""
    kept = tuple(item for item in output.scheduled if item.request not in requests)
    return dataclasses.replace(output, scheduled=kept)


def held_back(output: SchedulerOutput, requests: Collection[Request]) -> SchedulerOutput:
    """``output`` with each of ``requests`` computing one token fewer: its last token's
    logits were not sampled (its grammar's mask was late), so that token is computed again
    next step (the same KV entry, rewritten) and sampled then."""
    held = set(map(id, requests))
    scheduled = tuple(
        dataclasses.replace(item, num_new_tokens=item.num_new_tokens - 1, num_draft_tokens=0)
        if id(item.request) in held
        else item
        for item in output.scheduled
    )
    return dataclasses.replace(output, scheduled=scheduled)
