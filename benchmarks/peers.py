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
the machine's drift over minutes (25-30% seen here) slows them alike; ``--no-interleave`` runs
them one after the other instead. A peer whose venv is missing is skipped with a line saying
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

The first three run with prefix caching off. Every run, warm-ups included, draws fresh prompt
tokens (same lengths), so no run hits a cache left by another except the shared prefix;
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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from peer_turns import run_group

REPO = Path(__file__).resolve().parent.parent
DRIVERS = Path(__file__).resolve().parent / "peer_drivers"
ENGINES = ("brigade", "transformers", "vllm", "llamacpp")
WORKLOADS = ("uniform", "mixed", "batch1", "shared-prefix")
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
LOG_TAIL_LINES = 25
JOB_GROUPS = {"plain": "prefix caching off", "prefix": "prefix caching on"}
"""Each engine runs in two jobs, keyed so in the facts."""
NOISY_SHARE = 0.05
"""A run during which other processes used more of the CPU than this is marked noisy."""


# --- checkpoints -----------------------------------------------------------------------------


GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16"}
"""``--dtype`` -> the GGUF tensor type llama.cpp reads."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    name: str
    hf_dir: Path
    brigade_path: str
    """What Brigade's ``model.path`` gets: ``default`` (the GGUF) or the HF folder."""
    config: dict[str, Any]

    def describe(self) -> str:
        c = self.config
        return (
            f"{self.name}: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
            f"heads {c['num_attention_heads']}/{c.get('num_key_value_heads')}, "
            f"vocab {c['vocab_size']}"
        )

    def gguf(self, dtype: str) -> Path:
        """The GGUF of the weights in ``dtype`` (written from the HF folder on first use)."""
        tensor_type = GGUF_TYPES[dtype]
        path = self.hf_dir.parent / f"{self.name}-{tensor_type.lower()}.gguf"
        if not path.exists():
            from brigade.testing.gguf_export import write_gguf

            partial = path.with_name(path.name + ".partial")
            write_gguf(self.hf_dir, partial, tensor_type=tensor_type)
            partial.rename(path)
        return path

    def as_job(self, dtype: str) -> dict[str, Any]:
        return {
            "hf_dir": str(self.hf_dir),
            "gguf": str(self.gguf(dtype)),
            "brigade_path": self.brigade_path,
            "vocab_size": self.config["vocab_size"],
        }


def cache_root() -> Path:
    env = os.environ.get("BRIGADE_CACHE_DIR")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "brigade"
    return root / "peers"


def prepare_checkpoint(name: str) -> Checkpoint:
    """The model's HF folder and F32 GGUF, built on first use (in a temporary folder, renamed)."""
    root = cache_root() / name
    done = root / ".complete"
    if not done.exists():
        print(f"building the {name} checkpoint under {root} (once) ...", file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)
        partial = root.with_name(root.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        _write_hf_folder(name, partial / "hf")
        (partial / ".complete").touch()
        partial.rename(root)
    config = json.loads((root / "hf" / "config.json").read_text())
    brigade_path = "default" if name == "smollm2" else str(root / "hf")
    return Checkpoint(name, root / "hf", brigade_path, config)


def _write_hf_folder(name: str, out: Path) -> None:
    if name != "smollm2":
        from brigade.models.create import create_model

        create_model(out, "llama", name)
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from brigade.models.checkpoint import default_model_file

    gguf = default_model_file()
    model: Any = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # transformers refuses to save a GGUF-loaded model until it forgets the quantization;
    # the weights are already dequantized to fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


# --- workloads -------------------------------------------------------------------------------


def _scaled(value: int, scale: float, floor: int = 2) -> int:
    return max(floor, round(value * scale))


def _ids(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(10, vocab_size) for _ in range(count)]


def _batch(
    prompt_lens: list[int],
    output_lens: list[int],
    rng: random.Random,
    vocab_size: int,
    prefix: list[int] | None = None,
) -> dict[str, Any]:
    head = prefix or []
    return {
        "prompts": [head + _ids(rng, n, vocab_size) for n in prompt_lens],
        "output_lens": list(output_lens),
        "shared_prefix_len": len(head),
    }


def make_workload(
    name: str, vocab_size: int, seed: int, scale: float, repeats: int | None, check: int
) -> dict[str, Any]:
    """A workload as the drivers' protocol takes it: a warm-up batch and timed runs."""
    shape_rng = random.Random(f"{seed}-{name}-shape")
    prefix: list[int] | None = None
    if name == "uniform":
        count = _scaled(32, scale, 1)
        prompt_lens, output_lens = [_scaled(128, scale)] * count, [_scaled(128, scale)] * count
        warmup_count, default_repeats, kind = count, 3, "throughput"
    elif name == "mixed":
        count = _scaled(128, scale, 1)
        prompt_lens = [_scaled(shape_rng.randint(16, 512), scale) for _ in range(count)]
        output_lens = [_scaled(shape_rng.randint(16, 256), scale) for _ in range(count)]
        warmup_count, default_repeats, kind = max(1, count // 8), 1, "throughput"
    elif name == "batch1":
        count, prompt_lens, output_lens = 1, [_scaled(128, scale)], [_scaled(256, scale)]
        warmup_count, default_repeats, kind = 1, 3, "latency"
    elif name == "shared-prefix":
        count = _scaled(32, scale, 1)
        prefix = _ids(shape_rng, _scaled(384, scale), vocab_size)
        prompt_lens, output_lens = [_scaled(32, scale)] * count, [_scaled(64, scale)] * count
        warmup_count, default_repeats, kind = count, 3, "throughput"
    else:
        raise SystemExit(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    num_runs = repeats or default_repeats

    def run(index: int, size: int) -> dict[str, Any]:
        rng = random.Random(f"{seed}-{name}-run{index}")
        return _batch(prompt_lens[:size], output_lens[:size], rng, vocab_size, prefix)

    step = max(1, count // check) if check else count + 1
    return {
        "name": name,
        "kind": kind,
        "warmup": run(0, warmup_count),
        "runs": [run(i, count) for i in range(1, num_runs + 1)],
        "sample": list(range(0, count, step))[:check],
    }


def describe_workload(workload: dict[str, Any], prefix_caching: bool) -> str:
    first = workload["runs"][0]
    lens = [len(p) for p in first["prompts"]]
    outs = first["output_lens"]

    def span(values: list[int]) -> str:
        low, high = min(values), max(values)
        return str(low) if low == high else f"{low}-{high}"

    noun = "request" if len(lens) == 1 else "requests"
    text = f"{len(lens)} {noun}, prompts of {span(lens)} tokens"
    if first["shared_prefix_len"]:
        text += f" (a shared prefix of {first['shared_prefix_len']})"
    text += f" -> {span(outs)} new tokens ({sum(outs)} in all)"
    text += f"; prefix caching {'on' if prefix_caching else 'off'}"
    runs = len(workload["runs"])
    return text + f"; {'median of ' + str(runs) + ' runs' if runs > 1 else 'one run'}"


# --- engines ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Engine:
    name: str
    label: str
    python: Path
    driver: str
    env: dict[str, str]
    missing: str = ""
    """Why it cannot run here ('' when it can)."""


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
    }
    llama_missing = ""
    if not llama_python.exists():
        llama_missing = f"{llama_python} does not exist"
    elif not (peers / "llamacpp-venv" / ".done").exists():
        llama_missing = f"{peers / 'llamacpp-venv'} has no .done yet (still being built?)"
    return {
        "brigade": Engine("brigade", "Brigade", own, "brigade_driver.py", {}),
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
    if engine == "brigade":
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


# --- correctness -----------------------------------------------------------------------------


@dataclasses.dataclass
class Verdict:
    agree: int = 0
    tie: int = 0
    real: list[str] = dataclasses.field(default_factory=list)
    """One line per stream that diverged for real."""

    def describe(self) -> str:
        if not (self.agree or self.tie or self.real):
            return "not checked"
        parts = [f"{self.agree} agree"]
        if self.tie:
            parts.append(f"{self.tie} diverge at a tie")
        if self.real:
            parts.append(f"**{len(self.real)} DIVERGE**")
        return ", ".join(parts)


class Reference:
    """The transformers model in fp32, scoring greedy streams teacher-forced."""

    def __init__(self, checkpoint: Checkpoint, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model: Any = AutoModelForCausalLM.from_pretrained(
            checkpoint.hf_dir, dtype=torch.float32
        ).eval()

    def logits(self, prompt: list[int], tokens: list[int]) -> Any:
        """[len(tokens), vocab]: row i scores the token after prompt + tokens[:i]."""
        ids = self.torch.tensor([prompt + tokens[:-1]])
        with self.torch.inference_mode():
            out = self.model(ids).logits[0, len(prompt) - 1 :]
        return out.float()


def check_own(logits: Any, tokens: list[int], atol: float) -> tuple[str, str]:
    """Is every token the reference's argmax, or within ``atol`` of it? ('agree'|'tie'|'real')."""
    best = logits.max(dim=-1).values
    import torch

    chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    gaps = (best - chosen).tolist()
    for step, gap in enumerate(gaps):
        if gap > atol:
            top = int(logits[step].argmax())
            return "real", f"step {step}: chose {tokens[step]}, reference {top} ({gap:.3g} higher)"
    return ("tie" if any(g > 0 for g in gaps) else "agree"), ""


def check_against(logits: Any, ours: list[int], theirs: list[int], atol: float) -> tuple[str, str]:
    """Compare a peer's stream with Brigade's (scored by ``logits`` of Brigade's stream)."""
    for step, (mine, other) in enumerate(zip(ours, theirs, strict=False)):
        if mine == other:
            continue
        gap = abs(float(logits[step, mine]) - float(logits[step, other]))
        if gap <= atol:
            return "tie", ""
        top = int(logits[step].argmax())
        return "real", (
            f"step {step}: Brigade {mine}, this engine {other}; the reference scores them "
            f"{gap:.3g} apart and prefers {top}"
        )
    if len(ours) != len(theirs):
        return "real", f"lengths differ: {len(ours)} vs {len(theirs)}"
    return "agree", ""


def check_workload(
    reference: Reference,
    workload: dict[str, Any],
    results: dict[str, dict[str, Any]],
    atol: float,
) -> dict[str, Verdict]:
    """Per engine, how its sampled streams compare (Brigade's: with the reference itself)."""
    verdicts = {engine: Verdict() for engine in results}
    prompts = workload["runs"][0]["prompts"]
    for index in workload["sample"]:
        key = str(index)
        streams = {e: r["tokens"][key] for e, r in results.items() if key in r.get("tokens", {})}
        base_engine = "brigade" if "brigade" in streams else None
        base_logits = None
        if base_engine:
            base_logits = reference.logits(prompts[index], streams["brigade"])
        for engine, tokens in streams.items():
            if engine == base_engine or base_logits is None:
                outcome, detail = check_own(reference.logits(prompts[index], tokens), tokens, atol)
            else:
                outcome, detail = check_against(base_logits, streams["brigade"], tokens, atol)
            verdict = verdicts[engine]
            if outcome == "agree":
                verdict.agree += 1
            elif outcome == "tie":
                verdict.tie += 1
            else:
                verdict.real.append(f"request {index}: {detail}")
    return verdicts


# --- report ----------------------------------------------------------------------------------


def cpu_summary() -> str:
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    marks = " ".join(f"{f}{'+' if f in flags else '-'}" for f in CPU_FLAGS)
    return f"{model}, {os.cpu_count()} cores; {marks}"


def git_revision() -> str:
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head + (" + uncommitted changes" if dirty else "")


def figures(workload: dict[str, Any], result: dict[str, Any]) -> dict[str, float]:
    """tok/s (throughput) or ms per output token (latency) from one engine's timings."""
    seconds = result["seconds"]
    if workload["kind"] == "latency":
        n = workload["runs"][0]["output_lens"][0]
        decode = [
            (full - first) / max(1, n - 1)
            for full, first in zip(seconds, result["first_token_seconds"], strict=True)
        ]
        return {
            "decode_ms_per_token": 1000 * statistics.median(decode),
            "total_ms_per_token": 1000 * statistics.median(seconds) / n,
            "first_token_ms": 1000 * statistics.median(result["first_token_seconds"]),
        }
    return {"tokens_per_s": result["output_tokens"] / statistics.median(seconds)}


@dataclasses.dataclass
class Measurements:
    """Everything the engines' runs produced, per workload and engine."""

    results: dict[str, dict[str, dict[str, Any]]]
    """workload -> engine -> the driver's figures (``seconds``, ``tokens``, ...)."""
    errors: dict[str, dict[str, str]]
    """workload -> engine -> why it has no figures."""
    others_cpu_share: dict[str, dict[str, float]]
    """workload -> engine -> share of the CPU other processes used during that engine's run."""
    facts: dict[str, Any]
    """engine -> what its drivers reported (versions, settings) and their wall times."""
    notes: list[str]


def record(
    found: Measurements,
    name: str,
    prefix_caching: bool,
    chosen: list[str],
    workloads: dict[str, dict[str, Any]],
    result: dict[str, Any],
    error: str,
) -> None:
    """File one driver's results (or why it has none) under each of its workloads."""
    keep = ("facts", "startup_s", "wall_s", "others_cpu_share")
    found.facts.setdefault(name, {})["prefix" if prefix_caching else "plain"] = {
        k: result.get(k) for k in keep
    }
    for workload in chosen:
        got = result.get("workloads", {}).get(workload)
        if got and "error" not in got:
            found.results[workload][name] = got
            found.others_cpu_share[workload][name] = result["others_cpu_share"]
            # Now, not only in the report: a run cut short keeps what it measured.
            shown = ", ".join(f"{k} {v:.2f}" for k, v in figures(workloads[workload], got).items())
            print(f"  {name} {workload}: {shown}", file=sys.stderr, flush=True)
        else:
            reason = (got or {}).get("error") or error or "no result"
            found.errors[workload][name] = reason.strip()
    status = f" ({error.splitlines()[0]})" if error else ""
    print(f"  {name} done in {result['wall_s']:.0f} s{status}", file=sys.stderr)


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
    groups = [(False, ["uniform", "mixed", "batch1"]), (True, ["shared-prefix"])]
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
    if "shared-prefix" in workloads:
        if "transformers" in engines:
            found.notes.append("transformers has no prefix cache: it prefills every prompt whole")
        if llama_facts.get("prefix_reuse") == "none":
            found.notes.append(
                "llama.cpp ran shared-prefix WITHOUT prefix reuse: this llama-cpp-python has no "
                "llama_memory_seq_cp"
            )
    return found


def render_table(
    workload: dict[str, Any],
    found: Measurements,
    verdicts: dict[str, Verdict],
    engines: dict[str, Engine],
) -> list[str]:
    name_of_workload = workload["name"]
    results = found.results[name_of_workload]
    rows = {e: figures(workload, r) for e, r in results.items()}
    latency = workload["kind"] == "latency"
    checked = f"greedy tokens ({len(workload['sample'])} checked)"
    if latency:
        lines = [
            "| engine | decode ms/token | total ms/token (incl. prefill) | first token ms "
            f"| engine / Brigade | {checked} |",
            "|---|---|---|---|---|---|",
        ]
    else:
        lines = [
            f"| engine | tok/s | runs (s) | Brigade / engine | {checked} |",
            "|---|---|---|---|---|",
        ]
    ours = rows.get("brigade")
    for name, engine in engines.items():
        if name not in rows:
            if name in found.errors[name_of_workload]:
                lines.append(f"| {engine.label} | failed (below) |" + " |" * (4 if latency else 3))
            continue
        row = rows[name]
        noisy = found.others_cpu_share[name_of_workload].get(name, 0.0) > NOISY_SHARE
        mark = " (noisy)" if noisy else ""
        verdict = verdicts.get(name, Verdict()).describe()
        if name == "brigade" and verdict != "not checked":
            verdict += " (vs the reference)"
        if latency:
            ms = row["decode_ms_per_token"]
            ratio = (
                f"{ms / ours['decode_ms_per_token']:.2f}x" if ours and name != "brigade" else "—"
            )
            lines.append(
                f"| {engine.label} | {ms:.2f}{mark} | {row['total_ms_per_token']:.2f} | "
                f"{row['first_token_ms']:.1f} | {ratio} | {verdict} |"
            )
        else:
            rate = row["tokens_per_s"]
            ratio = f"{ours['tokens_per_s'] / rate:.2f}x" if ours and name != "brigade" else "—"
            runs = " ".join(f"{s:.3g}" for s in results[name]["seconds"])
            lines.append(f"| {engine.label} | {rate:.1f}{mark} | {runs} | {ratio} | {verdict} |")
    return lines


def report(
    args: argparse.Namespace,
    checkpoint: Checkpoint,
    versions: dict[str, str],
    workloads: dict[str, dict[str, Any]],
    engines: dict[str, Engine],
    found: Measurements,
    verdicts: dict[str, dict[str, Verdict]],
) -> None:
    print("# Brigade vs peers")
    print()
    print(f"- CPU: {cpu_summary()}")
    print(f"- threads: {args.threads} per engine; {args.dtype} weights, activations and KV; greedy")
    print(f"- model: {checkpoint.describe()}")
    print(f"- Brigade {git_revision()}" + (f", --set {' '.join(args.set)}" if args.set else ""))
    print("- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    if args.scale != 1.0:
        print(f"- **--scale {args.scale}: not the standard workloads**")
    for name, workload in workloads.items():
        print()
        print(f"## {name}")
        print()
        print(describe_workload(workload, name == "shared-prefix"))
        if workload["kind"] == "latency":
            n = workload["runs"][0]["output_lens"][0]
            print(f"Decode ms/token = ({n}-token call - 1-token call) / {n - 1}.")
        print()
        if found.results[name] or found.errors[name]:
            for line in render_table(workload, found, verdicts[name], engines):
                print(line)
        else:
            print("No engine ran.")
        noisy = [
            f"{engines[engine].label} {share:.0%}"
            for engine, share in found.others_cpu_share[name].items()
            if share > NOISY_SHARE
        ]
        if noisy:
            print(f"\nnoisy: other processes' share of the CPU during the run: {'; '.join(noisy)}")
        for engine, verdict in verdicts[name].items():
            for line in verdict.real:
                print(f"\n**REAL DIVERGENCE, {engines[engine].label}**: {line}")
        for engine, error in found.errors[name].items():
            print(f"\n{engines[engine].label} failed: {error}")
    print()
    print("## Engines")
    print()
    for name, jobs in found.facts.items():
        for group, job in jobs.items():
            facts = job.get("facts") or {}
            startup = job.get("startup_s")
            parts = [f"started in {startup:.0f} s" if startup is not None else "did not start"]
            parts += [f"{k}={v}" for k, v in facts.items() if k != "system_info"]
            print(f"- {engines[name].label} ({JOB_GROUPS[group]}): {'; '.join(parts)}")
    for note in found.notes:
        print(f"- {note}")


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
    args = parser.parse_args()
    args.engine_list = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for name in args.engine_list:
        if name not in ENGINES:
            parser.error(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    for name in args.workload_list:
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
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
        brigade = engines.get("brigade", {})
        for engine, row in engines.items():
            if engine != "brigade" and "tokens_per_s" in brigade:
                row["brigade_ratio"] = brigade["tokens_per_s"] / row["tokens_per_s"]
            elif engine != "brigade" and "decode_ms_per_token" in brigade:
                row["brigade_ratio"] = row["decode_ms_per_token"] / brigade["decode_ms_per_token"]
        per_workload[name] = {
            "description": describe_workload(workload, name == "shared-prefix"),
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
