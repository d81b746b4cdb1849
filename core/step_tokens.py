"""Helpers of ``StepOutputProcessor`` (``brigade.step_output``): the step's tokens written to
the persistent batch and given to the logits processors, and the scheduler's plan trimmed to
what the step really computed."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from brigade.grammar import GrammarManager
from brigade.interfaces import Request, SchedulerOutput
from brigade.persistent_batch import PersistentBatch
from brigade.sampling_stage import SamplingStage, TokenLogprob

__all__ = ["asked", "held_back", "record_tokens", "without"]


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
