"""Core's own cost per engine step: scheduling, the persistent batch, sampling bookkeeping.

Runs the real engine on the ``simulated`` executor (no weights: it answers token ids at once),
so what is timed is everything core and the CPU-side stations do around a forward pass:
the scheduler and its policy, the KV manager, the persistent batch's ``ModelInput``, accounting
and output bookkeeping. For A/B runs of two checkouts (each with its own venv), in turn, on
an idle machine:

    python benchmarks/engine_overhead.py 256 128 64          # 256 requests, 128 -> 64 tokens
    python benchmarks/engine_overhead.py 256 128 64 scheduler.plugin=priority

Prints the steps, the wall time of the step loop and microseconds per step; further
arguments are config overrides. The model is examples/ab/llama-3-70b (a config.json only).
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from brigade.config import load_config
from brigade.engine import EngineCore
from brigade.interfaces import SamplingParams
from brigade.registry import load_registry

MODEL = Path(__file__).resolve().parents[1] / "examples" / "ab" / "llama-3-70b"


def main() -> None:
    num_requests, prompt_len, output_len = (int(value) for value in sys.argv[1:4])
    registry = load_registry()
    overrides = [
        f"model.path={MODEL}",
        "executor.plugin=simulated",
        "executor.num_gpus=4",
        "scheduler.max_num_seqs=128",
        "scheduler.max_num_batched_tokens=4096",
        "kv.page_size=16",
        "kv.num_pages=8192",
        *sys.argv[4:],
    ]
    engine = EngineCore(load_config(None, registry, overrides=overrides), registry)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for index in range(num_requests):
        prompt = [rng.randrange(100, 30000) for _ in range(prompt_len)]
        engine.add_request(str(index), prompt, params)
    steps, tokens = 0, 0
    started = time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(update.new_token_ids) for update in engine.step())
        steps += 1
    elapsed = time.perf_counter() - started
    assert tokens == num_requests * output_len, tokens
    print(
        f"steps {steps}  tokens {tokens}  wall {elapsed:.3f} s  {elapsed / steps * 1e6:.0f} us/step"
    )


if __name__ == "__main__":
    main()
