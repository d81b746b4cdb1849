"""Core's side of speculative decoding: one :class:`Speculation` object the engine step calls
at declared points, and absent (None) when ``[speculative] plugin`` is unset.

Its hooks, in step order:

- :meth:`Speculation.propose` (before scheduling) asks the proposer for drafts of the running
  requests whose next token is a decode and stores them on the requests
  (``request.draft_token_ids``); the scheduler budgets them and the KV manager reserves their
  pages. :meth:`Speculation.retract` takes them back from requests preempted in the plan.
- The persistent batch lays a drafting request out as one decode row per token
  (``PersistentBatch.prepare``); :meth:`Speculation.draft_rows` names those rows for the
  sampling stage, which samples every position with the request's own parameters.
- :meth:`Speculation.verify` (after sampling) accepts drafts left to right while the sampled
  token equals the draft and emits the first token that differs (or the one after the last
  draft): every emitted token is a sample of the target model given the tokens before it, so
  the output distribution is the non-speculating engine's at any temperature, and greedy
  output is identical (see docs/speculative.md).
- :meth:`Speculation.accepted` (before the scheduler's update) counts each verification and
  trims the scheduler's plan to the drafts that were accepted.
- :meth:`Speculation.remove` forgets a request that left the engine.

Rules (docs/speculative.md): a step carries at most ``max_tokens_per_step`` tokens with its
drafts (up to there a CPU step costs about what a one-token step does: the weights are read
once whatever the rows), handed to the requests with the best acceptance rates first, and
nobody speculates in a step where more than ``max_batch_size`` requests run; a request whose
acceptance rate (a moving average) falls below ``min_acceptance_rate`` sits out
:data:`PAUSE_STEPS` steps, then starts again with one draft; a request speculates only where
every logits stage either treats its rows the same at every position
(``LogitsProcessor.is_position_independent``) or can roll back, so that the sampling stage
can walk it through the drafts (grammar, penalties and ``min_tokens`` do); and, with
``adaptive``, a request that had a draft rejected proposes at most ``accepted + 1`` tokens
next, one more after each step that accepted all of its drafts.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from brigade.errors import describe
from brigade.interfaces import (
    DraftSlot,
    LogitsProcessor,
    Proposer,
    Request,
    RequestStatus,
    SchedulerOutput,
)
from brigade.sampling_stage import DraftRows, SampledTokens, TokenLogprob, supports_rollback
from brigade.stations import SpeculativeSettings

if TYPE_CHECKING:
    from brigade.persistent_batch import StepPlan

__all__ = ["Speculation", "SpeculativeStats", "Verified", "VerifiedStep", "verify"]

logger = logging.getLogger(__name__)

_LOG_EVERY = 1000
"""After the first proposer failure, one in this many is logged."""
PRIOR_RATE = 0.5
"""A request's acceptance rate before its first verification."""
RATE_WEIGHT = 0.3
"""Weight of the latest verification in a request's moving-average acceptance rate."""
PAUSE_STEPS = 16
"""Steps a request sits out once its acceptance rate fell below ``min_acceptance_rate``."""


@dataclasses.dataclass(frozen=True, slots=True)
class SpeculativeStats:
    """Counters of speculative decoding since the engine started."""

    num_drafts: int
    """Draft tokens verified."""
    num_accepted: int
    """Of those, accepted."""
    num_verifications: int
    """Request-steps that verified at least one draft."""
    accepted_by_position: tuple[int, ...]
    """Index j: drafts accepted at position j + 1 of their step."""
    drafts_by_position: tuple[int, ...]
    """Index j: drafts verified at position j + 1."""

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafts if self.num_drafts else 0.0

    @staticmethod
    def combine(stats: Sequence[SpeculativeStats | None], sign: int = 1) -> SpeculativeStats | None:
        """``stats[0] + sign * stats[1] + sign * stats[2] ...`` field by field and position by
        position (replicas added up: sign 1; a run's counters, after less before: sign -1);
        None entries are skipped, and None comes back when all are."""
        present = [s for s in stats if s is not None]
        if not present:
            return None

        def total(values: Sequence[int]) -> int:
            return values[0] + sign * sum(values[1:])

        def by_position(rows: list[tuple[int, ...]]) -> tuple[int, ...]:
            return tuple(total(column) for column in itertools.zip_longest(*rows, fillvalue=0))

        return SpeculativeStats(
            total([s.num_drafts for s in present]),
            total([s.num_accepted for s in present]),
            total([s.num_verifications for s in present]),
            by_position([s.accepted_by_position for s in present]),
            by_position([s.drafts_by_position for s in present]),
        )

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verifying request-step: accepted drafts plus the sampled one."""
        if not self.num_verifications:
            return 0.0
        return (self.num_accepted + self.num_verifications) / self.num_verifications


@dataclasses.dataclass(frozen=True, slots=True)
class Verified:
    """What verification made of one request's sampled positions."""

    token_ids: list[int]
    """The tokens it emits: its accepted drafts, then the token sampled after them."""
    num_drafts: int
    num_accepted: int


@dataclasses.dataclass(frozen=True, slots=True)
class VerifiedStep:
    """What verification made of a step with drafts, per sampled request of its plan
    (``StepPlan.sampled`` order)."""

    token_ids: list[list[int]]
    """The tokens each request emits (accepted drafts, then the next sampled one)."""
    logprobs: list[list[TokenLogprob | None]] | None
    """Their logprobs, when any row asked for them."""
    failures: dict[int, str]
    """Index of a request whose emitted position failed -> why."""
    verdicts: list[Verified]


def verify(samples: Sequence[int], drafts: Sequence[int]) -> Verified:
    """Accept ``drafts`` while ``samples[j] == drafts[j]``; ``samples`` has one more entry
    (the token sampled at each draft's position and after the last one)."""
    accepted = 0
    for sample, draft in zip(samples, drafts, strict=False):
        if sample != draft:
            break
        accepted += 1
    return Verified(list(samples[: accepted + 1]), len(drafts), accepted)


class Speculation:
    """The proposer, its per-request draft lengths and the counters."""

    def __init__(
        self,
        proposer: Proposer,
        name: str,
        settings: SpeculativeSettings,
        *,
        vocab_size: int,
        max_model_len: int,
        processors: Sequence[LogitsProcessor],
    ) -> None:
        self.proposer = proposer
        self.name = name
        self.settings = settings
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.processors = list(processors)
        """Every logits stage (the grammar's too): each must treat a speculating request's
        rows the same at every position, or be able to roll back (the sampling stage then
        walks it through the drafts)."""
        self._lengths: dict[str, int] = {}
        """Request id -> the most drafts it proposes next (adaptive rule)."""
        self._rates: dict[str, float] = {}
        """Request id -> moving average of its acceptance rate (prior: :data:`PRIOR_RATE`)."""
        self._paused: dict[str, int] = {}
        """Request id -> steps it still sits out (its acceptance rate fell too low)."""
        self._num_failures = 0
        positions = settings.num_speculative_tokens
        self._accepted_by_position = [0] * positions
        self._drafts_by_position = [0] * positions
        self._num_drafts = 0
        self._num_accepted = 0
        self._num_verifications = 0

    def propose(self, running: Sequence[Request]) -> None:
        """Set the drafts of every running request for the coming step (most get none)."""
        slots: list[DraftSlot] = []
        for request in running:
            if request.draft_token_ids:
                request.draft_token_ids = []
        budget = self.settings.max_tokens_per_step - len(running)
        if len(running) > self.settings.max_batch_size or budget <= 0:
            return
        for request in running:
            paused = self._paused.get(request.request_id)
            if paused is not None:
                self._paused[request.request_id] = paused - 1
                if paused > 1:
                    continue
                del self._paused[request.request_id]
            limit = self._budget(request)
            if limit > 0:
                slots.append(DraftSlot(request, limit))
        if not slots:
            return
        try:
            proposals = self.proposer.propose(slots)
            drafts = self._checked(slots, proposals)
        except Exception as exc:
            self._num_failures += 1
            if self._num_failures % _LOG_EVERY == 1:
                logger.error(
                    "the proposer %r failed (%d times so far); steps run without drafts: %s",
                    self.name,
                    self._num_failures,
                    describe(exc),
                )
            return
        # The step's spare tokens go to the likeliest drafts first.
        rates = self._rates
        ranked = sorted(
            zip(slots, drafts, strict=True),
            key=lambda pair: -rates.get(pair[0].request.request_id, PRIOR_RATE),
        )
        for slot, tokens in ranked:
            if budget <= 0:
                break
            if tokens:
                slot.request.draft_token_ids = tokens[:budget]
                budget -= len(slot.request.draft_token_ids)

    def retract(self, preempted: Sequence[Request]) -> None:
        """``preempted`` lost their pages in this step's plan: and their drafts with them."""
        for request in preempted:
            request.draft_token_ids = []

    def draft_rows(self, plan: StepPlan) -> list[DraftRows]:
        """The requests of ``plan`` verifying drafts, as the sampling stage walks them
        through their draft positions (none in most steps)."""
        if not plan.draft_counts:
            return []
        return [
            DraftRows(request, row, offset, request.draft_token_ids[:count])
            for request, row, count, offset in zip(
                plan.sampled, plan.sampled_rows, plan.draft_counts, plan.logits_offsets, strict=True
            )
            if count
        ]

    def verify(self, plan: StepPlan, sampled: SampledTokens) -> VerifiedStep | None:
        """Each sampled request's verdict on its drafts and the tokens it emits; None when
        ``plan`` has no drafts (every request emits its one sampled token)."""
        if not plan.draft_counts:
            return None
        step = VerifiedStep([], None if sampled.logprobs is None else [], {}, [])
        for index, (request, num_drafts, offset) in enumerate(
            zip(plan.sampled, plan.draft_counts, plan.logits_offsets, strict=True)
        ):
            samples = sampled.token_ids[offset : offset + 1 + num_drafts]
            checked = request.draft_token_ids[:num_drafts] if sampled.drafts_checked else []
            verdict = verify(samples, checked)
            last = offset + verdict.num_accepted  # a failed row never equals a draft
            if last in sampled.failures:
                step.failures[index] = sampled.failures[last]
            step.token_ids.append(verdict.token_ids)
            if step.logprobs is not None:
                assert sampled.logprobs is not None
                step.logprobs.append(sampled.logprobs[offset : last + 1])
            step.verdicts.append(verdict)
        return step

    def accepted(
        self,
        output: SchedulerOutput,
        requests: Sequence[Request],
        verdicts: Sequence[Verified],
        failed: Mapping[Request, str],
    ) -> SchedulerOutput:
        """Count the verifications of ``requests`` (the step's requests that got tokens, with
        their ``verdicts``) but the ``failed`` ones; the step's plan with each speculating
        request computing only its accepted drafts (the rest of its KV is rewritten by later
        steps)."""
        accepted: dict[int, int] = {}
        for request, verdict in zip(requests, verdicts, strict=True):
            if verdict.num_drafts and request not in failed:
                self.observe(request, verdict)
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

    def observe(self, request: Request, verified: Verified) -> None:
        """Count a verification and adapt the request's draft length."""
        drafts, accepted = verified.num_drafts, verified.num_accepted
        self._num_drafts += drafts
        self._num_accepted += accepted
        self._num_verifications += 1
        for position in range(drafts):
            self._drafts_by_position[position] += 1
        for position in range(accepted):
            self._accepted_by_position[position] += 1
        rate = RATE_WEIGHT * accepted / drafts + (1 - RATE_WEIGHT) * self._rates.get(
            request.request_id, PRIOR_RATE
        )
        self._rates[request.request_id] = rate
        limit = self.settings.num_speculative_tokens
        if rate < self.settings.min_acceptance_rate:
            self._paused[request.request_id] = PAUSE_STEPS
            self._rates[request.request_id] = PRIOR_RATE  # a fresh start after the pause
            self._lengths[request.request_id] = 1
        elif self.settings.adaptive:
            current = self._lengths.get(request.request_id, limit)
            self._lengths[request.request_id] = (
                min(limit, current + 1) if accepted == drafts else accepted + 1
            )
        try:
            self.proposer.observe(request, drafts, accepted)
        except Exception as exc:
            logger.error("the proposer %r failed to observe: %s", self.name, describe(exc))

    def remove(self, request: Request) -> None:
        """``request`` left the engine."""
        self._lengths.pop(request.request_id, None)
        self._rates.pop(request.request_id, None)
        self._paused.pop(request.request_id, None)
        request.draft_token_ids = []
        try:
            self.proposer.remove(request)
        except Exception as exc:
            logger.error(
                "the proposer %r failed to drop request %s: %s",
                self.name,
                request.request_id,
                describe(exc),
            )

    def stats(self) -> SpeculativeStats:
        return SpeculativeStats(
            self._num_drafts,
            self._num_accepted,
            self._num_verifications,
            tuple(self._accepted_by_position),
            tuple(self._drafts_by_position),
        )

    def _budget(self, request: Request) -> int:
        """How many drafts ``request`` may propose now (0: it does not speculate)."""
        if (
            request.status is not RequestStatus.RUNNING
            or request.num_computed_tokens != request.num_tokens - 1
            or request.pooling is not None
        ):
            return 0
        if not self._position_independent(request):
            return 0
        params = request.sampling_params
        # Every accepted draft and the token after them must still fit the request.
        room = min(
            params.max_tokens - request.num_output_tokens,
            self.max_model_len - request.num_tokens,
        )
        length = self._lengths.get(request.request_id, self.settings.num_speculative_tokens)
        return min(length, room - 1)

    def _position_independent(self, request: Request) -> bool:
        """Whether every logits stage can edit ``request``'s draft positions right: it treats
        them all alike, or it can be walked through the drafts and rolled back."""
        try:
            return all(
                supports_rollback(stage) or stage.is_position_independent(request)
                for stage in self.processors
            )
        except Exception as exc:
            logger.error(
                "a logits processor failed to say whether request %s may speculate: %s",
                request.request_id,
                describe(exc),
            )
            return False

    def _checked(
        self, slots: Sequence[DraftSlot], proposals: Sequence[Sequence[int]]
    ) -> list[list[int]]:
        """The proposals as lists, or ``ValueError`` saying what breaks the contract."""
        if len(proposals) != len(slots):
            raise ValueError(f"{len(proposals)} proposals for {len(slots)} requests")
        drafts: list[list[int]] = []
        for slot, proposal in zip(slots, proposals, strict=True):
            tokens = list(proposal)
            if len(tokens) > slot.max_tokens:
                raise ValueError(
                    f"{len(tokens)} drafts for request {slot.request.request_id}, which may "
                    f"have at most {slot.max_tokens}"
                )
            for token in tokens:
                if type(token) is not int or not 0 <= token < self.vocab_size:
                    raise ValueError(
                        f"draft {token!r} for request {slot.request.request_id} is not a token "
                        f"id in [0, {self.vocab_size})"
                    )
            drafts.append(tokens)
        return drafts
