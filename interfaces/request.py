"""The request as it travels through the engine, and the scheduler's step plan."""

from __future__ import annotations

import dataclasses
import enum
import math
import types
from collections.abc import Mapping
from typing import Any, TypeAlias

from brigade.interfaces.sampling import PoolingParams, SamplingParams

__all__ = [
    "EMPTY_EXTRA",
    "ExtraValue",
    "Request",
    "RequestStatus",
    "ScheduledRequest",
    "SchedulerOutput",
    "freeze_extra",
    "is_decode",
]

ExtraValue: TypeAlias = (
    "str | int | float | bool | tuple[ExtraValue, ...] | Mapping[str, ExtraValue] | None"
)
"""One value of :attr:`Request.extra`: JSON data, frozen (arrays as tuples, objects as read-only
mappings)."""
EMPTY_EXTRA: Mapping[str, ExtraValue] = types.MappingProxyType({})
"""The ``extra`` of a request that carries none."""
MAX_EXTRA_DEPTH = 64
"""Arrays and objects nested deeper than this in ``extra`` are refused (as in an HTTP body)."""
_EXTRA_TYPES = "str, int, float, bool, None, lists and dicts with str keys (JSON data)"


def freeze_extra(
    extra: Mapping[str, object] | None, *, name: str = "extra"
) -> Mapping[str, ExtraValue]:
    """A read-only deep copy of ``extra``: lists (and tuples) become tuples, dicts read-only
    mappings, so no plugin can change what another one reads.

    Raises ``ValueError`` naming the offending entry (``extra['tags'][2]``) when ``extra`` is not
    a mapping with str keys, holds something that is not JSON data, a float that is NaN or
    infinite, or nests more than :data:`MAX_EXTRA_DEPTH` levels. ``name`` is the name errors
    give the mapping (``extra_args`` for an HTTP body).
    """
    if extra is None or (isinstance(extra, Mapping) and not extra):
        return EMPTY_EXTRA
    if not isinstance(extra, Mapping):
        raise ValueError(
            f"{name} must be a mapping of str keys to JSON data, got {type(extra).__name__}"
        )
    return _freeze_mapping(extra, name, 1)


def _freeze_mapping(
    value: Mapping[Any, object], where: str, depth: int
) -> Mapping[str, ExtraValue]:
    items = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise ValueError(f"{where} has the key {key!r}; keys must be str (as in JSON)")
        items[key] = _freeze(item, f"{where}[{key!r}]", depth + 1)
    return types.MappingProxyType(items)


def _freeze(value: object, where: str, depth: int) -> ExtraValue:
    if value is None or isinstance(value, str | int):  # bool is an int
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value}: JSON has no NaN or infinity")
        return value
    if not isinstance(value, Mapping | list | tuple):
        raise ValueError(f"{where} is a {type(value).__name__}; allowed: {_EXTRA_TYPES}")
    if depth > MAX_EXTRA_DEPTH:
        shown = where if len(where) <= 60 else where[:60] + "..."
        raise ValueError(f"{shown} nests more than {MAX_EXTRA_DEPTH} levels of lists and dicts")
    if isinstance(value, Mapping):
        return _freeze_mapping(value, where, depth)
    return tuple(_freeze(item, f"{where}[{index}]", depth + 1) for index, item in enumerate(value))


def _no_extra() -> Mapping[str, ExtraValue]:
    return EMPTY_EXTRA


class RequestStatus(enum.Enum):
    """Where a request is in its life; the ``FINISHED_*`` values double as finish reasons."""

    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    """Its structured-output grammar is compiling: not queued yet, no KV pages (API 2.0)."""
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        """True for the three terminal states."""
        return self.name.startswith("FINISHED")


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated.

    Ownership: core creates the request, is the only writer of ``output_token_ids`` and
    writes the final ``FINISHED_*`` status; while the request waits or runs the scheduler is
    the only writer of ``status``, ``num_computed_tokens`` and ``num_preemptions``; the KV
    manager writes ``num_cached_tokens`` from ``allocate``. Every other component reads only.
    Requests compare by identity.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    """When the engine received the request, on the engine clock (``SchedulerParams.clock``:
    ``time.monotonic`` seconds when serving, virtual seconds under the simulator)."""
    priority: int = 0
    """Lower runs first under a priority scheduler; ignored by FCFS."""
    extra: Mapping[str, ExtraValue] = dataclasses.field(default_factory=_no_extra)
    """Per-request data for plugins (a deadline, a tenant, a priority class), from HTTP
    ``extra_args``, ``LLM.generate(extra=...)`` or a bench workload. Frozen at construction
    (see :func:`freeze_extra`): read-only for every component; core never interprets it."""
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    """Only appended to while the request is in the engine (KV managers key cached pages by
    token content)."""
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache (prefix hits included)."""
    num_cached_tokens: int = 0
    """Tokens served from the prefix cache at the latest admission."""
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    """When the request first got a batch row (queue time ends), on the engine clock."""
    pooling: PoolingParams | None = None
    """Set for an embedding request (API 2.1): its prompt is run, no token is sampled, and it
    finishes with a vector pooled from its hidden states. None for generation."""
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)
    """Speculative decoding (API 2.4): tokens a proposer guessed to follow the last one,
    written by core before a step is scheduled and cleared after it. The scheduler may give a
    running request whose next token is a decode up to ``len(draft_token_ids)`` more tokens
    (``ScheduledRequest.num_draft_tokens``), and a KV manager with ``supports_draft_tokens``
    reserves pages for them. Empty when the request does not speculate."""

    def __post_init__(self) -> None:
        if self.extra is not EMPTY_EXTRA:
            self.extra = freeze_extra(self.extra)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def uses_prefix_cache(self) -> bool:
        """False when every token must be computed (an embedding that pools every position):
        a KV manager then matches nothing at admission and reports ``cached_prefix_len`` 0
        (API 2.1). Its pages may still be committed for others to reuse."""
        return self.pooling is None or not self.pooling.needs_every_position


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` tokens starting at its computed count."""

    request: Request
    num_new_tokens: int
    num_draft_tokens: int = 0
    """Of ``num_new_tokens``, how many are the request's first draft tokens (speculative
    decoding, API 2.4): the step computes its last token and these drafts, and samples at
    each of their positions to verify them."""

    @property
    def is_decode(self) -> bool:
        """The request decodes its next token (see :func:`is_decode`): one decode row, or,
        with draft tokens, one decode row per token (speculative decoding)."""
        return is_decode(
            self.num_new_tokens - self.num_draft_tokens, self.request.num_computed_tokens
        )


def is_decode(num_new_tokens: int, num_computed_tokens: int) -> bool:
    """Whether a row is a decode: exactly one new token after a cached context. The
    executor's batch has every decode row before every prefill chunk (``ModelInput``)."""
    return num_new_tokens == 1 and num_computed_tokens > 0


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """The plan for one engine step.

    ``scheduled`` lists the requests in serving order (the persistent batch lays the
    executor's rows out decodes first). ``preempted`` lists requests that lost their pages in
    this plan; core releases their rows in the persistent batch.
    """

    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[Request, ...] = ()
    swap_out: tuple[tuple[int, int], ...] = ()
    """(device page, host page) copies core makes before this step runs (preempted by swap)."""
    swap_in: tuple[tuple[int, int], ...] = ()
    """(host page, device page) copies core makes after ``swap_out``, before the step runs."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
