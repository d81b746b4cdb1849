"""Where one engine step's time goes: a decode step at batch 32 and a 512-token prefill.

Runs the real engine (scheduler, persistent batch, executor, sampler) on the default model
(SmolLM2-135M-Instruct) or a random Llama, profiles a few steps with ``torch.profiler`` and
prints each step's wall time split into GEMMs, attention, other tensor ops, the sampler and
what no tensor op accounts for (Python, batch preparation, scheduling), then the top ops.

    python benchmarks/step_profile.py                       # SmolLM2, fp32, 2 threads
    python benchmarks/step_profile.py --model small          # the random Llama "small"
    python benchmarks/step_profile.py --set attention.native_decode=false
    python benchmarks/step_profile.py --set model.dtype=bfloat16
    python benchmarks/step_profile.py --mixed                # the mixed workload, by step kind
    python benchmarks/step_profile.py --mixed --profile-mixed 2   # and two mixed steps by op
    python benchmarks/step_profile.py --context 448 --shared-prefix 384   # a shared system prompt

``--mixed`` runs ``benchmarks/peers.py``'s mixed workload (128 requests, prompts 16-512, outputs
16-256) through ``LLM.generate`` and splits the executor's time by kind of step: pure decode
steps (by rows), mixed steps (prefill chunks beside decodes) and pure prefills.
"""

from __future__ import annotations

import argparse
import collections
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from brigade import LLM, SamplingParams

CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "gemm",
        (
            "aten::mm",
            "aten::addmm",
            "aten::linear",
            "aten::matmul",
            "aten::bmm",
            "mkldnn",
            "panel",
            "tile_",
        ),
    ),
    ("fused decode layers (attention, norms, RoPE, SiLU)", ("decode_layers",)),
    (
        "attention",
        (
            "scaled_dot_product",
            "attention",
            "paged_decode",
            "paged_prefill",
            "index_select",
            "index_copy",
            "aten::gather",
        ),
    ),
    ("sampler", ("sample", "softmax", "argmax", "aten::max", "topk", "exponential", "uniform")),
)
"""Op-name fragments -> category (first match wins); everything else is "other ops"."""


def cpu_flags() -> str:
    """The CPU model and its vector extensions (figures only compare within one machine)."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return f"{model} [{' '.join(f for f in wanted if f in flags) or 'no AVX2'}]"


def make_llm(model: str, settings: Sequence[str]) -> LLM:
    path = "default" if model == "smollm2" else _random_model(model)
    return LLM(
        overrides=[
            f"model.path={path}",
            "model.dtype=float32",
            "kv.num_pages=4096",
            "kv.enable_prefix_caching=false",
            *settings,
        ]
    )


def _random_model(size: str) -> str:
    import os
    from pathlib import Path

    from brigade.models.create import create_model

    root = Path(os.environ.get("BRIGADE_CACHE_DIR", Path.home() / ".cache" / "brigade"))
    path = root / "bench" / f"llama-{size}"
    if not (path / "model.safetensors").exists():
        create_model(path, "llama", size)
    return str(path)


def decode_steps(
    llm: LLM, batch: int, prompt_len: int, steps: int, shared: int = 0
) -> Callable[[], None]:
    """Queue ``batch`` requests (their prompts starting with the same ``shared`` tokens), run
    their prefills; return a function doing one decode step."""
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=prompt_len + 4 * steps, temperature=0.0, ignore_eos=True)
    prefix = [rng.randrange(10, engine.vocab_size) for _ in range(shared)]
    for index in range(batch):
        prompt = prefix + [rng.randrange(10, engine.vocab_size) for _ in range(prompt_len - shared)]
        engine.add_request(f"decode-{index}", prompt, params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    return lambda: _step(llm)


def _step(llm: LLM) -> None:
    with record_function("engine.step"):
        llm.engine.step()


def profile_steps(step: Callable[[], None], repeats: int) -> tuple[float, Any]:
    """Mean wall ms of ``repeats`` calls after two warm-ups, and the profile of those calls."""
    step()
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(repeats):
            step()
        wall_ms = (time.perf_counter() - started) * 1e3 / repeats
    return wall_ms, prof


def breakdown(prof: Any, wall_ms: float, repeats: int) -> list[tuple[str, float]]:
    """(category, ms per step) by self CPU time, plus the time no op accounts for."""
    totals: dict[str, float] = collections.defaultdict(float)
    for event in prof.key_averages():
        if event.key == "engine.step":
            continue
        name = event.key.lower()
        category = next(
            (label for label, parts in CATEGORIES if any(p in name for p in parts)), "other ops"
        )
        totals[category] += event.self_cpu_time_total / 1e3 / repeats
    accounted = sum(totals.values())
    labels = [label for label, _ in CATEGORIES if label != "sampler"] + ["other ops"]
    rows = [(label, totals.get(label, 0.0)) for label in labels]
    rows.append(("sampler", totals.get("sampler", 0.0)))
    rows.append(("python, batch prep, scheduler (untimed by ops)", max(0.0, wall_ms - accounted)))
    return rows


def report(title: str, wall_ms: float, prof: Any, repeats: int, top: int) -> None:
    print(f"\n== {title}: {wall_ms:.1f} ms per step")
    for label, ms in breakdown(prof, wall_ms, repeats):
        print(f"  {label:<52} {ms:8.2f} ms  {100 * ms / wall_ms:5.1f}%")
    print(f"  top {top} ops by self CPU time (ms per step):")
    events = sorted(
        (e for e in prof.key_averages() if e.key != "engine.step"),
        key=lambda e: e.self_cpu_time_total,
        reverse=True,
    )
    for event in events[:top]:
        print(
            f"    {event.key[:60]:<60} {event.self_cpu_time_total / 1e3 / repeats:8.2f}"
            f"  x{event.count // repeats}"
        )


def mixed_by_kind(llm: LLM, seed: int, profiled: int = 0, top: int = 12) -> None:
    """peers.py's mixed workload through ``LLM.generate``, the executor's time by step kind;
    with ``profiled``, also the per-op breakdown of that many of its mixed steps (from the
    fourth on: prefill chunks of later prompts beside running decodes)."""
    from peer_setup import make_workload  # benchmarks/ is this script's directory

    workload = make_workload("mixed", llm.engine.vocab_size, seed, 1.0, None, 0)
    batch = workload["runs"][0]
    executor = llm.engine.executor
    execute = executor.execute
    stats: dict[tuple[str, int], list[float]] = collections.defaultdict(lambda: [0, 0.0, 0, 0])

    profiles: list[tuple[float, int, int, Any]] = []
    mixed_seen = 0

    def timed(step_batch: Any) -> Any:
        nonlocal mixed_seen
        tokens, rows, decodes = (
            step_batch.input_ids.shape[0],
            step_batch.num_reqs,
            step_batch.num_decodes,
        )
        mixed_seen += 0 < decodes < tokens
        if 0 < decodes < tokens and 4 <= mixed_seen < 4 + profiled:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                started = time.perf_counter()
                out = execute(step_batch)
                elapsed = time.perf_counter() - started
            profiles.append((elapsed * 1e3, tokens, decodes, prof))
        else:
            started = time.perf_counter()
            out = execute(step_batch)
            elapsed = time.perf_counter() - started
        if tokens == decodes:
            key = ("decode steps, rows", min(rows // 32 * 32, 96))
        else:
            key = ("prefill steps" if decodes == 0 else "mixed steps (prefill + decode)", 0)
        entry = stats[key]
        entry[0] += 1
        entry[1] += elapsed
        entry[2] += tokens
        entry[3] += rows
        return out

    def params(lengths: list[int]) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]

    warmup = workload["warmup"]
    llm.generate(warmup["prompts"], params(warmup["output_lens"]), use_tqdm=False)
    executor.execute = timed  # type: ignore[method-assign]
    started = time.perf_counter()
    llm.generate(batch["prompts"], params(batch["output_lens"]), use_tqdm=False)
    wall = time.perf_counter() - started
    executor.execute = execute  # type: ignore[method-assign]
    total = sum(batch["output_lens"])
    busy = sum(entry[1] for entry in stats.values())
    print(f"\n== mixed workload: {len(batch['prompts'])} requests, {total} new tokens")
    print(
        f"  {wall:.1f} s, {total / wall:.1f} tok/s; executor {busy:.1f} s"
        f" ({100 * busy / wall:.0f}%)"
    )
    for (kind, rows), (count, elapsed, tokens, num_rows) in sorted(stats.items()):
        label = kind
        if kind.startswith("decode"):
            label += f" {rows}+" if rows == 96 else f" {rows}-{rows + 31}"
        print(
            f"  {label:<36} {count:4d} steps {elapsed:7.2f} s ({100 * elapsed / wall:4.1f}%)"
            f"  {1e3 * elapsed / count:7.1f} ms/step, {tokens / count:5.0f} tokens,"
            f" {num_rows / count:4.0f} rows per step"
        )
    for wall_ms, tokens, decodes, prof in profiles:
        report(f"mixed step of {tokens} tokens ({decodes} decodes)", wall_ms, prof, 1, top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "tiny", "small"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=128, help="decode rows' prompt length")
    parser.add_argument("--prefill", type=int, default=512, help="prefill length")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--set", action="append", default=[], help="brigade config override")
    parser.add_argument(
        "--mixed", action="store_true", help="peers.py's mixed workload, time by step kind"
    )
    parser.add_argument("--seed", type=int, default=0, help="the mixed workload's seed")
    parser.add_argument(
        "--profile-mixed",
        type=int,
        default=0,
        metavar="N",
        help="with --mixed: the per-op breakdown of N of its mixed steps",
    )
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="decode rows' prompts start with this many common tokens (prefix caching on)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    caching = ["kv.enable_prefix_caching=true"] if args.shared_prefix else []
    llm = make_llm(args.model, [*caching, *args.set])
    dtype = str(llm.engine.executor.dtype).removeprefix("torch.")
    print(f"{cpu_flags()}; torch {torch.__version__}, {args.threads} threads, {dtype}")
    print(f"model {llm.engine.checkpoint.name}; settings {args.set or 'defaults'}")
    if args.mixed:
        mixed_by_kind(llm, args.seed, args.profile_mixed, args.top)
        return

    step = decode_steps(llm, args.batch, args.context, args.repeats + 2, args.shared_prefix)
    wall_ms, prof = profile_steps(step, args.repeats)
    shared = f" ({args.shared_prefix} shared)" if args.shared_prefix else ""
    report(
        f"decode step, batch {args.batch} x context {args.context}{shared}",
        wall_ms,
        prof,
        args.repeats,
        args.top,
    )
    print(f"  = {1e3 * args.batch / wall_ms:.0f} tok/s at this batch")
    for request_id in list(llm.engine.requests):
        llm.engine.abort_request(request_id)

    rng = random.Random(1)
    engine = llm.engine
    counter = iter(range(10**6))

    def prefill() -> None:
        prompt = [rng.randrange(10, engine.vocab_size) for _ in range(args.prefill)]
        engine.add_request(
            f"prefill-{next(counter)}", prompt, SamplingParams(max_tokens=1, temperature=0.0)
        )
        _step(llm)

    wall_ms, prof = profile_steps(prefill, max(2, args.repeats // 2))
    report(f"prefill of {args.prefill} tokens", wall_ms, prof, max(2, args.repeats // 2), args.top)


if __name__ == "__main__":
    main()
