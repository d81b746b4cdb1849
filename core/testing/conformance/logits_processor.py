"""Conformance of a logits processor on its own, driven through the lifecycle core gives it.

:func:`check_logits_processor` builds a processor as ``factory(SamplerParams(...), options)``
and checks what core relies on: ``apply`` keeps the logits' shape, dtype and device and
produces no NaN; rows never added, or removed since, are left bit-for-bit untouched; a row is
keyed by its persistent row, not its position in the step's logits; a reused row starts
fresh; ``is_active`` is False with no rows; two instances fed the same lifecycle give the
same logits; a request added again after a preemption, with its emitted tokens in
``output_token_ids``, is edited as if it had never left; a request the stage calls position
independent is edited the same after more tokens, and a stage that rolls back restores its
edits exactly (speculative decoding). :func:`check_sampler` runs the same
lifecycle over every stage of a sampler's chain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from brigade.interfaces import LogitsProcessor, Request, SamplerParams, SamplingParams

if TYPE_CHECKING:
    from brigade.interfaces import Checkpoint

__all__ = ["check_logits_processor", "feature_requests", "run_processor_lifecycle"]

_ADDED_ROWS = (3, 0, 7, 12, 5)
_NEVER_ADDED = (1, 9)
_STEP_ROWS = (9, 7, 0, 1, 3, 12, 5)
"""Persistent rows sampled each step: unsorted, with gaps and never-added rows."""
_NUM_STEPS = 4


def feature_requests(vocab_size: int) -> list[Request]:
    """Requests that exercise every built-in stage (EOS is ``vocab_size - 2``); a plain one
    last."""
    prompt = [1, 2, 3, 2, 5]
    features = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
        SamplingParams(logit_bias={0: 5.0, vocab_size - 1: -5.0}),
        SamplingParams(min_tokens=3, stop_token_ids=(4,)),
        SamplingParams(repetition_penalty=0.8, min_tokens=2, logit_bias={2: 1.0}),
        SamplingParams(),
    ]
    return [
        Request(f"conformance-{i}", list(prompt), sp, eos_token_ids=frozenset({vocab_size - 2}))
        for i, sp in enumerate(features)
    ]


def check_logits_processor(
    factory: Callable[[SamplerParams, Any], LogitsProcessor],
    options: Any,
    *,
    vocab_size: int = 64,
    device: str = "cpu",
    checkpoint: Checkpoint | None = None,
    requests: Sequence[Request] | None = None,
) -> None:
    """Check a logits processor built as ``factory(SamplerParams(...), options)``.

    ``checkpoint`` reaches the processor as ``params.checkpoint`` (for one that reads the
    tokenizer). ``requests`` (five at most, default :func:`feature_requests`) should include
    ones your processor acts on; each is copied, never modified.
    """
    params = SamplerParams(
        max_num_seqs=16,
        vocab_size=vocab_size,
        device=device,
        eos_token_ids=(vocab_size - 2,),
        checkpoint=checkpoint,
    )
    processor = factory(params, options)
    name = type(processor).__name__
    assert isinstance(processor, LogitsProcessor), f"{name} is not a LogitsProcessor"
    requests = list(feature_requests(vocab_size) if requests is None else requests)
    if not 1 <= len(requests) <= len(_ADDED_ROWS):
        raise ValueError(f"check_logits_processor takes 1 to 5 requests, got {len(requests)}")
    generator = torch.Generator().manual_seed(0)

    def random_logits(num_rows: int) -> torch.Tensor:
        return torch.randn(num_rows, vocab_size, generator=generator).mul_(3).to(device)

    first = run_processor_lifecycle(processor, params, random_logits, requests)
    generator.manual_seed(0)
    again = run_processor_lifecycle(factory(params, options), params, random_logits, requests)
    for step, (one, other) in enumerate(zip(first, again, strict=True)):
        assert torch.equal(one, other), f"{name}: step {step} differs between two instances"
    _check_readd_after_preemption(factory, options, params, random_logits, requests)
    _check_speculation(factory, options, params, random_logits, requests)


def run_processor_lifecycle(
    processor: LogitsProcessor,
    params: SamplerParams,
    random_logits: Callable[[int], torch.Tensor],
    requests: Sequence[Request] | None = None,
) -> list[torch.Tensor]:
    """Add, step, remove and re-add rows as core would, checking each step; the logits each
    step produced (for comparing two instances)."""
    name = type(processor).__name__
    assert not processor.is_active, f"{name}: active before any request was added"
    requests = [_copy(r) for r in (requests or feature_requests(params.vocab_size))]
    added = list(_ADDED_ROWS[: len(requests)])
    for row, request in zip(added, requests, strict=True):
        processor.add(row, request)
    reused = added[-1]
    processor.remove(reused)
    requests[-1] = _copy(requests[-1])
    processor.add(reused, requests[-1])  # a reused row starts fresh
    by_row = dict(zip(added, requests, strict=True))
    rows = torch.tensor(_STEP_ROWS, device=params.device)
    results = []
    for step in range(_NUM_STEPS):
        logits = random_logits(rows.numel())
        edited = _step(processor, logits, rows)
        results.append(edited)
        for index, row in enumerate(rows.tolist()):
            if row not in by_row:
                assert torch.equal(edited[index], logits[index]), (
                    f"{name}: row {row} was never added but apply edited it"
                )
        # Rows are keyed by persistent row, not by position in the step's logits.
        flipped = _step(processor, logits.flip(0), rows.flip(0))
        assert torch.equal(flipped.flip(0), edited), (
            f"{name}: the result depends on the order of the rows"
        )
        tokens = [(step * 5 + row) % 4 + 1 for row in rows.tolist()]
        _accept(processor, rows.tolist(), tokens, by_row)
    # A removed row is forgotten: it is left untouched while the remaining rows are edited.
    removed = added[:-2]
    for row in removed:
        processor.remove(row)
    logits = random_logits(rows.numel())
    edited = _step(processor, logits, rows)
    for index, row in enumerate(rows.tolist()):
        if row not in by_row or row in removed:
            assert torch.equal(edited[index], logits[index]), f"{name}: removed row {row} edited"
    for row in added[-2:]:
        processor.remove(row)
    assert not processor.is_active, f"{name}: still active after every row was removed"
    return results


def _check_readd_after_preemption(
    factory: Callable[[SamplerParams, Any], LogitsProcessor],
    options: Any,
    params: SamplerParams,
    random_logits: Callable[[int], torch.Tensor],
    requests: Sequence[Request],
) -> None:
    """A request preempted and added again (row 6, its tokens emitted) is edited like one
    that never left (row 2 of another instance)."""
    kept, preempted = factory(params, options), factory(params, options)
    name = type(kept).__name__
    for request in requests:
        staying, leaving = _copy(request), _copy(request)
        kept.add(2, staying)
        preempted.add(2, leaving)
        for step in range(_NUM_STEPS):
            logits = random_logits(1)
            rows = torch.tensor([2], device=params.device)
            _step(kept, logits, rows)
            _step(preempted, logits, rows)
            token = (step * 3 + 1) % 5
            _accept(kept, [2], [token], {2: staying})
            _accept(preempted, [2], [token], {2: leaving})
        preempted.remove(2)
        preempted.add(6, leaving)
        logits = random_logits(1)
        before = _step(kept, logits, torch.tensor([2], device=params.device))
        after = _step(preempted, logits, torch.tensor([6], device=params.device))
        assert torch.equal(before, after), (
            f"{name}: request {request.request_id} added again after a preemption (with "
            f"{leaving.num_output_tokens} output tokens) is edited differently than before"
        )
        kept.remove(2)
        preempted.remove(6)


def _check_speculation(
    factory: Callable[[SamplerParams, Any], LogitsProcessor],
    options: Any,
    params: SamplerParams,
    random_logits: Callable[[int], torch.Tensor],
    requests: Sequence[Request],
) -> None:
    """What speculative decoding relies on (API 2.4): a request the stage calls position
    independent is edited the same after more tokens; and, if the stage can roll back,
    accepting tokens one by one then rolling them back restores its edits exactly."""
    name = type(factory(params, options)).__name__
    can_roll_back = type(factory(params, options)).rollback is not LogitsProcessor.rollback
    rows = torch.tensor([2], device=params.device)
    for request in requests:
        processor = factory(params, options)
        request = _copy(request)
        processor.add(2, request)
        _accept(processor, [2], [3], {2: request})
        logits = random_logits(1)
        before = _step(processor, logits, rows)
        independent = processor.is_position_independent(request)
        drafts = [4, 1, 2]
        for token in drafts:
            _accept(processor, [2], [token], {2: request})
        after = _step(processor, logits, rows)
        if independent:
            assert torch.equal(before, after), (
                f"{name}: is_position_independent is True for request {request.request_id}, "
                "but its row is edited differently after more tokens"
            )
        if can_roll_back:
            processor.rollback(2, len(drafts))
            del request.output_token_ids[-len(drafts) :]
            restored = _step(processor, logits, rows)
            assert torch.equal(before, restored), (
                f"{name}: accepting {len(drafts)} tokens then rolling them back changed how "
                f"request {request.request_id} is edited"
            )
        processor.remove(2)


def _step(processor: LogitsProcessor, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``begin_step`` and ``apply`` on a copy of ``logits``, as core calls them."""
    name = type(processor).__name__
    if not processor.is_active:
        return logits.clone()
    processor.begin_step(rows.tolist())
    result = processor.apply(logits.clone(), rows)
    assert result.shape == logits.shape, f"{name}: apply returned shape {tuple(result.shape)}"
    assert result.dtype == torch.float32, f"{name}: apply returned dtype {result.dtype}"
    assert result.device == logits.device, f"{name}: apply returned device {result.device}"
    assert not bool(torch.isnan(result).any()), f"{name}: apply produced NaN"
    return result


def _accept(
    processor: LogitsProcessor,
    rows: list[int],
    tokens: list[int],
    requests: dict[int, Request],
) -> None:
    """What core does with a step's tokens: append them to the requests, then tell the stage."""
    for row, token in zip(rows, tokens, strict=True):
        if row in requests:
            requests[row].output_token_ids.append(token)
    if processor.needs_tokens:
        processor.accept_batch(rows, tokens)


def _copy(request: Request) -> Request:
    """A fresh request with the same id, prompt, parameters and emitted tokens."""
    return Request(
        request.request_id,
        list(request.prompt_token_ids),
        request.sampling_params,
        eos_token_ids=request.eos_token_ids,
        output_token_ids=list(request.output_token_ids),
        priority=request.priority,
    )
