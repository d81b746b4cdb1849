"""The step's seams on requests alone: the persistent batch lays out each kind of request,
speculation verifies drafts and trims the scheduler's plan, the pooler collects vectors, and
the step output processor turns sampled tokens into updates, finished and failed requests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from brigade.interfaces import (
    KVPoolParams,
    NoOptions,
    PoolingParams,
    Proposer,
    ProposerParams,
    Request,
    RequestStatus,
    ScheduledRequest,
    SchedulerOutput,
)
from brigade.options import build_options
from brigade.persistent_batch import PersistentBatch, StepPlan
from brigade.plugins.kv.paged import PagedKVManager, PagedKVOptions
from brigade.pooling import PooledChunk, Pooler
from brigade.sampling_stage import SampledTokens
from brigade.speculative import Speculation
from brigade.stations import SpeculativeSettings
from brigade.step_output import StepOutputProcessor, StepUpdate
from brigade.testing.requests import make_request

PAGE = 4
STOP = 3


class NoDrafts(Proposer):
    def propose(self, slots: Sequence[object]) -> list[list[int]]:
        return [[] for _ in slots]


def speculation() -> Speculation:
    params = ProposerParams(
        num_speculative_tokens=4, vocab_size=100, max_num_seqs=8, max_model_len=64
    )
    settings = build_options(SpeculativeSettings, {}, "[speculative]")
    return Speculation(
        NoDrafts(params, NoOptions()),
        "none",
        settings,
        vocab_size=100,
        max_model_len=64,
        processors=(),
    )


def decoding(request_id: str, drafts: Sequence[int] = (), **sampling: object) -> Request:
    request = make_request(request_id, [1, 2, 4, 5, 6], max_tokens=8, **sampling)
    request.output_token_ids.append(9)
    request.num_computed_tokens = 5  # its last token (9) is the decode
    request.status = RequestStatus.RUNNING
    request.draft_token_ids = list(drafts)
    return request


def lay_out(
    scheduled: Sequence[ScheduledRequest],
) -> tuple[PersistentBatch, StepPlan]:
    kv = PagedKVManager(KVPoolParams(32, PAGE, enable_prefix_caching=False), PagedKVOptions())
    batch = PersistentBatch(max_num_seqs=8, max_model_len=64, page_size=PAGE, max_num_tokens=64)
    for item in scheduled:
        assert kv.allocate(item.request, item.num_new_tokens) is not None
        batch.assign(item.request, None)
    return batch, batch.prepare(scheduled, kv)


def test_each_kind_of_request_gets_its_own_rows_of_logits_and_hidden_states() -> None:
    prompt = make_request("prompt", [6, 7, 8])
    embedding = make_request("embedding", [6, 7, 8, 9, 10], pooling=PoolingParams(mode="mean"))
    drafting = decoding("drafting", drafts=[11, 12])
    plain = decoding("plain")
    scheduled = [
        ScheduledRequest(prompt, 3),
        ScheduledRequest(embedding, 5),
        ScheduledRequest(drafting, 3, num_draft_tokens=2),
        ScheduledRequest(plain, 1),
    ]
    batch, plan = lay_out(scheduled)
    # Decodes first: the drafting request's three rows, the plain decode, then the prefills.
    assert plan.model_input.num_decodes == 4
    assert plan.sampled == (drafting, plain, prompt)
    assert plan.draft_counts == (2, 0, 0)
    assert plan.logits_offsets == [0, 3, 4]
    assert plan.model_input.logits_indices.tolist() == [0, 1, 2, 3, 6]
    assert plan.model_input.input_ids.tolist() == [9, 11, 12, 9, 6, 7, 8, 6, 7, 8, 9, 10]
    # Mean pooling needs every position of the embedding's chunk, and samples none of them.
    assert plan.model_input.hidden_indices is not None
    assert plan.model_input.hidden_indices.tolist() == [7, 8, 9, 10, 11]
    assert plan.pooled == (PooledChunk(embedding, 5, 0, True),)
    row = batch.rows["drafting"]
    assert plan.logits_rows == [row, row, row, batch.rows["plain"], batch.rows["prompt"]]


def test_a_step_without_drafts_has_nothing_to_verify() -> None:
    _, plan = lay_out([ScheduledRequest(decoding("plain"), 1)])
    spec = speculation()
    assert plan.draft_counts == ()
    assert spec.draft_rows(plan) == []
    assert spec.verify(plan, SampledTokens([5], None, {})) is None


def test_verification_emits_accepted_drafts_and_trims_the_plan_to_them() -> None:
    drafting = decoding("drafting", drafts=[11, 12, 13])
    plain = decoding("plain")
    scheduled = (ScheduledRequest(drafting, 4, num_draft_tokens=3), ScheduledRequest(plain, 1))
    _, plan = lay_out(scheduled)
    spec = speculation()
    [rows] = spec.draft_rows(plan)
    assert (rows.request, rows.offset, rows.tokens) == (drafting, 0, [11, 12, 13])
    # The draft at position 2 is rejected: 11 is accepted, then 40 is emitted.
    verified = spec.verify(plan, SampledTokens([11, 40, 12, 13, 7], None, {}))
    assert verified is not None
    assert verified.token_ids == [[11, 40], [7]]
    assert [v.num_accepted for v in verified.verdicts] == [1, 0]
    output = spec.accepted(SchedulerOutput(scheduled), plan.sampled, verified.verdicts, {})
    assert [(i.num_new_tokens, i.num_draft_tokens) for i in output.scheduled] == [(2, 1), (1, 0)]
    stats = spec.stats()
    assert (stats.num_drafts, stats.num_accepted, stats.num_verifications) == (3, 1, 1)
    # A failed request's verification is not counted.
    spec.accepted(SchedulerOutput(scheduled), plan.sampled, verified.verdicts, {drafting: "x"})
    assert spec.stats().num_verifications == 1


def test_a_failed_emitted_position_fails_the_drafting_request() -> None:
    drafting = decoding("drafting", drafts=[11])
    _, plan = lay_out([ScheduledRequest(drafting, 2, num_draft_tokens=1)])
    verified = speculation().verify(plan, SampledTokens([11, -1], None, {1: "undefined"}))
    assert verified is not None
    assert verified.failures == {0: "undefined"}


def test_the_pooler_collects_a_vector_per_finished_prompt_and_fails_an_unpoolable_one() -> None:
    done = make_request("done", [1, 2], pooling=PoolingParams(mode="mean", normalize=False))
    cached = make_request("cached", [1, 2, 3], pooling=PoolingParams(mode="mean"))
    hidden = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    chunks = (PooledChunk(done, 2, 0, True), PooledChunk(cached, 1, 2, True))
    pooled = Pooler().collect(chunks, hidden)
    assert pooled.vectors == [(done, [2.0, 3.0])]
    assert list(pooled.failures) == [cached]


class Recorder:
    """The scheduler, the KV manager and the engine's request ends, as the processor sees
    them."""

    def __init__(self) -> None:
        self.updated: list[tuple[SchedulerOutput, list[Request]]] = []
        self.committed: list[str] = []
        self.freed: list[str] = []
        self.failed: list[tuple[str, str]] = []
        self.left: list[str] = []

    def update(self, output: SchedulerOutput, finished: list[Request]) -> None:
        self.updated.append((output, list(finished)))

    def commit(self, request: Request) -> None:
        self.committed.append(request.request_id)

    def free(self, request: Request) -> None:
        self.freed.append(request.request_id)

    def fail(
        self, request: Request, error: str, *, invalid: bool = False, param: str | None = None
    ) -> None:
        self.failed.append((request.request_id, error))

    def leave(self, request: Request) -> None:
        self.left.append(request.request_id)


class NoProcessors:
    def accept(self, rows: list[int], tokens: list[int], **_: object) -> dict[int, str]:
        return {}


def processor(
    batch: PersistentBatch, recorder: Recorder, pending: list[StepUpdate]
) -> StepOutputProcessor:
    return StepOutputProcessor(
        batch=batch,
        sampling=NoProcessors(),  # type: ignore[arg-type]
        grammar=None,
        scheduler=recorder,  # type: ignore[arg-type]
        kv=recorder,  # type: ignore[arg-type]
        speculation=None,
        pooler=Pooler(),
        max_model_len=64,
        requests={},
        fail=recorder.fail,
        leave=recorder.leave,
        take_pending=lambda: pending,
    )


def test_processing_appends_tokens_finishes_stops_and_fails_the_failed_alone() -> None:
    stopping = decoding("stopping", stop_token_ids=[STOP])
    going = decoding("going")
    failing = decoding("failing")
    late = decoding("late")
    scheduled = tuple(ScheduledRequest(r, 1) for r in (stopping, going, failing, late))
    batch, plan = lay_out(scheduled)
    recorder = Recorder()
    earlier = StepUpdate(make_request("refused", [1]), [], None, True, error="refused")
    sampled = SampledTokens([STOP, 5, -1, -1], None, {2: "boom"}, skipped=frozenset({3}))
    updates = processor(batch, recorder, [earlier]).process(
        SchedulerOutput(scheduled), plan, sampled, None
    )
    assert updates[0] is earlier  # updates made outside the step's rows come first
    assert [(u.request, u.new_token_ids, u.finished) for u in updates[1:]] == [
        (stopping, [STOP], True),
        (going, [5], False),
    ]
    assert stopping.status is RequestStatus.FINISHED_STOPPED
    assert going.output_token_ids == [9, 5]
    assert late.output_token_ids == [9]  # its row sat the step out
    assert batch.token_ids[batch.rows["going"], 6] == 5
    assert recorder.failed == [("failing", "boom")]
    [(output, finished)] = recorder.updated
    # The late request computes its last token again next step; the failed one is gone.
    assert [(i.request, i.num_new_tokens) for i in output.scheduled] == [
        (stopping, 1),
        (going, 1),
        (late, 0),
    ]
    assert finished == [stopping]
    assert recorder.committed == ["stopping", "going", "late"]
    assert recorder.freed == recorder.left == ["stopping"]
