"""Prefix caching: the ``radix`` KV manager (1-token pages) vs ``paged`` (16-token pages).

Both run the same locally built model (random weights, 2 layers, fp32, greedy, EOS ignored)
through ``brigade.LLM``'s engine in one invocation, with the same KV capacity in tokens, on two
seeded workloads:

- ``multi-turn``: several conversations interleaved; each turn's prompt is the previous prompt,
  the previous answer and new user text, and all conversations' turn t run as one wave.
- ``branching``: many requests share a long system prompt that ends mid-page, each with its own
  question, submitted in waves (the first wave fills the cache for both managers).

Per workload and manager it prints the prefix hit rate (hit / looked-up tokens, from
``engine.kv.stats()``), the looked-up tokens that missed (prefill left to compute), the mean
time to first token (each request's first token seen in an ``engine.step()`` update, from when
its wave was submitted), generated tokens/s, and the ratios radix/paged (best of ``--repeats``
runs, alternating which manager goes first). A hash chain reuses whole pages only, so every
prompt loses the tail of its shared prefix that does not fill a page; the radix tree reuses
every shared token.

    python benchmarks/prefix_cache.py
    python benchmarks/prefix_cache.py --conversations 16 --turns 6 --branches 96
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from brigade import LLM, SamplingParams
from brigade.models.create import create_model
from brigade.registry import default_registry

PAGED_PAGE_SIZE = 16
VOCAB = (10, 4000)
"""Token ids drawn for prompts (the tiny model's vocabulary, special tokens left out)."""


@dataclasses.dataclass
class Result:
    hit_rate: float
    num_missed_tokens: int
    """Looked-up prompt tokens not found in the cache: the prefill work left to do."""
    mean_ttft_s: float
    tokens_per_s: float


Wave = list[list[int]]
NextWave = Callable[[int, list[list[int]]], Wave | None]
"""(wave index, previous wave's answers) -> the next wave's prompts, or None when done."""


def multi_turn(args: argparse.Namespace) -> NextWave:
    """``--conversations`` conversations sharing a 37-token system prompt, ``--turns`` waves."""
    rng = random.Random(args.seed)
    system = _tokens(rng, 37)
    prompts = [system + _tokens(rng, rng.randint(20, 60)) for _ in range(args.conversations)]

    def next_wave(index: int, answers: list[list[int]]) -> Wave | None:
        if index == args.turns:
            return None
        if index:
            for prompt, answer in zip(prompts, answers, strict=True):
                prompt += answer + _tokens(rng, rng.randint(20, 60))
        return [list(p) for p in prompts]

    return next_wave


def branching(args: argparse.Namespace) -> NextWave:
    """``--branches`` questions after one 199-token system prompt, ``--wave-size`` per wave."""
    rng = random.Random(args.seed + 1)
    system = _tokens(rng, 12 * PAGED_PAGE_SIZE + 7)  # ends 7 tokens into a page
    questions = [_tokens(rng, rng.randint(8, 40)) for _ in range(args.branches)]
    waves = [questions[i : i + args.wave_size] for i in range(0, len(questions), args.wave_size)]

    def next_wave(index: int, answers: list[list[int]]) -> Wave | None:
        return [system + q for q in waves[index]] if index < len(waves) else None

    return next_wave


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(count)]


def run(llm: LLM, next_wave: NextWave, max_tokens: int) -> Result:
    """Submit each wave, step the engine until it is done, and measure the whole run."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = engine.kv.stats()
    ttfts: list[float] = []
    answers: list[list[int]] = []
    generated = index = 0
    started = time.perf_counter()
    while (prompts := next_wave(index, answers)) is not None:
        submitted = time.perf_counter()
        requests = [engine.add_request(f"w{index}-{i}", p, params) for i, p in enumerate(prompts)]
        outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
        remaining = len(requests)
        while remaining:
            for update in engine.step():
                tokens = outputs[update.request.request_id]
                if not tokens:
                    ttfts.append(time.perf_counter() - submitted)
                tokens.extend(update.new_token_ids)
                generated += len(update.new_token_ids)
                remaining -= update.finished
        answers = [outputs[r.request_id] for r in requests]
        index += 1
    elapsed = time.perf_counter() - started
    after = engine.kv.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return Result(
        hits / max(queries, 1), queries - hits, statistics.fmean(ttfts), generated / elapsed
    )


def warm_up(llm: LLM, seed: int) -> None:
    """Run prompts of the workloads' sizes once (random tokens: no later hits on them)."""
    rng = random.Random(seed + 100)
    prompts = [_tokens(rng, length) for length in (8, 64, 256, 512)]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)


def best(results: list[Result]) -> Result:
    """The fastest of repeated runs (hit rates are the same in each)."""
    return Result(
        results[0].hit_rate,
        results[0].num_missed_tokens,
        min(r.mean_ttft_s for r in results),
        max(r.tokens_per_s for r in results),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--branches", type=int, default=48)
    parser.add_argument("--wave-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24, help="answer length")
    parser.add_argument("--pool-tokens", type=int, default=16384, help="KV capacity in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="runs per manager; best kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1 is steadiest on a busy host)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    registry = default_registry()
    kv_settings = {
        f"paged/{PAGED_PAGE_SIZE}": [
            f"kv.page_size={PAGED_PAGE_SIZE}",
            f"kv.num_pages={args.pool_tokens // PAGED_PAGE_SIZE}",
        ],
        "radix/1": ['kv.plugin="radix"', "kv.page_size=1", f"kv.num_pages={args.pool_tokens}"],
    }
    workloads = {"multi-turn": multi_turn, "branching": branching}
    with tempfile.TemporaryDirectory() as root:
        model = create_model(Path(root) / "llama", "llama", overrides={"num_hidden_layers": 2})
        base = [f"model.path={model}", "model.dtype=float32", "scheduler.max_num_seqs=64"]
        header = ("workload", "kv/page", "hit rate", "prefill", "TTFT ms", "tok/s")
        print("{:<11} {:<9} {:>8} {:>8} {:>8} {:>8}".format(*header))
        for workload, make in workloads.items():
            runs: dict[str, list[Result]] = {name: [] for name in kv_settings}
            for repeat in range(args.repeats):
                # Alternate the order, so neither manager always runs on a colder process.
                for name in sorted(kv_settings, reverse=bool(repeat % 2)):
                    llm = LLM(overrides=[*base, *kv_settings[name]], registry=registry)
                    warm_up(llm, args.seed)
                    runs[name].append(run(llm, make(args), args.max_tokens))
            results = {name: best(found) for name, found in runs.items()}
            for name, r in results.items():
                print(
                    f"{workload:<11} {name:<9} {r.hit_rate:>8.1%} {r.num_missed_tokens:>8} "
                    f"{1e3 * r.mean_ttft_s:>8.1f} {r.tokens_per_s:>8.0f}"
                )
            radix, paged = results["radix/1"], results[f"paged/{PAGED_PAGE_SIZE}"]
            ratios = (
                radix.hit_rate / paged.hit_rate,
                radix.num_missed_tokens / paged.num_missed_tokens,
                radix.mean_ttft_s / paged.mean_ttft_s,
                radix.tokens_per_s / paged.tokens_per_s,
            )
            cells = " ".join(f"{ratio:>7.2f}x" for ratio in ratios)
            print(f"{workload:<11} {'ratio':<9} {cells}   (radix / paged)")


if __name__ == "__main__":
    main()
