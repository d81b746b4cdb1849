"""The ``brigade`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeAlias

from brigade import serve_args
from brigade.errors import BrigadeError
from brigade.interfaces import SamplingParams
from brigade.version import DISTRIBUTION, installed_version

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``brigade`` console script; returns the exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except BrigadeError as exc:
        print(f"brigade: error: {exc}", file=sys.stderr)
        return 2


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="brigade", description="An LLM serving engine whose every part is a plugin."
    )
    parser.add_argument(
        "-V",
        "--version",
        action="version",
        version=_version(),
        help="print Brigade's version and its plugin API version",
    )
    commands = parser.add_subparsers(title="commands")
    for add_command in (
        _add_plugins_command,
        _add_config_commands,
        _add_model_commands,
        _add_serve_command,
        _add_generate_command,
        _add_bench_command,
        _add_kernels_commands,
    ):
        add_command(commands)
    return parser


_Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _add_plugins_command(commands: _Commands) -> None:
    plugins = commands.add_parser("plugins", help="list every registered component")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    plugins.set_defaults(handler=_cmd_plugins)


def _add_config_commands(commands: _Commands) -> None:
    config = commands.add_parser("config", help="validate or show a config file")
    config_commands = config.add_subparsers(title="config commands", required=True)
    check = config_commands.add_parser("check", help="validate a config without loading a model")
    check.add_argument("file", nargs="?", help="TOML config (omit for the defaults)")
    _add_override_flag(check)
    check.set_defaults(handler=_cmd_config_check)
    show = config_commands.add_parser("show", help="print the effective config as TOML")
    show.add_argument("file", nargs="?", help="TOML config (omit for the defaults)")
    _add_override_flag(show)
    show.set_defaults(handler=_cmd_config_show)
    docs = config_commands.add_parser("docs", help="print the config reference (Markdown)")
    docs.add_argument("--all", action="store_true", help="include third-party plugins")
    docs.set_defaults(handler=_cmd_config_docs)


def _add_model_commands(commands: _Commands) -> None:
    model = commands.add_parser("model", help="create local models")
    model_commands = model.add_subparsers(title="model commands", required=True)
    create = model_commands.add_parser(
        "create", help="write a random-weight HF-format model with a trained tokenizer"
    )
    create.add_argument("--arch", default="llama", help="llama, qwen2, qwen3 or mistral")
    create.add_argument("--size", default="tiny", help="tiny or small")
    create.add_argument("--out", required=True, help="directory to write")
    create.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights (same seed, same model)"
    )
    create.add_argument("--dtype", default="float32", help="float32 or bfloat16 weights")
    create.add_argument(
        "--tie-word-embeddings",
        action="store_true",
        help="share the input embedding matrix with the output head",
    )
    create.set_defaults(handler=_cmd_model_create)


def _add_serve_command(commands: _Commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        usage=serve_args.USAGE,
        description="Serve MODEL over OpenAI's HTTP API; vLLM's serve flags work as in vLLM.",
        epilog=serve_args.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_override_flag(serve_args.add_serve_arguments(serve))
    serve.set_defaults(handler=_cmd_serve)


def _add_generate_command(commands: _Commands) -> None:
    generate = commands.add_parser("generate", help="generate offline (greedy by default)")
    generate.add_argument("--config", help="TOML config (omit for the defaults)")
    _add_override_flag(generate)
    serve_args.add_alias_flags(
        generate,
        "--tensor-parallel-size",
        "--data-parallel-size",
        "--distributed-executor-backend",
    )
    generate.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    generate.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user message through the model's chat template",
    )
    generate.add_argument(
        "--prompts-file", help="a file with one prompt per line (blank lines are skipped)"
    )
    generate.add_argument(
        "--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)"
    )
    generate.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (the default); > 0 samples"
    )
    generate.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 = off"
    )
    generate.add_argument(
        "--top-k", type=int, default=0, help="sample among the K likeliest tokens; 0 = off"
    )
    generate.add_argument(
        "--seed", type=int, default=None, help="seed of this run's sampling (default: unseeded)"
    )
    generate.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past the end-of-text token"
    )
    generate.add_argument(
        "--stop",
        action="append",
        default=[],
        help="a stop string, left out of the text (repeatable)",
    )
    generate.set_defaults(handler=_cmd_generate)


def _add_bench_command(commands: _Commands) -> None:
    from brigade.bench.spec import WORKLOAD_HELP

    bench = commands.add_parser(
        "bench",
        help="compare configs or servers on one seeded workload",
        description=(
            "Run one seeded workload against configs in-process (the simulated executor on a "
            "virtual clock) and/or OpenAI-compatible endpoints over HTTP; print a Markdown "
            "table (mean ± 95%% CI over seeds). See docs/bench.md."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=WORKLOAD_HELP,
    )
    bench.add_argument(
        "--config", action="append", default=[], help="TOML config (repeatable: one column each)"
    )
    bench.add_argument(
        "--workload", required=True, help="a JSONL trace, or a synthetic: spec (grammar below)"
    )
    bench.add_argument("--seeds", type=int, default=1, help="repeat with seeds 0..N-1")
    bench.add_argument("--slo", help="goodput thresholds, e.g. ttft=500ms,tpot=50ms")
    bench.add_argument("--json", help="write the results as JSON to this file")
    bench.add_argument(
        "--sweep",
        help="rate=1,2,4,8 (requests/s) or a config key, e.g. "
        "scheduler.max_num_batched_tokens=256,512,1024: one table and curve per config",
    )
    bench.add_argument(
        "--plot",
        metavar="DIR",
        help="write latency CDFs (and sweep curves) as PNG here; needs brigade-llm[bench]",
    )
    bench.add_argument(
        "--by",
        metavar="FIELD",
        help="also break latency, goodput and deadline misses down by this extra field of "
        "the requests (e.g. priority_class)",
    )
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_bench_endpoint_arguments(bench)
    _add_override_flag(bench)
    bench.set_defaults(handler=_cmd_bench)


def _add_bench_endpoint_arguments(bench: argparse.ArgumentParser) -> None:
    http = bench.add_argument_group("HTTP endpoints (any OpenAI-compatible server)")
    http.add_argument(
        "--endpoint",
        action="append",
        default=[],
        help="base URL up to /v1, e.g. http://127.0.0.1:8000/v1 (repeatable: one column each)",
    )
    http.add_argument("--model", help="the model name the endpoint serves")
    http.add_argument(
        "--prompt-format",
        choices=("token_ids", "text"),
        default="token_ids",
        help="send prompts as token-id lists (brigade, vLLM) or as words (any server)",
    )
    http.add_argument(
        "--vocab-size",
        type=int,
        help="token-id prompts use ids below this (default: the configs' vocabulary, or 32000)",
    )
    http.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most")
    http.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds before a request fails"
    )
    http.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY)")


def _add_kernels_commands(commands: _Commands) -> None:
    kernels = commands.add_parser("kernels", help="build or check the C++ CPU kernels")
    kernels_commands = kernels.add_subparsers(title="kernels commands", required=True)
    build = kernels_commands.add_parser(
        "build",
        help="build the CPU kernels for this host (once per checkout, torch and CPU; "
        "$BRIGADE_CPU_MARCH picks the target)",
    )
    build.set_defaults(handler=_cmd_kernels_build)
    status = kernels_commands.add_parser(
        "status", help="whether the CPU kernels are built for this host, where, for which -march"
    )
    status.add_argument(
        "--check", action="store_true", help="exit with status 1 when they are not built"
    )
    status.set_defaults(handler=_cmd_kernels_status)


def _version() -> str:
    from brigade.interfaces import API_VERSION

    return f"brigade {installed_version()} ({DISTRIBUTION}), plugin API {API_VERSION}"


def _add_override_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="STATION.KEY=VALUE",
        help="override one config key (repeatable; value read as TOML, else as a string)",
    )


def _cmd_plugins(args: argparse.Namespace) -> int:
    from brigade.options import option_defaults
    from brigade.registry import default_registry

    rows: list[dict[str, Any]] = [
        {
            "kind": c.kind,
            "name": c.name,
            "distribution": c.distribution,
            "options": option_defaults(c.options_type),
        }
        for c in default_registry()
    ]
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    for row in rows:
        options = ", ".join(f"{k}={v!r}" for k, v in row["options"].items()) or "-"
        print(f"{row['kind']:<12} {row['name']:<22} {row['distribution']:<22} {options}")
    return 0


def _load(file: str | None, overrides: Sequence[str]) -> tuple[Any, Any]:
    from brigade.config import load_config
    from brigade.registry import default_registry

    registry = default_registry()
    return load_config(file, registry, overrides=overrides), registry


def _cmd_config_check(args: argparse.Namespace) -> int:
    from brigade.config import check_config
    from brigade.stations import STATIONS

    config, registry = _load(args.file, args.set)
    notes = check_config(config, registry)
    print(f"{config.source}: OK")
    for station, plugin in config.components.items():
        chain = ", ".join(entry.name for entry in config[station].chain)
        print(
            f"  {station}: {plugin}"
            + (f"; {STATIONS[station].chain_key}: {chain}" if chain else "")
        )
    for note in notes:
        print(f"  {note}")
    return 0


def _cmd_config_show(args: argparse.Namespace) -> int:
    from brigade.stations import STATIONS

    config, _ = _load(args.file, args.set)
    for name, station in config.stations.items():
        print(f"[{name}]")
        if station.plugin is not None:
            print(f"plugin = {json.dumps(station.plugin)}")
        for values in (station.settings, station.options):
            if values is None:
                continue
            for key, value in dataclasses.asdict(values).items():
                print(f"{key} = {_toml_value(value)}")
        print()
        for entry in station.chain:
            print(f"[{name}.{STATIONS[name].chain_options_key}.{entry.name}]")
            for key, value in dataclasses.asdict(entry.options).items():
                print(f"{key} = {_toml_value(value)}")
            print()
    return 0


def _cmd_config_docs(args: argparse.Namespace) -> int:
    from brigade.config_docs import render_config_reference
    from brigade.registry import default_registry

    prefix = "" if args.all else "brigade-llm "
    print(render_config_reference(default_registry(), distribution_prefix=prefix), end="")
    return 0


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)


def _cmd_model_create(args: argparse.Namespace) -> int:
    from brigade.models.create import create_model

    try:
        out = create_model(
            args.out,
            args.arch,
            args.size,
            seed=args.seed,
            dtype=args.dtype,
            tie_word_embeddings=args.tie_word_embeddings,
        )
    except ValueError as exc:
        raise BrigadeError(str(exc)) from exc
    print(f"wrote {args.arch} ({args.size}) to {out}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    overrides, notes = serve_args.serve_overrides(args)  # refused flags fail before imports
    for note in notes:
        print(f"brigade: note: {note}", file=sys.stderr)
    from brigade.server.serve import serve

    return serve(args.config, overrides)


def _cmd_generate(args: argparse.Namespace) -> int:
    from brigade.llm import LLM

    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            lines = Path(args.prompts_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise BrigadeError(f"cannot read --prompts-file: {exc}") from exc
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise BrigadeError("give at least one --prompt or a --prompts-file")
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            stop=tuple(args.stop),
        )
    except ValueError as exc:
        raise BrigadeError(str(exc)) from exc
    overrides = [*serve_args.alias_overrides(args), *args.set]
    config, _ = _load(args.config, overrides)
    if config["router"].settings.data_parallel_size > 1:
        return _generate_on_replicas(args, overrides, prompts, params)
    from brigade.startup import startup_banner

    started = time.perf_counter()
    llm = LLM(args.config, overrides=overrides)
    loaded = time.perf_counter()
    print(startup_banner(llm.engine), file=sys.stderr)
    if args.chat:
        conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
        outputs = llm.chat(conversations, params)
    else:
        outputs = llm.generate(prompts, params)
    done = time.perf_counter()
    for prompt, result in zip(prompts, outputs, strict=True):
        print(f"{prompt!r} -> {result.outputs[0].text!r}")
    generated = sum(len(o.token_ids) for r in outputs for o in r.outputs)
    engine = llm.engine
    kv = engine.kv.stats()
    print(
        f"[{engine.checkpoint.name}: loaded in {loaded - started:.1f}s; {generated} tokens in "
        f"{done - loaded:.2f}s over {engine.num_steps} steps; KV pool {kv.num_pages} pages x "
        f"{engine.batch.page_size}; prefix cache hits {kv.prefix_cache_hits}/"
        f"{kv.prefix_cache_queries} tokens]",
        file=sys.stderr,
    )
    return 0


def _generate_on_replicas(
    args: argparse.Namespace, overrides: list[str], prompts: list[str], params: SamplingParams
) -> int:
    from brigade.offline_replicas import generate_on_replicas

    started = time.perf_counter()
    results = generate_on_replicas(args.config, overrides, prompts, params, chat=args.chat)
    done = time.perf_counter()
    answers: dict[int, str] = {}
    failed = [r for r in results if r.outputs is None]
    for result in results:
        for index, output in zip(result.indices, result.outputs or [], strict=False):
            answers[index] = output.outputs[0].text
    for index, prompt in enumerate(prompts):
        if index in answers:
            print(f"{prompt!r} -> {answers[index]!r}")
        else:
            print(f"{prompt!r} -> (failed: its replica failed)")
    generated = sum(
        len(o.token_ids) for r in results for output in r.outputs or [] for o in output.outputs
    )
    shares = ", ".join(
        f"replica {r.replica}: {len(r.indices)} prompts, {r.num_steps} steps, prefix cache hits "
        f"{r.prefix_cache_hits}/{r.prefix_cache_queries}"
        for r in results
        if r.outputs is not None
    )
    print(
        f"[{len(results)} replicas: {generated} tokens in {done - started:.2f}s including "
        f"loading; {shares}]",
        file=sys.stderr,
    )
    for result in failed:
        print(f"brigade: error: replica {result.replica} failed: {result.error}", file=sys.stderr)
    return 1 if failed else 0


def _cmd_kernels_build(args: argparse.Namespace) -> int:
    from brigade.plugins.cpu import KernelBuildError, build_kernels, kernel_cache

    cache = kernel_cache()
    was_built = cache.built
    try:
        seconds = build_kernels()
    except KernelBuildError as exc:
        print(f"brigade: warning: {exc}", file=sys.stderr)
        return 1
    done = "found the CPU kernels already built" if was_built else "built the CPU kernels"
    print(f"{done} for -march={cache.march} in {seconds:.1f} s: {cache.directory}")
    return 0


def _cmd_kernels_status(args: argparse.Namespace) -> int:
    from brigade.plugins.cpu import kernel_cache

    cache = kernel_cache()
    if cache.built:
        print(f"the CPU kernels are built for this host (-march={cache.march}): {cache.directory}")
        return 0
    print(
        f"the CPU kernels are not built for this host (-march={cache.march}); "
        f"`brigade kernels build` builds them in {cache.directory}"
    )
    return 1 if args.check else 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from brigade.bench.cli import run_bench

    return run_bench(
        args.config,
        args.workload,
        seeds=args.seeds,
        slo=args.slo,
        json_path=args.json,
        overrides=args.set,
        endpoints=args.endpoint,
        model=args.model,
        prompt_format=args.prompt_format,
        vocab_size=args.vocab_size,
        max_concurrency=args.max_concurrency,
        request_timeout_s=args.request_timeout,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        sweep=args.sweep,
        plot_dir=args.plot,
        quiet=args.quiet,
        by=args.by,
    )
