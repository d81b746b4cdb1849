"""``brigade bench`` arguments as strings: the ``--workload`` spec and the ``--sweep`` spec."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Literal

from brigade.bench.report import BenchError
from brigade.bench.workloads import (
    DEADLINE_FIELD,
    Arrivals,
    Lengths,
    WorkloadError,
    WorkloadRequest,
    draw_extra,
    load_trace,
    multi_turn,
    shared_prefix,
    synthetic,
)
from brigade.interfaces import ExtraValue

__all__ = ["SYNTHETIC_GRAMMAR", "SweepSpec", "WorkloadSpec", "parse_sweep", "parse_workload"]

SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC_GRAMMAR = (
    "synthetic:requests=N[,prompt=LEN][,output=LEN][,rate=R[,burstiness=B]]"
    "[,priorities=L:W/L:W...][,prefix_groups=G,prefix_len=P][,turns=T[,think_time=S]]"
    "[,extra.KEY=V|V:W/V:W...]"
)
EXTRA_PREFIX = "extra."
"""A synthetic term ``extra.KEY=...`` draws ``Request.extra[KEY]`` for every request."""
_SYNTHETIC_KEYS = (
    "requests",
    "prompt",
    "output",
    "rate",
    "burstiness",
    "priorities",
    "prefix_groups",
    "prefix_len",
    "turns",
    "think_time",
)
_DEFAULT_PROMPT = Lengths("fixed", 128)
_DEFAULT_OUTPUT = Lengths("fixed", 64)
_AT_ONCE = Arrivals()


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A parsed ``--workload``: a JSONL trace or a synthetic generator's arguments."""

    trace: Path | None = None
    num_requests: int = 0
    prompt_lens: Lengths = _DEFAULT_PROMPT
    """Whole prompts; with prefix groups the part after the shared prefix; with turns each
    turn's new user message."""
    output_lens: Lengths = _DEFAULT_OUTPUT
    arrivals: Arrivals = _AT_ONCE
    """Of requests; with turns, of conversations."""
    priorities: tuple[tuple[int, float], ...] = ()
    num_prefix_groups: int = 0
    prefix_len: int = 0
    num_turns: int = 1
    think_time_s: float = 1.0
    extra: tuple[tuple[str, tuple[tuple[ExtraValue, float], ...]], ...] = ()
    """``extra.KEY`` terms: per key, the (value, weight) pairs each request's value is drawn
    from."""

    def build(self, seed: int, vocab_size: int) -> list[WorkloadRequest]:
        """The workload for one seed, prompt ids below ``vocab_size``."""
        try:
            return draw_extra(self._build(seed, vocab_size), dict(self.extra), seed=seed)
        except WorkloadError as exc:
            raise BenchError(str(exc)) from exc

    def _build(self, seed: int, vocab_size: int) -> list[WorkloadRequest]:
        if self.trace is not None:
            return load_trace(self.trace, vocab_size=vocab_size, seed=seed)
        if self.num_turns > 1:
            return multi_turn(
                self.num_requests // self.num_turns,
                self.num_turns,
                self.prompt_lens,
                self.output_lens,
                self.arrivals,
                think_time_s=self.think_time_s,
                vocab_size=vocab_size,
                priorities=self.priorities,
                num_prefix_groups=self.num_prefix_groups,
                prefix_len=self.prefix_len,
                seed=seed,
            )
        if self.num_prefix_groups:
            return shared_prefix(
                self.num_prefix_groups,
                self.num_requests // self.num_prefix_groups,
                self.prefix_len,
                self.prompt_lens,
                self.output_lens,
                self.arrivals,
                vocab_size=vocab_size,
                priorities=self.priorities,
                seed=seed,
            )
        return synthetic(
            self.num_requests,
            self.prompt_lens,
            self.output_lens,
            self.arrivals,
            vocab_size=vocab_size,
            priorities=self.priorities,
            seed=seed,
        )

    def with_rate(self, rate: float) -> WorkloadSpec:
        """The same workload arriving at ``rate``/s: Poisson, or gamma if it was gamma."""
        if self.trace is not None:
            raise BenchError(
                "--sweep rate needs a synthetic workload; a trace has its own arrival times"
            )
        kind: Literal["poisson", "gamma"] = "gamma" if self.arrivals.kind == "gamma" else "poisson"
        return dataclasses.replace(self, arrivals=Arrivals(kind, rate, self.arrivals.burstiness))


def _parse_lengths(key: str, text: str) -> Lengths:
    """``fixed:64``, ``uniform:LOW:HIGH``, ``normal:MEAN:STD``, ``lognormal:MEAN:SIGMA``."""
    kind, *numbers = text.split(":")
    try:
        values = [float(n) for n in numbers]
    except ValueError:
        values = []
    expected = 1 if kind == "fixed" else 2
    if kind not in ("fixed", "uniform", "normal", "lognormal") or len(values) != expected:
        raise BenchError(
            f"workload {key}={text!r} is not allowed; use fixed:N, uniform:LOW:HIGH, "
            "normal:MEAN:STD or lognormal:MEAN:SIGMA"
        )
    try:
        if kind == "fixed":
            return Lengths("fixed", values[0], minimum=1)
        if kind == "uniform":
            low, high = values
            if low > high or low < 1:
                raise BenchError(f"workload {key}={text!r}: need 1 <= LOW <= HIGH")
            return Lengths("uniform", (low + high) / 2, (high - low) / 2, round(low), round(high))
        return Lengths(kind, values[0], values[1])  # type: ignore[arg-type]
    except WorkloadError as exc:
        raise BenchError(f"workload {key}={text!r}: {exc}") from exc


def _parse_priorities(text: str) -> tuple[tuple[int, float], ...]:
    """``0:1/1:4`` -> level 0 with weight 1, level 1 with weight 4."""
    pairs = []
    for term in text.split("/"):
        level, sep, weight = term.partition(":")
        try:
            pair = (int(level), float(weight))
        except ValueError:
            pair = (0, -1.0)
        if not sep or not pair[1] > 0:
            raise BenchError(
                f"workload priorities={text!r} is not allowed; use LEVEL:WEIGHT pairs joined "
                "by '/', weights > 0 (e.g. 0:1/1:4)"
            )
        pairs.append(pair)
    return tuple(pairs)


def _integer(fields: dict[str, str], key: str, default: int, minimum: int) -> int:
    try:
        value = int(fields.get(key, str(default)))
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise BenchError(
            f"workload {key}={fields[key]!r} is not allowed; need an integer >= {minimum}"
        )
    return value


def _number(fields: dict[str, str], key: str, default: float) -> float:
    try:
        value = float(fields.get(key, str(default)))
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise BenchError(f"workload {key}={fields[key]!r} is not allowed; need a number >= 0")
    return value


def parse_workload(spec: str) -> WorkloadSpec:
    """A JSONL trace path, or a synthetic spec (:data:`SYNTHETIC_GRAMMAR`).

    LEN is ``fixed:N``, ``uniform:LOW:HIGH``, ``normal:MEAN:STD`` or ``lognormal:MEAN:SIGMA``;
    without ``rate`` every request arrives at once, with it arrivals are Poisson at ``rate``/s
    (gamma with ``burstiness``); ``priorities=0:1/1:4`` draws priority levels by weight.
    ``prefix_groups=G,prefix_len=P`` starts every prompt with one of G shared P-token prefixes
    (``prompt`` is then the length after it); ``turns=T`` makes requests/T conversations of T
    turns, ``think_time`` seconds apart (``rate`` is then the rate of new conversations).
    """
    if not spec.startswith(SYNTHETIC_PREFIX):
        path = Path(spec)
        if not path.is_file():
            raise BenchError(
                f"workload {spec!r} is neither a JSONL trace file nor {SYNTHETIC_GRAMMAR}"
            )
        return WorkloadSpec(trace=path)
    fields, extra = _synthetic_terms(spec)
    num_requests, arrivals = _requests_and_arrivals(spec, fields)
    groups, prefix_len, turns = _prefixes_and_turns(fields, num_requests)
    return WorkloadSpec(
        num_requests=num_requests,
        prompt_lens=_parse_lengths("prompt", fields.get("prompt", "fixed:128")),
        output_lens=_parse_lengths("output", fields.get("output", "fixed:64")),
        arrivals=arrivals,
        priorities=_parse_priorities(fields["priorities"]) if "priorities" in fields else (),
        num_prefix_groups=groups,
        prefix_len=prefix_len,
        num_turns=turns,
        think_time_s=_number(fields, "think_time", 1.0),
        extra=tuple(extra.items()),
    )


def _synthetic_terms(
    spec: str,
) -> tuple[dict[str, str], dict[str, tuple[tuple[ExtraValue, float], ...]]]:
    """A synthetic spec's ``key=value`` terms, and its ``extra.NAME`` ones parsed."""
    fields: dict[str, str] = {}
    extra: dict[str, tuple[tuple[ExtraValue, float], ...]] = {}
    for part in filter(None, spec[len(SYNTHETIC_PREFIX) :].split(",")):
        key, sep, value = part.partition("=")
        if sep and key.startswith(EXTRA_PREFIX):
            extra[key[len(EXTRA_PREFIX) :]] = _parse_extra(key, value)
            continue
        if not sep or key not in _SYNTHETIC_KEYS:
            raise BenchError(
                f"workload term {part!r} is not allowed; keys: {', '.join(_SYNTHETIC_KEYS)}, "
                f"{EXTRA_PREFIX}NAME"
            )
        fields[key] = value
    return fields, extra


def _requests_and_arrivals(spec: str, fields: dict[str, str]) -> tuple[int, Arrivals]:
    """``requests`` (required), and the arrival process ``rate`` and ``burstiness`` give."""
    if "requests" not in fields:
        raise BenchError("a synthetic workload needs requests=N")
    try:
        num_requests = int(fields["requests"])
        rate = float(fields.get("rate", "0"))
        burstiness = float(fields.get("burstiness", "1"))
    except ValueError as exc:
        raise BenchError(f"workload {spec!r}: requests, rate, burstiness must be numbers") from exc
    if num_requests < 1:
        raise BenchError(f"workload requests={num_requests} is not allowed; need >= 1")
    if rate < 0:
        raise BenchError(f"workload rate={rate} is not allowed; need >= 0 (0 = all at once)")
    kind = "at_once" if rate == 0 else ("poisson" if "burstiness" not in fields else "gamma")
    try:
        return num_requests, Arrivals(kind, rate, burstiness)  # type: ignore[arg-type]
    except WorkloadError as exc:
        raise BenchError(str(exc)) from exc


def _prefixes_and_turns(fields: dict[str, str], num_requests: int) -> tuple[int, int, int]:
    """``prefix_groups``, ``prefix_len`` and ``turns``, checked together: both prefix keys or
    neither, ``requests`` a multiple of the turns and of the groups of single-turn requests."""
    groups = _integer(fields, "prefix_groups", 0, 1) if "prefix_groups" in fields else 0
    prefix_len = _integer(fields, "prefix_len", 0, 1) if "prefix_len" in fields else 0
    if bool(groups) != bool(prefix_len):
        raise BenchError("workload prefix_groups=G and prefix_len=P go together; give both")
    turns = _integer(fields, "turns", 1, 1)
    for divisor, name in ((turns, "turns"), (groups if turns == 1 else 0, "prefix_groups")):
        if divisor and num_requests % divisor:
            raise BenchError(
                f"workload requests={num_requests} is not a multiple of {name}={divisor}"
            )
    if "think_time" in fields and turns == 1:
        raise BenchError("workload think_time is the gap between turns; give turns=T too")
    return groups, prefix_len, turns


def _parse_extra(term: str, text: str) -> tuple[tuple[ExtraValue, float], ...]:
    """``V`` (every request gets V) or ``V:W/V:W...`` (drawn by weight W > 0)."""
    name = term[len(EXTRA_PREFIX) :]
    if not re.fullmatch(r"[A-Za-z_][\w.-]*", name):
        raise BenchError(
            f"workload term {term!r}: the extra field's name must be a letter or _ followed by "
            "letters, digits, _, . or -"
        )
    if ":" not in text:
        pairs = [(_extra_value(text), 1.0)]
    else:
        pairs = []
        for choice in text.split("/"):
            value, sep, weight_text = choice.rpartition(":")
            try:
                weight = float(weight_text)
            except ValueError:
                weight = math.nan
            if not sep or not value or not weight > 0 or math.isinf(weight):
                raise BenchError(
                    f"workload {term}={text!r} is not allowed; give one VALUE, or VALUE:WEIGHT "
                    "pairs joined by '/', weights > 0 (e.g. gold:1/silver:3)"
                )
            pairs.append((_extra_value(value), weight))
    if name == DEADLINE_FIELD and not all(
        isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        for value, _ in pairs
    ):
        raise BenchError(
            f"workload {term}={text!r}: {DEADLINE_FIELD} is the deadline in seconds after "
            "arrival; give numbers > 0"
        )
    return tuple(pairs)


def _extra_value(text: str) -> ExtraValue:
    """A number, true, false or null where ``text`` reads as one in JSON, else the text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    return text


@dataclasses.dataclass(frozen=True, slots=True)
class SweepSpec:
    """``--sweep KEY=V1,V2,...``: ``rate`` (requests/s) or a config key ``station.key``."""

    key: str
    values: tuple[str, ...]

    @property
    def is_rate(self) -> bool:
        return self.key == "rate"

    def rates(self) -> list[float]:
        return [float(value) for value in self.values]


def parse_sweep(text: str) -> SweepSpec:
    """``rate=1,2,4`` or ``scheduler.max_num_batched_tokens=256,512``; values in order."""
    key, sep, rest = text.partition("=")
    key = key.strip()
    values = tuple(v.strip() for v in rest.split(",") if v.strip())
    if not sep or not values or not (key == "rate" or "." in key):
        raise BenchError(
            f"--sweep {text!r} is not allowed; use rate=R1,R2,... or station.key=V1,V2,... "
            "(e.g. scheduler.max_num_batched_tokens=256,512,1024)"
        )
    if len(set(values)) != len(values):
        raise BenchError(f"--sweep {text!r} repeats a value")
    if key == "rate":
        for value in values:
            try:
                rate = float(value)
            except ValueError:
                rate = math.nan
            if not rate > 0 or math.isinf(rate):
                raise BenchError(
                    f"--sweep rate value {value!r} is not allowed; rates are numbers > 0"
                )
    return SweepSpec(key, values)


WORKLOAD_HELP = f"""\
workload grammar:
  {SYNTHETIC_GRAMMAR}
  LEN      fixed:N | uniform:LOW:HIGH | normal:MEAN:STD | lognormal:MEAN:SIGMA
           (prompt default fixed:128, output default fixed:64; outputs ignore EOS)
  rate     requests/s, Poisson; with burstiness=B gamma arrivals (B < 1 burstier);
           no rate: all requests at once
  priorities      LEVEL:WEIGHT pairs, e.g. 0:1/1:4 (lower level runs first under priority)
  prefix_groups=G,prefix_len=P
                  every prompt starts with one of G shared P-token prefixes; prompt=LEN is
                  the part after it; requests must be a multiple of G
  turns=T         requests/T conversations of T turns; each turn's prompt is the previous
                  prompt, its answer and a new message of prompt=LEN tokens; turns arrive
                  think_time seconds apart (default 1); rate is then of new conversations
  extra.KEY=V     every request carries extra data KEY = V (Request.extra; sent as
                  extra_args over HTTP); extra.KEY=V:W/V:W... draws V by weight W per request.
                  V is a number, true, false or null when it reads as one, else text.
                  extra.deadline_s=S: a deadline S seconds after arrival (the report counts
                  misses); --by KEY breaks the report down by KEY's values

  e.g. synthetic:requests=400,prompt=lognormal:512:0.6,output=uniform:32:256,rate=8,burstiness=0.5
       synthetic:requests=256,prefix_groups=4,prefix_len=1024,prompt=uniform:16:64,output=fixed:32
       synthetic:requests=300,turns=3,think_time=2,prompt=fixed:64,output=fixed:64,rate=2
       synthetic:requests=500,rate=20,extra.priority_class=gold:1/bronze:4,extra.deadline_s=5
  A trace is JSONL: {{"arrival_time": s, "prompt_len": n | "prompt_token_ids": [...],
  "output_len": n, "priority": k, "extra": {{"priority_class": "gold", "deadline_s": 2.0}}}}
  per line.
"""
