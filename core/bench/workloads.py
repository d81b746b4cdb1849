"""Seeded workloads for benchmarks and simulations: synthetic generators and trace replay.

A workload is a list of :class:`WorkloadRequest` sorted by arrival time. Prompts are token ids
(random ids in ``[FIRST_TOKEN_ID, vocab_size)``, so special tokens stay out of the way); every
generator takes a ``seed`` and returns the same workload for the same arguments. A request may
carry ``extra`` data for plugins (``Request.extra``): a trace's ``extra`` object, or fields
drawn by :func:`draw_extra`; ``extra.deadline_s`` is the request's deadline (see
:data:`DEADLINE_FIELD`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from brigade.errors import RequestError
from brigade.interfaces import EMPTY_EXTRA, ExtraValue, SamplingParams, freeze_extra

__all__ = [
    "DEADLINE_FIELD",
    "Arrivals",
    "Lengths",
    "WorkloadError",
    "WorkloadRequest",
    "draw_extra",
    "extra_json",
    "load_trace",
    "multi_turn",
    "save_trace",
    "shared_prefix",
    "submit",
    "synthetic",
]

FIRST_TOKEN_ID = 10
"""Generated prompts use ids from here up, clear of the usual special tokens."""
DEADLINE_FIELD = "deadline_s"
"""The ``extra`` field holding a request's deadline: seconds after its arrival (a number > 0)
by which its last token is due. The bench report counts a request as a deadline miss when its
end-to-end latency exceeds it, or when it failed."""


class WorkloadError(ValueError):
    """A workload description or trace file is not valid."""


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload."""

    arrival_time: float
    """Seconds from the start of the run."""
    prompt_token_ids: tuple[int, ...]
    output_len: int
    """Tokens to generate (the request runs to this length, ignoring EOS)."""
    priority: int = 0
    """Lower runs first under the ``priority`` scheduler."""
    extra: Mapping[str, ExtraValue] = dataclasses.field(default_factory=lambda: EMPTY_EXTRA)
    """Data for plugins, handed to the engine as ``Request.extra`` (frozen here; a bad value
    or a ``deadline_s`` that is not a number > 0 is a ``WorkloadError``)."""

    def __post_init__(self) -> None:
        if self.extra is EMPTY_EXTRA:
            return
        try:
            extra = freeze_extra(self.extra)
        except ValueError as exc:
            raise WorkloadError(str(exc)) from None
        deadline = extra.get(DEADLINE_FIELD)
        if DEADLINE_FIELD in extra and (
            isinstance(deadline, bool) or not isinstance(deadline, int | float) or deadline <= 0
        ):
            raise WorkloadError(
                f"extra[{DEADLINE_FIELD!r}] is the deadline in seconds after arrival: a "
                f"number > 0, got {deadline!r}"
            )
        object.__setattr__(self, "extra", extra)


@dataclasses.dataclass(frozen=True, slots=True)
class Lengths:
    """A length distribution; samples are rounded and clipped to ``[minimum, maximum]``.

    ``fixed``: always ``mean``. ``uniform``: ``mean ± spread``. ``normal``: standard deviation
    ``spread``. ``lognormal``: ``spread`` is the sigma of the log, and the distribution's mean
    is ``mean`` (mu = ln(mean) - sigma² / 2).
    """

    kind: Literal["fixed", "uniform", "normal", "lognormal"]
    mean: float
    spread: float = 0.0
    minimum: int = 1
    maximum: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "normal", "lognormal"):
            raise WorkloadError(
                f"length kind {self.kind!r} is not allowed; allowed: fixed, uniform, normal, "
                "lognormal"
            )
        if self.mean < 1 or self.spread < 0 or self.minimum < 1:
            raise WorkloadError("lengths need mean >= 1, spread >= 0 and minimum >= 1")
        if self.maximum is not None and self.maximum < self.minimum:
            raise WorkloadError(f"maximum {self.maximum} is below minimum {self.minimum}")

    def sample(self, rng: random.Random) -> int:
        """One length."""
        if self.kind == "fixed":
            value = self.mean
        elif self.kind == "uniform":
            value = rng.uniform(self.mean - self.spread, self.mean + self.spread)
        elif self.kind == "normal":
            value = rng.gauss(self.mean, self.spread)
        else:
            value = rng.lognormvariate(math.log(self.mean) - self.spread**2 / 2, self.spread)
        length = max(self.minimum, round(value))
        return length if self.maximum is None else min(self.maximum, length)


@dataclasses.dataclass(frozen=True, slots=True)
class Arrivals:
    """When requests arrive: ``at_once`` (all at 0), ``poisson`` or ``gamma`` at ``rate``/s.

    ``gamma`` inter-arrival times have shape ``burstiness`` and mean ``1 / rate``: below 1 the
    arrivals are burstier than Poisson, above 1 more regular (1 is Poisson).
    """

    kind: Literal["at_once", "poisson", "gamma"] = "at_once"
    rate: float = 0.0
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("at_once", "poisson", "gamma"):
            raise WorkloadError(
                f"arrival kind {self.kind!r} is not allowed; allowed: at_once, poisson, gamma"
            )
        if self.kind != "at_once" and self.rate <= 0:
            raise WorkloadError(f"{self.kind} arrivals need rate > 0 (requests per second)")
        if self.burstiness <= 0:
            raise WorkloadError("burstiness must be > 0")

    def times(self, count: int, rng: random.Random) -> list[float]:
        """``count`` non-decreasing arrival times starting near 0."""
        if self.kind == "at_once":
            return [0.0] * count
        shape = 1.0 if self.kind == "poisson" else self.burstiness
        now, times = 0.0, []
        for _ in range(count):
            times.append(now)
            now += rng.gammavariate(shape, 1.0 / (self.rate * shape))
        return times


def _tokens(rng: random.Random, count: int, vocab_size: int) -> tuple[int, ...]:
    if vocab_size <= FIRST_TOKEN_ID:
        raise WorkloadError(f"vocab_size must be above {FIRST_TOKEN_ID}, got {vocab_size}")
    return tuple(rng.choices(range(FIRST_TOKEN_ID, vocab_size), k=count))


def _priority(rng: random.Random, priorities: Sequence[tuple[int, float]]) -> int:
    if not priorities:
        return 0
    levels, weights = zip(*priorities, strict=True)
    return rng.choices(levels, weights)[0]


def synthetic(
    num_requests: int,
    prompt_lens: Lengths,
    output_lens: Lengths,
    arrivals: Arrivals = Arrivals(),
    *,
    vocab_size: int = 32000,
    priorities: Sequence[tuple[int, float]] = (),
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Independent random prompts; ``priorities`` is (level, weight) pairs (default all 0)."""
    rng = random.Random(seed)
    times = arrivals.times(num_requests, rng)
    return [
        WorkloadRequest(
            time,
            _tokens(rng, prompt_lens.sample(rng), vocab_size),
            output_lens.sample(rng),
            _priority(rng, priorities),
        )
        for time in times
    ]


def shared_prefix(
    num_groups: int,
    requests_per_group: int,
    prefix_len: int,
    suffix_lens: Lengths,
    output_lens: Lengths,
    arrivals: Arrivals = Arrivals(),
    *,
    vocab_size: int = 32000,
    priorities: Sequence[tuple[int, float]] = (),
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Groups whose prompts start with the group's ``prefix_len`` tokens (a system prompt),
    then a random suffix; the groups' requests arrive interleaved in a random order."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, prefix_len, vocab_size) for _ in range(num_groups)]
    groups = [g for g in range(num_groups) for _ in range(requests_per_group)]
    rng.shuffle(groups)
    times = arrivals.times(len(groups), rng)
    return [
        WorkloadRequest(
            time,
            prefixes[group] + _tokens(rng, suffix_lens.sample(rng), vocab_size),
            output_lens.sample(rng),
            _priority(rng, priorities),
        )
        for time, group in zip(times, groups, strict=True)
    ]


def multi_turn(
    num_conversations: int,
    num_turns: int,
    user_lens: Lengths,
    output_lens: Lengths,
    arrivals: Arrivals = Arrivals(),
    *,
    think_time_s: float = 1.0,
    vocab_size: int = 32000,
    priorities: Sequence[tuple[int, float]] = (),
    num_prefix_groups: int = 0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Conversations: turn ``k``'s prompt is turn ``k-1``'s prompt, a reply of its output
    length (random tokens standing in for the model's answer) and a new user message.

    Conversations start at ``arrivals``; turn ``k`` arrives ``k * think_time_s`` later
    (open loop: it does not wait for the previous answer). A conversation has one priority
    level drawn from ``priorities``; with ``num_prefix_groups`` > 0 each conversation opens
    with one of that many shared ``prefix_len``-token system prompts, picked at random.
    """
    if num_prefix_groups < 0 or (num_prefix_groups > 0 and prefix_len < 1):
        raise WorkloadError("prefix groups need num_prefix_groups >= 1 and prefix_len >= 1")
    rng = random.Random(seed)
    prefixes = [_tokens(rng, prefix_len, vocab_size) for _ in range(num_prefix_groups)]
    requests = []
    for start in arrivals.times(num_conversations, rng):
        history: tuple[int, ...] = rng.choice(prefixes) if prefixes else ()
        priority = _priority(rng, priorities)
        for turn in range(num_turns):
            history += _tokens(rng, user_lens.sample(rng), vocab_size)
            output_len = output_lens.sample(rng)
            requests.append(
                WorkloadRequest(start + turn * think_time_s, history, output_len, priority)
            )
            history += _tokens(rng, output_len, vocab_size)
    requests.sort(key=lambda request: request.arrival_time)
    return requests


def load_trace(
    path: str | Path,
    *,
    tokenize: Callable[[str], list[int]] | None = None,
    vocab_size: int = 32000,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Replay a JSONL trace, one request per line, sorted by arrival time.

    Fields: ``arrival_time`` (seconds >= 0), one of ``prompt`` (text, needs ``tokenize``),
    ``prompt_token_ids`` or ``prompt_len`` (random ids from ``seed``), ``output_len`` (>= 1)
    and optionally ``priority`` (integer, default 0) and ``extra`` (an object of data for
    plugins; its ``deadline_s`` a number > 0). Errors name the line and the field.
    """
    rng = random.Random(seed)
    requests = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise WorkloadError(f"trace {path}: {exc}") from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"trace {path} line {number}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise WorkloadError(f"{where}: not valid JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise WorkloadError(f"{where}: expected a JSON object")
        requests.append(_trace_request(record, where, tokenize, rng, vocab_size))
    requests.sort(key=lambda request: request.arrival_time)
    return requests


def _trace_request(
    record: dict[str, object],
    where: str,
    tokenize: Callable[[str], list[int]] | None,
    rng: random.Random,
    vocab_size: int,
) -> WorkloadRequest:
    def integer(field: str, minimum: int) -> int:
        value = record.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise WorkloadError(f"{where}: field {field!r} must be an integer >= {minimum}")
        return value

    arrival = record.get("arrival_time")
    if isinstance(arrival, bool) or not isinstance(arrival, int | float) or arrival < 0:
        raise WorkloadError(f"{where}: field 'arrival_time' must be a number >= 0 (seconds)")
    given = [f for f in ("prompt", "prompt_token_ids", "prompt_len") if f in record]
    if len(given) != 1:
        raise WorkloadError(
            f"{where}: give exactly one of the fields 'prompt', 'prompt_token_ids', 'prompt_len'"
        )
    if given[0] == "prompt":
        text = record["prompt"]
        if not isinstance(text, str):
            raise WorkloadError(f"{where}: field 'prompt' must be a string")
        if tokenize is None:
            raise WorkloadError(
                f"{where}: field 'prompt' (text) needs a tokenizer; "
                "give prompt_token_ids or prompt_len instead"
            )
        prompt = tuple(tokenize(text))
    elif given[0] == "prompt_token_ids":
        ids = record["prompt_token_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
        ):
            raise WorkloadError(
                f"{where}: field 'prompt_token_ids' must be a list of integers >= 0"
            )
        prompt = tuple(ids)
    else:
        prompt = _tokens(rng, integer("prompt_len", 1), vocab_size)
    if not prompt:
        raise WorkloadError(f"{where}: field {given[0]!r} gives an empty prompt")
    priority = integer("priority", -(2**31)) if "priority" in record else 0
    extra = record.get("extra")
    if extra is not None and not isinstance(extra, dict):
        raise WorkloadError(f"{where}: field 'extra' must be a JSON object")
    output_len = integer("output_len", 1)
    try:
        return WorkloadRequest(float(arrival), prompt, output_len, priority, extra or EMPTY_EXTRA)
    except WorkloadError as exc:
        raise WorkloadError(f"{where}: field 'extra': {exc}") from None


def save_trace(workload: Sequence[WorkloadRequest], path: str | Path) -> None:
    """Write ``workload`` as a JSONL trace that :func:`load_trace` replays exactly."""
    with Path(path).open("w", encoding="utf-8") as file:
        for request in workload:
            record: dict[str, Any] = {
                "arrival_time": request.arrival_time,
                "prompt_token_ids": list(request.prompt_token_ids),
                "output_len": request.output_len,
                "priority": request.priority,
            }
            if request.extra:
                record["extra"] = extra_json(request.extra)
            file.write(json.dumps(record) + "\n")


def extra_json(extra: Mapping[str, ExtraValue]) -> dict[str, Any]:
    """``extra`` as plain dicts and lists, for ``json.dumps`` (a trace line, an HTTP body)."""

    def plain(value: ExtraValue) -> Any:
        if isinstance(value, Mapping):
            return {key: plain(item) for key, item in value.items()}
        if isinstance(value, tuple):
            return [plain(item) for item in value]
        return value

    return {key: plain(value) for key, value in extra.items()}


def draw_extra(
    workload: Sequence[WorkloadRequest],
    fields: Mapping[str, Sequence[tuple[ExtraValue, float]]],
    *,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """``workload`` with ``extra[key]`` drawn for every request from ``fields[key]``, a list of
    (value, weight) pairs (one pair: always that value).

    Each field has its own random stream, seeded by ``seed`` and the key, so adding a field
    changes neither the rest of the workload nor the other fields' draws.
    """
    if not fields:
        return list(workload)
    draws: dict[str, list[ExtraValue]] = {}
    for key, choices in fields.items():
        if not choices or any(not weight > 0 for _, weight in choices):
            raise WorkloadError(f"extra field {key!r} needs (value, weight) pairs, weights > 0")
        rng = random.Random(f"extra:{seed}:{key}")
        values, weights = zip(*choices, strict=True)
        draws[key] = rng.choices(values, weights, k=len(workload))
    return [
        dataclasses.replace(
            request,
            extra={**request.extra, **{key: draws[key][index] for key in fields}},
        )
        for index, request in enumerate(workload)
    ]


def submit(engine: Any, request_id: str, request: WorkloadRequest, errors: list[str]) -> bool:
    """Add ``request`` to an ``EngineCore`` with its fixed output length (greedy, EOS ignored)
    and its ``extra`` data; a request the engine refuses is recorded in ``errors`` (counted as
    failed), not raised. False when it was refused."""
    params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
    try:
        engine.add_request(
            request_id,
            request.prompt_token_ids,
            params,
            priority=request.priority,
            extra=request.extra,
        )
    except RequestError as exc:
        errors.append(f"request {request_id}: {exc}")
        return False
    return True
