"""What ``benchmarks/peers.py`` and its engine drivers exchange; standard library only.

Every driver runs in its engine's own venv as ``python DRIVER JOB.json RESULT.json``. The job names
the checkpoint, the thread count, the dtype, whether prefix caching is on, the engine's options and
the workloads; the driver times each workload and rewrites the result file after each one, so a
driver that crashes or is killed still leaves the workloads it finished.

A workload is a warm-up batch and timed runs (fresh prompts each, same shapes). A run of kind
``throughput`` is one call on the whole batch; a run of kind ``latency`` is two calls on the
same one-prompt batch, one asking for a single token and one for the full output, so that
decode time = full - first, whatever the engine. The tokens of the first timed run's
``sample`` requests come back for the correctness check.

Taking turns: when ``peers.py`` runs several engines side by side it starts them all and lets
one run at a time, so that a machine whose speed drifts over minutes slows every engine alike.
It then passes two pipe descriptors in ``PEERS_TURN_FDS`` ("read,write"): the driver says
``loaded`` once its engine is up, then, before every warm-up and every timed run, waits for a
line on the read end and answers ``done`` on the write end when that call is over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["Batch", "Job", "run_job"]


@dataclasses.dataclass(frozen=True)
class Batch:
    """One engine call: prompts as token ids and the exact number of tokens each must get."""

    prompts: list[list[int]]
    output_lens: list[int]
    shared_prefix_len: int = 0
    """Leading tokens every prompt shares (0: none); engines that cache prefixes find them
    themselves, the llama.cpp driver reuses them through its sequence-copy API."""

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    kind: str
    """``throughput`` or ``latency`` (see the module docstring)."""
    warmup: Batch
    runs: list[Batch]
    sample: list[int]
    """Indices of the requests of ``runs[0]`` whose tokens are returned."""


@dataclasses.dataclass(frozen=True)
class Job:
    engine: str
    model: dict[str, Any]
    """``hf_dir``, ``gguf`` (F32), ``brigade_path`` and ``vocab_size``."""
    threads: int
    prefix_caching: bool
    dtype: str
    """``float32`` or ``bfloat16``: weights, activations and KV cache."""
    options: dict[str, Any]
    workloads: list[Workload]

    @property
    def max_seq_len(self) -> int:
        """The longest prompt + output of any batch in the job."""
        return max(
            len(prompt) + output
            for workload in self.workloads
            for batch in [workload.warmup, *workload.runs]
            for prompt, output in zip(batch.prompts, batch.output_lens, strict=True)
        )


Generate = Callable[[Batch], list[list[int]]]
"""Run one batch to completion; return each request's generated token ids, in order."""


def load_job(path: str) -> Job:
    data = json.loads(Path(path).read_text())
    workloads = [
        Workload(
            name=w["name"],
            kind=w["kind"],
            warmup=Batch(**w["warmup"]),
            runs=[Batch(**run) for run in w["runs"]],
            sample=list(w["sample"]),
        )
        for w in data["workloads"]
    ]
    return Job(
        engine=data["engine"],
        model=data["model"],
        threads=int(data["threads"]),
        prefix_caching=bool(data["prefix_caching"]),
        dtype=str(data.get("dtype", "float32")),
        options=dict(data.get("options", {})),
        workloads=workloads,
    )


def _timed(generate: Generate, batch: Batch) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    outputs = generate(batch)
    elapsed = time.perf_counter() - started
    got = [len(tokens) for tokens in outputs]
    if got != batch.output_lens:
        raise RuntimeError(
            f"the engine returned {sum(got)} tokens in {len(got)} outputs, expected "
            f"{batch.num_output_tokens} in {len(batch.output_lens)} (EOS must be ignored)"
        )
    return elapsed, outputs


def _first_token_batch(batch: Batch) -> Batch:
    return dataclasses.replace(batch, output_lens=[1] * len(batch.output_lens))


class Turns:
    """The driver's side of taking turns (see the module docstring); without
    ``PEERS_TURN_FDS`` every call runs at once."""

    def __init__(self) -> None:
        fds = os.environ.get("PEERS_TURN_FDS")
        self.taken = bool(fds)
        """Whether calls wait for turns (the engine is stopped between them)."""
        self._go = self._done = None
        if fds:
            read, write = (int(fd) for fd in fds.split(","))
            self._go = os.fdopen(read, "r")
            self._done = os.fdopen(write, "w")

    def say(self, word: str) -> None:
        if self._done is not None:
            self._done.write(word + "\n")
            self._done.flush()

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Wait for this engine's turn, run the body, then say ``done`` (``failed`` if it
        raised: the parent gives this engine no more turns of the workload)."""
        if self._go is not None and not self._go.readline():
            raise SystemExit(0)  # the parent has gone
        try:
            yield
        except BaseException:
            self.say("failed")
            raise
        self.say("done")


def run_workload(generate: Generate, workload: Workload, turns: Turns) -> dict[str, Any]:
    """Warm up, then time every run; the figures and sampled tokens as JSON-able values."""
    latency = workload.kind == "latency"
    with turns.turn():
        if latency:
            _timed(generate, _first_token_batch(workload.warmup))
        _timed(generate, workload.warmup)
    seconds: list[float] = []
    first_token_seconds: list[float] = []
    sampled: dict[str, list[int]] = {}
    for index, batch in enumerate(workload.runs):
        with turns.turn():
            if turns.taken:  # woken from SIGSTOP: one untimed call first, as after a warm-up
                _timed(generate, _first_token_batch(workload.warmup))
            if latency:
                first_token_seconds.append(_timed(generate, _first_token_batch(batch))[0])
            elapsed, outputs = _timed(generate, batch)
        seconds.append(elapsed)
        if index == 0:
            sampled = {str(i): outputs[i] for i in workload.sample}
    result: dict[str, Any] = {
        "seconds": seconds,
        "output_tokens": workload.runs[0].num_output_tokens,
        "tokens": sampled,
    }
    if latency:
        result["first_token_seconds"] = first_token_seconds
    return result


def run_job(
    load_engine: Callable[[Job], tuple[Generate, dict[str, Any]]],
) -> None:
    """The driver's ``main``: load the engine, run each workload, write results as they come.

    ``load_engine`` returns the batch runner and facts about the engine (versions, the settings
    it ran with) that the report prints; the runner may update the facts as it goes (they are
    written again after each workload).
    """
    job_path, result_path = sys.argv[1], sys.argv[2]
    job = load_job(job_path)
    result: dict[str, Any] = {"engine": job.engine, "workloads": {}}

    def write() -> None:  # whole or not at all: the driver may be killed at any moment
        partial = Path(result_path + ".partial")
        partial.write_text(json.dumps(result))
        os.replace(partial, result_path)

    turns = Turns()
    started = time.perf_counter()
    generate, facts = load_engine(job)
    result["startup_s"] = time.perf_counter() - started
    result["facts"] = facts
    write()
    turns.say("loaded")
    for workload in job.workloads:
        print(f"[{job.engine}] {workload.name} ...", file=sys.stderr, flush=True)
        try:
            result["workloads"][workload.name] = run_workload(generate, workload, turns)
        except Exception:  # report it and go on: the other workloads may still run
            result["workloads"][workload.name] = {"error": traceback.format_exc(limit=8)}
        write()
