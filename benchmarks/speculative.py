"""Speculative decoding against plain decoding, same run, same model, same prompts.

Runs the default model (SmolLM2-135M-Instruct, fp32) with speculation off and with each
proposer named in ``--proposers``, alternating engines round by round, and prints generated
tokens/s, the ratio to plain decoding, the acceptance rate (accepted / verified drafts) and the
mean accepted length (tokens emitted per verifying request-step), per workload and batch size:

- ``edit``: chat requests that hand the model a piece of code or text and ask for it back with
  a small change, so the output repeats the input (what prompt lookup is for);
- ``free``: open questions, whose answers repeat little (speculation must not cost much).

Greedy, each request until EOS or ``--max-tokens``; every engine must produce the same tokens
(the script checks and says where one differs). Batch 1 runs the prompts one at a time; batch
B runs B requests at once (the prompts repeated to fill the batch). Each pass starts with a
fresh proposer, so ``suffix`` learns only from the requests of that pass (``draft-model``
keeps its loaded model), and the engines' order reverses every other round.

``draft-model`` drafts with ``--draft-model`` (default: the served model itself, whose drafts
are all accepted: what the mechanism costs when drafts are free of mistakes but not of time).

    python benchmarks/speculative.py                           # ngram and suffix, batch 1, 8, 32
    python benchmarks/speculative.py --proposers ngram --batch-sizes 1 --rounds 3
    python benchmarks/speculative.py --set speculative.num_speculative_tokens=8
    python benchmarks/speculative.py --proposers draft-model --draft-model PATH
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence

import torch
from step_profile import cpu_flags  # benchmarks/ is this script's directory

from brigade import LLM, SamplingParams
from brigade.plugins.proposers.draft_model import DraftModelProposer

CODE = [
    '''def moving_average(values, window):
    """Return the moving averages of values over window items."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
''',
    """class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise KeyError(name)
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())
""",
    """def parse_config(lines):
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        config[key.strip()] = value.strip()
    return config
""",
    """def binary_search(items, target):
    low, high = 0, len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1
""",
]
TEXT = [
    "The old lighthouse stood at the end of the harbour for more than a hundred years. Every "
    "night its keeper climbed the narrow stairs, lit the lamp and watched the ships pass "
    "safely between the rocks. When the town built a new electric light, the keeper stayed "
    "on, because the people said the harbour would not feel like home without him.",
    "Our team meets every Monday at nine to plan the week. Each person says what they "
    "finished, what they will work on next and what is blocking them. The meeting lasts "
    "fifteen minutes, and anything that needs a longer discussion is moved to a separate "
    "call later in the day.",
]
EDIT_PROMPTS = [
    *(
        f"Rename every variable called `total` or `items` to a clearer name, change nothing "
        f"else, and write out the whole code:\n\n{code}"
        for code in CODE[:2]
    ),
    *(
        f"Add a one-line comment above each line of this code and write out the whole code:"
        f"\n\n{code}"
        for code in CODE[2:]
    ),
    *(
        f"Correct any spelling mistakes in this text and write the whole text out again:\n\n{text}"
        for text in TEXT
    ),
]
FREE_PROMPTS = [
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Give me three ideas for a weekend trip with friends.",
    "What are the pros and cons of working from home?",
    "Describe how a bicycle works.",
    "Write a short poem about autumn leaves.",
    "How do I make a good cup of tea?",
]
WORKLOADS = {"edit": EDIT_PROMPTS, "free": FREE_PROMPTS}


@dataclasses.dataclass
class Tally:
    seconds: float = 0.0
    tokens: int = 0
    drafts: int = 0
    accepted: int = 0
    verifications: int = 0


def spec_counters(llm: LLM) -> tuple[int, int, int]:
    stats = llm.engine.stats().speculative
    if stats is None:
        return 0, 0, 0
    return stats.num_drafts, stats.num_accepted, stats.num_verifications


def fresh_proposer(llm: LLM) -> None:
    """A new proposer for the next pass: ``suffix`` would otherwise draft a repeated prompt's
    whole answer from the pass before (a cache of identical requests, not what it does for
    new ones)."""
    speculation = llm.engine.speculation
    if speculation is not None and not isinstance(speculation.proposer, DraftModelProposer):
        old = speculation.proposer
        speculation.proposer = type(old)(old.params, old.options)


def run_once(
    llm: LLM, prompts: Sequence[str], batch: int, params: SamplingParams
) -> tuple[float, list[list[int]], tuple[int, int, int]]:
    """Seconds, each request's tokens and the speculation counters' growth for one pass."""
    fresh_proposer(llm)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    before = spec_counters(llm)
    outputs: list[list[int]] = []
    started = time.perf_counter()
    if batch == 1:
        for message in messages:
            result = llm.chat([message], params, use_tqdm=False)
            outputs.append(list(result[0].outputs[0].token_ids))
    else:
        filled = [messages[i % len(messages)] for i in range(batch)]
        results = llm.chat(filled, params, use_tqdm=False)
        outputs = [list(r.outputs[0].token_ids) for r in results]
    seconds = time.perf_counter() - started
    after = spec_counters(llm)
    return seconds, outputs, (after[0] - before[0], after[1] - before[1], after[2] - before[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proposers", default="ngram,suffix")
    parser.add_argument("--workloads", default="edit,free")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="timed passes per engine")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="default")
    parser.add_argument(
        "--draft-model", default="", help="the draft-model proposer's model (default: --model)"
    )
    parser.add_argument("--set", action="append", default=[], help="a brigade setting, a.b=c")
    parser.add_argument(
        "--control",
        action="store_true",
        help="add a second engine without speculation (off-2): its ratio to off shows what "
        "engine placement and drift alone do",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = [
        f"model.path={args.model}",
        "model.dtype=float32",
        "kv.max_memory_gib=1",
        "scheduler.max_num_seqs=64",
        *args.set,
    ]
    names = ["off", *args.proposers.split(","), *(["off-2"] if args.control else [])]
    draft = [f"speculative.model={args.draft_model or args.model}"]
    engines = {
        name: LLM(
            overrides=base
            if name.startswith("off")
            else [*base, f"speculative.plugin={name}", *(draft if name == "draft-model" else [])]
        )
        for name in names
    }
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    print(f"{cpu_flags()}; torch {torch.__version__}, {args.threads} threads, fp32, {args.model}")
    print(f"greedy, up to {args.max_tokens} tokens per request, {args.rounds} timed rounds")
    width = max(8, *map(len, names))
    header = f"{'workload':<8} {'batch':>5} {'engine':<{width}} {'tok/s':>8} {'vs off':>7}"
    print(f"{header} {'accept':>7} {'mean len':>8}")
    for workload in args.workloads.split(","):
        prompts = WORKLOADS[workload]
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            tallies = {name: Tally() for name in names}
            outputs: dict[str, list[list[int]]] = {}
            for name in names:  # warm-up pass: compiles, caches, first-touch of pages
                run_once(engines[name], prompts[:1], 1, SamplingParams(max_tokens=8))
            for round_index in range(args.rounds):
                # Reverse the order every other round: drift favours no engine.
                for name in names if round_index % 2 == 0 else names[::-1]:
                    seconds, tokens, (drafts, accepted, verifications) = run_once(
                        engines[name], prompts, batch, params
                    )
                    tally = tallies[name]
                    tally.seconds += seconds
                    tally.tokens += sum(map(len, tokens))
                    tally.drafts += drafts
                    tally.accepted += accepted
                    tally.verifications += verifications
                    outputs[name] = tokens
            plain = tallies["off"].tokens / tallies["off"].seconds
            for name in names:
                tally = tallies[name]
                rate = tally.tokens / tally.seconds
                accept = tally.accepted / tally.drafts if tally.drafts else 0.0
                mean = (
                    (tally.accepted + tally.verifications) / tally.verifications
                    if tally.verifications
                    else 0.0
                )
                same = "" if outputs[name] == outputs["off"] else "  (tokens differ from off)"
                print(
                    f"{workload:<8} {batch:>5} {name:<{width}} {rate:>8.1f} {rate / plain:>6.2f}x "
                    f"{accept:>7.2f} {mean:>8.2f}{same}"
                )


if __name__ == "__main__":
    main()
