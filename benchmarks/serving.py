"""Served throughput: `brigade serve` against `vllm serve`, both driven by `vllm bench serve`,
and against Brigade's own offline engine on the same workload, in one invocation.

    python benchmarks/serving.py       # SmolLM2, 256 prompts x 128 -> 128, 256 streams
    python benchmarks/serving.py --model small --num-prompts 64 --concurrency 32
    python benchmarks/serving.py --variant thread=server.engine_process=false

Every server is started once, warmed up with a short run, then the servers take turns, one
timed `vllm bench serve` each per round (idle vLLM servers are SIGSTOPped: vLLM's idle worker
spins at ~90% of a core). The client is vLLM's own (`vllm bench serve --backend openai
--dataset-name random --ignore-eos`, loopback only); it shares the machine's cores with the
server under test alike for every server. The offline figure is `LLM.generate` on prompts of
the same shapes in Brigade's venv, sampled as the served requests are (temperature 1.0).
Prints output tokens/s, median TTFT and TPOT per server, and the ratios the scale-out issue
asks for: served / offline and Brigade / vLLM.

Needs the vLLM-CPU venv from ``../shared/peers/setup.sh`` (``--peers-dir``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from peer_report import cpu_summary, git_revision
from peer_setup import REPO, Checkpoint, prepare_checkpoint

SERVED_NAME = "bench"
OFFLINE_SCRIPT = """
import json, random, sys, time
import torch
from brigade import LLM, SamplingParams
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
llm = LLM(overrides=spec["overrides"])
rng = random.Random(0)
vocab = spec["vocab_size"]
def batch(n):
    return [[rng.randrange(10, vocab) for _ in range(spec["input_len"])] for _ in range(n)]
params = SamplingParams(
    max_tokens=spec["output_len"], temperature=spec["temperature"], ignore_eos=True
)
llm.generate(batch(min(8, spec["num_prompts"])), params, use_tqdm=False)  # warm-up
seconds = []
for _ in range(spec["rounds"]):
    prompts = batch(spec["num_prompts"])
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds.append(time.perf_counter() - start)
print(json.dumps({"seconds": seconds}))
"""


class Server:
    """One OpenAI-compatible server under test, in its own process group."""

    def __init__(
        self, name: str, command: list[str], env: dict[str, str], log: Path, spins: bool
    ) -> None:
        self.name, self.command, self.env, self.log, self.spins = name, command, env, log, spins
        self.process: subprocess.Popen[bytes] | None = None
        self.results: list[dict[str, Any]] = []

    def start(self, port: int, timeout: float) -> None:
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,  # its own group: stop, resume and kill it whole
            )
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{port}/v1/models"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; {self.log}")
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} was not ready after {timeout:.0f} s; {self.log}")

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signum)

    def pause(self) -> None:
        if self.spins:
            self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.spins:
            self.signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.process.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def bench_serve(
    args: argparse.Namespace, hf_dir: Path, port: int, num_prompts: int, out: Path
) -> dict[str, Any]:
    """One `vllm bench serve` run against the server on ``port``; its saved result."""
    command = [
        str(Path(args.peers_dir) / "vllm-venv" / "bin" / "vllm"),
        "bench",
        "serve",
        "--backend", "openai",
        "--base-url", f"http://127.0.0.1:{port}",
        "--endpoint", "/v1/completions",
        "--model", SERVED_NAME,
        "--tokenizer", str(hf_dir),
        "--dataset-name", "random",
        "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--random-range-ratio", "0",
        "--ignore-eos",
        "--num-prompts", str(num_prompts),
        "--max-concurrency", str(args.concurrency),
        "--request-rate", args.request_rate,
        "--seed", "0",
        "--save-result",
        "--result-dir", str(out.parent),
        "--result-filename", out.name,
        "--disable-tqdm",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0 or not out.exists():
        tail = "\n    ".join((done.stdout + done.stderr).splitlines()[-20:])
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n    {tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    if result.get("completed") != num_prompts:
        raise RuntimeError(f"only {result.get('completed')}/{num_prompts} requests completed")
    return result


def offline_throughput(args: argparse.Namespace, checkpoint: Checkpoint) -> list[float]:
    spec = {
        "threads": args.threads,
        "overrides": [
            f"model.path={checkpoint.brigade_path}",
            f"model.dtype={args.dtype}",
            "kv.enable_prefix_caching=false",
        ],
        "vocab_size": checkpoint.config["vocab_size"],
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_prompts": args.num_prompts,
        "rounds": args.rounds,
        # As the served requests are sampled: `vllm bench serve` sends no temperature, and
        # under `--generation-config vllm` both servers default to 1.0.
        "temperature": 1.0,
    }
    python = REPO / ".venv" / "bin" / "python"
    done = subprocess.run(
        [str(python), "-c", OFFLINE_SCRIPT, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the offline run failed:\n{done.stderr[-3000:]}")
    seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
    return [args.num_prompts * args.output_len / s for s in seconds]


def make_servers(args: argparse.Namespace, checkpoint: Checkpoint, logs: Path) -> list[Server]:
    brigade = str(REPO / ".venv" / "bin" / "brigade")
    common = [
        "--served-model-name", SERVED_NAME, "--dtype", args.dtype, "--seed", "0",
        "--no-enable-prefix-caching", "--generation-config", "vllm",
    ]  # fmt: skip
    servers = []
    variants = [("brigade", [])] + [
        (name, sets.split(",")) for name, _, sets in (v.partition("=") for v in args.variant)
    ]
    for name, sets in variants:
        command = [brigade, "serve", checkpoint.brigade_path, *common]
        for setting in sets:
            command += ["--set", setting]
        env = {"OMP_NUM_THREADS": str(args.threads)}
        servers.append(Server(name, command, env, logs / f"{name}.log", spins=False))
    if "vllm" in args.peers:
        vllm = Path(args.peers_dir) / "vllm-venv" / "bin" / "vllm"
        env = {
            "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CACHE_ROOT": str(Path(args.vllm_cache).expanduser()),
            "VLLM_USE_AOT_COMPILE": "0",  # see peers.py: 0.32 cannot reload its AOT artifacts
        }
        command = [str(vllm), "serve", str(checkpoint.hf_dir), *common]
        servers.append(Server("vllm", command, env, logs / "vllm.log", spins=True))
    return servers


@contextlib.contextmanager
def running(servers: list[Server], args: argparse.Namespace) -> Iterator[dict[str, int]]:
    ports: dict[str, int] = {}
    try:
        for server in servers:
            port = ports[server.name] = free_port()
            server.command += ["--port", str(port)]
            print(f"starting {server.name} ...", file=sys.stderr, flush=True)
            server.start(port, args.timeout)
            server.pause()
        yield ports
    finally:
        for server in servers:
            server.stop()


def summarize(results: list[dict[str, Any]]) -> dict[str, float]:
    return {
        "output_tok_s": statistics.median(r["output_throughput"] for r in results),
        "ttft_ms": statistics.median(r["median_ttft_ms"] for r in results),
        "tpot_ms": statistics.median(r["median_tpot_ms"] for r in results),
    }


def main() -> None:
    args = parse_args()
    checkpoint = prepare_checkpoint(args.model)
    logs = Path(tempfile.mkdtemp(prefix="brigade-serving-"))
    print(f"server logs: {logs}", file=sys.stderr)
    servers = make_servers(args, checkpoint, logs)
    with running(servers, args) as ports:
        for server in servers:  # warm-up (vLLM compiles shapes on its first batches)
            server.resume()
            warmup = logs / "warmup.json"
            bench_serve(args, checkpoint.hf_dir, ports[server.name], args.concurrency, warmup)
            server.pause()
        for round_index in range(args.rounds):
            order = servers if round_index % 2 == 0 else servers[::-1]
            for server in order:
                print(f"round {round_index + 1}: {server.name}", file=sys.stderr, flush=True)
                server.resume()
                out = logs / f"{server.name}-{round_index}.json"
                server.results.append(
                    bench_serve(args, checkpoint.hf_dir, ports[server.name], args.num_prompts, out)
                )
                server.pause()
    offline = offline_throughput(args, checkpoint) if not args.no_offline else []
    report(args, checkpoint, servers, offline)


def report(
    args: argparse.Namespace, checkpoint: Checkpoint, servers: list[Server], offline: list[float]
) -> None:
    print(f"\n# Served throughput ({time.strftime('%Y-%m-%d')}, {git_revision()})")
    print(f"machine: {cpu_summary()}")
    print(f"model: {checkpoint.describe()}, {args.dtype}, {args.threads} threads")
    print(
        f"workload: {args.num_prompts} prompts x {args.input_len} -> {args.output_len} tokens "
        f"(EOS ignored), {args.concurrency} concurrent, request rate {args.request_rate}; "
        f"median of {args.rounds} round(s), servers taking turns; client: vllm bench serve\n"
    )
    figures = {server.name: summarize(server.results) for server in servers}
    print("| server | output tok/s | median TTFT ms | median TPOT ms |")
    print("|---|---|---|---|")
    for name, f in figures.items():
        print(f"| {name} | {f['output_tok_s']:.1f} | {f['ttft_ms']:.0f} | {f['tpot_ms']:.1f} |")
    if offline:
        print(f"| Brigade offline (LLM.generate) | {statistics.median(offline):.1f} | - | - |")
    print()
    ours = figures["brigade"]
    if offline:
        print(f"served / offline: {ours['output_tok_s'] / statistics.median(offline):.2f}x")
    if "vllm" in figures:
        theirs = figures["vllm"]
        print(
            f"Brigade / vLLM: {ours['output_tok_s'] / theirs['output_tok_s']:.2f}x output tok/s, "
            f"median TPOT {ours['tpot_ms']:.1f} vs {theirs['tpot_ms']:.1f} ms"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"servers": figures, "offline": offline}, indent=2))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "small", "tiny"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--request-rate", default="inf", help="requests/s (Poisson) or inf")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="another Brigade server: NAME=STATION.KEY=VALUE[,...] (repeatable)",
    )
    parser.add_argument("--peers", default="vllm", help="'vllm' or '' for Brigade only")
    parser.add_argument("--no-offline", action="store_true", help="skip the offline figure")
    parser.add_argument("--peers-dir", default=os.environ.get("BRIGADE_PEERS_DIR", "/work/peers"))
    parser.add_argument("--vllm-cache", default="~/.cache/brigade-peers/vllm")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per start or run")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    if min(args.threads, args.num_prompts, args.concurrency, args.rounds) < 1:
        parser.error("--threads, --num-prompts, --concurrency and --rounds must be >= 1")
    if not (Path(args.peers_dir) / "vllm-venv" / "bin" / "vllm").exists():
        parser.error(f"no vLLM venv under {args.peers_dir}: bash ../shared/peers/setup.sh DIR")
    return args


if __name__ == "__main__":
    main()
