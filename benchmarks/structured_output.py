"""Structured output overhead: decode tokens/s of a batch where half the requests carry a JSON
schema vs the same batch unconstrained, in one invocation.

Method. A constrained request ends when its grammar completes, so its length is the model's
choice; the two runs are made to generate exactly the same tokens per request instead:

1. A calibration run (also the warm-up) of the mixed batch records each constrained
   request's output length ``L_i`` (greedy, so the same in every run).
2. ``mixed``: requests 0, 2, 4, ... carry the schema (a fixed-shape array of ``--items``
   objects: long, nearly fixed-length answers); the others are unconstrained with
   ``--max-tokens`` and EOS ignored.
3. ``unconstrained``: the same prompts, every request unconstrained with EOS ignored; request
   ``i`` of the constrained half asks for exactly ``L_i`` tokens.

Both runs drive ``EngineCore`` directly with the same stations (core's grammar station over the
``xgrammar`` backend is idle without constrained rows). The clock starts once every request has
its first token, so prefill is left out: decode tok/s = tokens generated after that / time
after that. Grammars are compiled (and cached) before any timed run; the cold compile time is
printed separately. The two timed runs alternate ``--repeats`` times; the table keeps the best
of each, and the ratio of every back-to-back pair is printed too (on a shared machine the noise
between runs can exceed the overhead; the grammar stage's own time is the steadier figure). The
grammar stage's methods (``begin_step``, ``apply``, ``accept_batch``, ``finished_rows``,
``add``) are wrapped with timers during the mixed runs to show where its time goes per decode
step.

    python benchmarks/structured_output.py --model-size tiny
    python benchmarks/structured_output.py --model-size small --repeats 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from offline_throughput import model_dir  # same directory: the shared bench-model cache

from brigade import LLM, SamplingParams
from brigade.interfaces import StructuredOutput

VOCAB = (10, 4000)
"""Token ids drawn for prompts (the bench models' vocabulary, special tokens left out)."""
STAGE_METHODS = ("begin_step", "apply", "accept_batch", "finished_rows", "add")


def schema(items: int) -> dict[str, Any]:
    """An array of exactly ``items`` small records: ~15 tokens each, whatever the model."""
    record = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 100, "maximum": 999},
            "tag": {"type": "string", "pattern": "^[a-z]{6}$"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "tag", "score", "ok"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            "rows": {"type": "array", "items": record, "minItems": items, "maxItems": items}
        },
        "required": ["rows"],
        "additionalProperties": False,
    }


@dataclasses.dataclass
class Result:
    decode_tokens: int
    decode_s: float
    decode_steps: int
    lengths: list[int]
    """Output tokens per request."""
    stage_s: dict[str, float]
    """Seconds spent in each grammar-stage method during the decode phase."""

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s


class StageTimer:
    """Wraps the grammar stage's methods (instance attributes shadow the class's)."""

    def __init__(self, stage: Any) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.enabled = False
        for name in STAGE_METHODS:
            setattr(stage, name, self._wrap(name, getattr(stage, name)))

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return method(*args, **kwargs)
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started

        return timed


def run(
    llm: LLM,
    prompts: list[list[int]],
    params: list[SamplingParams],
    timer: StageTimer,
    tag: str,
) -> Result:
    """Add every request, step to the end; time the steps after every request's first token."""
    engine = llm.engine
    requests = [
        engine.add_request(f"{tag}-{i}", p, sp)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    while any(not r.output_token_ids and not r.is_finished for r in requests):
        engine.step()
    tokens_before = sum(len(r.output_token_ids) for r in requests)
    steps_before = engine.num_steps
    timer.seconds.clear()
    timer.enabled = True
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - started
    timer.enabled = False
    lengths = [len(r.output_token_ids) for r in requests]
    return Result(
        sum(lengths) - tokens_before,
        elapsed,
        engine.num_steps - steps_before,
        lengths,
        dict(timer.seconds),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--requests", type=int, default=32, help="batch size (half constrained)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--items", type=int, default=8, help="records in each JSON answer")
    parser.add_argument("--max-tokens", type=int, default=128, help="unconstrained half")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set", action="append", default=[], help="brigade config override (repeatable)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = model_dir(args.model_size, args.arch)
    llm = LLM(overrides=[f"model.path={path}", "model.dtype=float32", *args.set])
    engine = llm.engine
    stage = engine.grammar
    if stage is None:
        raise SystemExit("this engine has no grammar station (its executor returns token ids)")
    timer = StageTimer(stage)

    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(*VOCAB) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    structured = StructuredOutput("json_schema", json.dumps(schema(args.items)))
    started = time.perf_counter()
    admission = engine.admit(prompts[0], SamplingParams(structured_output=structured))
    admission.grammar.result()  # type: ignore[union-attr]
    compile_s = time.perf_counter() - started
    constrained = [i % 2 == 0 for i in range(args.requests)]
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with_schema = SamplingParams(max_tokens=4096, temperature=0.0, structured_output=structured)
    mixed_params = [with_schema if c else free for c in constrained]

    calibration = run(llm, prompts, mixed_params, timer, "calibrate")
    lengths = calibration.lengths
    for i, c in enumerate(constrained):
        if c and lengths[i] >= with_schema.max_tokens:
            raise SystemExit(f"request {i} was cut at max_tokens; lower --items")
    plain_params = [
        SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True) if c else free
        for i, c in enumerate(constrained)
    ]
    run(llm, prompts, plain_params, timer, "warm")

    best: dict[str, Result] = {}
    paired: list[float] = []
    for repeat in range(args.repeats):
        order = [("unconstrained", plain_params), ("mixed", mixed_params)]
        pair: dict[str, float] = {}
        for label, params in order if repeat % 2 == 0 else order[::-1]:
            result = run(llm, prompts, params, timer, f"{label}-{repeat}")
            if result.lengths != lengths:
                raise SystemExit(f"{label}: output lengths changed between runs")
            pair[label] = result.tokens_per_s
            if label not in best or result.tokens_per_s > best[label].tokens_per_s:
                best[label] = result
        paired.append(pair["mixed"] / pair["unconstrained"])

    plain, mixed = best["unconstrained"], best["mixed"]
    num_constrained = sum(constrained)
    answer_lens = [lengths[i] for i, c in enumerate(constrained) if c]
    print(
        f"model {args.arch}-{args.model_size}, {args.requests} requests x {args.prompt_len} "
        f"prompt tokens, {num_constrained} with a JSON schema ({args.items} records: "
        f"{min(answer_lens)}-{max(answer_lens)} tokens, cold compile {compile_s * 1e3:.0f} ms), "
        f"{args.requests - num_constrained} unconstrained x {args.max_tokens} tokens, "
        f"{args.threads} threads, best of {args.repeats}"
    )
    print()
    print("| batch | decode tokens | decode steps | decode s | tok/s | ms/step |")
    print("|---|---|---|---|---|---|")
    for label, result in (("unconstrained", plain), ("half with JSON schema", mixed)):
        print(
            f"| {label} | {result.decode_tokens} | {result.decode_steps} | "
            f"{result.decode_s:.2f} | {result.tokens_per_s:.1f} | "
            f"{result.decode_s / result.decode_steps * 1e3:.2f} |"
        )
    print()
    ratio = mixed.tokens_per_s / plain.tokens_per_s
    print(f"throughput ratio constrained / unconstrained: {ratio:.3f} ({1 - ratio:+.1%} overhead)")
    print(
        f"ratio of each back-to-back pair: {', '.join(f'{r:.3f}' for r in paired)} "
        f"(median {statistics.median(paired):.3f})"
    )
    print()
    steps = mixed.decode_steps
    total = sum(mixed.stage_s.values())
    print("grammar stage, mixed run (decode phase):")
    print("| method | total ms | ms/step | share of decode time |")
    print("|---|---|---|---|")
    for name in STAGE_METHODS:
        seconds = mixed.stage_s.get(name, 0.0)
        print(
            f"| {name} | {seconds * 1e3:.1f} | {seconds / steps * 1e3:.3f} | "
            f"{seconds / mixed.decode_s:.1%} |"
        )
    print(f"| all | {total * 1e3:.1f} | {total / steps * 1e3:.3f} | {total / mixed.decode_s:.1%} |")


if __name__ == "__main__":
    main()
