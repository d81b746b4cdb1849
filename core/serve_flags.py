"""vLLM's ``serve`` flags and what ``brigade serve`` does with each: the one table from which
the parser's arguments (:mod:`brigade.serve_args`) and the tables of docs/vllm.md are made.

A flag is one of three things:

- an **alias** of a config key: its value, mapped from vLLM's spelling where it differs
  (``--dtype half`` is ``float16``, ``--max-model-len 32K`` is 32768, by the parsers of
  :mod:`brigade.serve_flag_values`), becomes the ``--set`` override of that key;
- **accepted**: vLLM's meaning is already what Brigade does; a one-line note says so;
- **refused**: Brigade has no such feature; a one-line error names the flag and, where there
  is one, the Brigade equivalent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from brigade.serve_flag_values import (
    choice,
    device,
    dtype,
    executor_backend,
    gib,
    hermes,
    integer,
    kv_cache_dtype,
    one_name,
    pooler_config,
    rank_count,
    runner,
    scheduling_policy,
    speculative_config,
    token_count,
)

__all__ = ["FLAGS", "ServeFlag"]

Arity = Literal["value", "repeat", "names", "bool", "switch"]
"""How a flag takes values: one; one per use, repeatable; one or more after one flag;
``--x``/``--no-x``; none."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServeFlag:
    """One vLLM ``serve`` flag and what Brigade does with it."""

    names: tuple[str, ...]
    """Option strings as vLLM spells them, the long one first (``--tensor-parallel-size``,
    ``-tp``); a ``bool`` alias also takes ``--no-<name>``."""
    help: str
    """An alias: what it sets and how vLLM's values map. Accepted: the note printed when it
    is given. Refused: why, and the Brigade equivalent (the error message)."""
    status: Literal["alias", "accepted", "refused"]
    key: str | None = None
    """``station.key`` that an alias sets; None for accepted and refused flags."""
    arity: Arity = "switch"
    parse: Callable[[Any], Any] | None = None
    """vLLM's value (a string; a list of them for ``repeat`` and ``names``) -> the key's value,
    or a check of an accepted flag's value; raises ``ValueError`` saying what is allowed.
    None: the value as given."""
    metavar: str | None = None

    @property
    def dest(self) -> str:
        """The argparse attribute an alias's value lands in."""
        return "vllm_" + self.names[0].lstrip("-").replace("-", "_")


def _alias(
    names: str | tuple[str, ...],
    key: str,
    help: str,  # noqa: A002 - argparse's word
    *,
    arity: Arity = "value",
    parse: Callable[[Any], Any] | None = None,
    metavar: str | None = None,
) -> ServeFlag:
    names = (names,) if isinstance(names, str) else names
    return ServeFlag(names, help, "alias", key, arity, parse, metavar)


def _accepted(
    names: str | tuple[str, ...],
    note: str,
    *,
    check: Callable[[str], Any] | None = None,
    metavar: str | None = None,
) -> ServeFlag:
    """An accepted flag: a switch, or one value that ``check`` vets."""
    names = (names,) if isinstance(names, str) else names
    arity: Arity = "switch" if check is None else "value"
    return ServeFlag(names, note, "accepted", None, arity, check, metavar)


def _refused(names: str | tuple[str, ...], reason: str) -> ServeFlag:
    return ServeFlag((names,) if isinstance(names, str) else names, reason, "refused")


# --- the table ----------------------------------------------------------------------------

_NOT_YET = "not implemented yet"

FLAGS: tuple[ServeFlag, ...] = (
    # Aliases of config keys.
    _alias("--model", "model.path", "the same as MODEL (vLLM's older spelling)", metavar="MODEL"),
    _alias(
        "--served-model-name",
        "server.served_model_name",
        "the model id clients send and responses carry (default: the model's name); more "
        "than one name is an error, not a server that answers 404 to the others: vLLM answers "
        "to every name given, Brigade has no aliases yet",
        arity="names",
        parse=one_name,
        metavar="NAME",
    ),
    _alias(
        "--host",
        "server.host",
        "address to listen on (default 127.0.0.1; vLLM's default is every interface: give "
        "0.0.0.0 for that)",
        metavar="HOST",
    ),
    _alias(
        "--port", "server.port", "TCP port (default 8000, as vLLM)", parse=integer, metavar="PORT"
    ),
    _alias(
        "--api-key",
        "server.api_keys",
        "an accepted bearer token (repeat the flag for several); without the flag, "
        "VLLM_API_KEY is the key, as in vLLM",
        arity="repeat",
        metavar="KEY",
    ),
    _alias(
        "--max-model-len",
        "model.max_model_len",
        "longest prompt + output, read as vLLM does: 4096, 4k = 4000, 25.6k = 25600, "
        "32K = 32768, 1m = 1000000; vLLM's auto and -1 are refused (leave the flag out for "
        "the model's own limit)",
        parse=token_count,
        metavar="LEN",
    ),
    _alias(
        "--dtype",
        "model.dtype",
        "weights and activations: auto (the checkpoint's dtype; vLLM's auto would run a "
        "float32 checkpoint in float16), half or float16, bfloat16, float or float32",
        parse=dtype,
        metavar="DTYPE",
    ),
    _alias(
        "--kv-cache-dtype",
        "kv.cache_dtype",
        "auto (the model's dtype), bfloat16, float16 or half, float32; fp8 variants are "
        "refused (no fp8 KV cache yet)",
        parse=kv_cache_dtype,
        metavar="DTYPE",
    ),
    _alias(
        "--seed",
        "model.seed",
        "seed of the shared generator for requests that set no seed",
        parse=integer,
    ),
    _alias(
        "--chat-template",
        "model.chat_template",
        "a Jinja template file, or the template itself; replaces the model's own",
        metavar="TEMPLATE",
    ),
    _alias(
        "--generation-config",
        "model.generation_config",
        "sampling defaults of requests that set none: auto (the default) = the model's "
        "recommendation, from generation_config.json or a GGUF's general.sampling.*; vllm = "
        "OpenAI's (temperature 1, top_p 1); a folder of its own is not supported",
        parse=choice({"auto": "auto", "vllm": "none"}),
        metavar="auto|vllm",
    ),
    _alias(
        "--block-size",
        "kv.page_size",
        "tokens per KV page (vLLM's block); `brigade config check` says which sizes the "
        "attention backend reads",
        parse=integer,
        metavar="N",
    ),
    _alias(
        "--num-gpu-blocks-override",
        "kv.num_pages",
        "KV pool size in pages, instead of sizing the pool from memory",
        parse=integer,
        metavar="N",
    ),
    _alias(
        "--enable-prefix-caching",
        "kv.enable_prefix_caching",
        "reuse the KV of shared prompt prefixes (on by default, as in vLLM)",
        arity="bool",
    ),
    _alias(
        "--disable-cascade-attn",
        "attention.cascade_decode",
        "decode rows that share a cached prompt prefix each read its pages, instead of "
        "scoring them together once (the cpu attention backend's C++ decode kernel)",
        arity="switch",
        parse=lambda _: False,
    ),
    _alias(
        "--swap-space",
        "kv.swap_space_gib",
        "GiB of host memory for swapped-out KV pages, used only with [scheduler] "
        'preemption = "swap" (vLLM: per GPU)',
        parse=gib,
        metavar="GIB",
    ),
    _alias("--max-num-seqs", "scheduler.max_num_seqs", "most requests in one step", parse=integer),
    _alias(
        "--disable-frontend-multiprocessing",
        "server.engine_process",
        "the HTTP server and the engine share one process (the engine steps on a thread)",
        arity="switch",
        parse=lambda _: False,
    ),
    _alias(
        ("--api-server-count", "-asc"),
        "server.api_server_count",
        "HTTP front-end processes sharing the port, all feeding the one engine process",
        parse=integer,
        metavar="N",
    ),
    _alias(
        "--max-num-batched-tokens",
        "scheduler.max_num_batched_tokens",
        "token budget of one step, shared by prefill chunks and decodes (2k, 8K as for "
        "--max-model-len)",
        parse=token_count,
        metavar="N",
    ),
    _alias(
        "--enable-chunked-prefill",
        "scheduler.enable_chunked_prefill",
        "split long prompts across steps so decodes keep running (on by default)",
        arity="bool",
    ),
    _alias(
        "--scheduling-policy",
        "scheduler.plugin",
        "fcfs or priority, the scheduler plugin of that name (priority: a lower request "
        "priority runs first, as in vLLM)",
        parse=scheduling_policy,
        metavar="POLICY",
    ),
    _alias(
        "--device",
        "executor.device",
        "auto, cpu, cuda or cuda:N (an option of the torch and cuda-graph executors)",
        parse=device,
        metavar="DEVICE",
    ),
    _alias(
        ("--tensor-parallel-size", "-tp"),
        "executor.tensor_parallel_size",
        "ranks the model is split over: processes on this machine, one GPU each on CUDA (an "
        "option of the torch executor; docs/distributed.md)",
        parse=rank_count,
        metavar="N",
    ),
    _alias(
        ("--data-parallel-size", "-dp"),
        "router.data_parallel_size",
        "engine replicas behind the router station, each in its own process (or Ray actor, with "
        "--distributed-executor-backend ray) with its share of the cores (docs/distributed.md)",
        parse=rank_count,
        metavar="N",
    ),
    _alias(
        "--distributed-executor-backend",
        "executor.distributed_executor_backend",
        "where tensor-parallel ranks and the data-parallel replicas run: mp (processes on this "
        "machine; vLLM's uni means the same here) or ray (actors on a Ray cluster); vLLM's "
        "external_launcher is refused",
        parse=executor_backend,
        metavar="BACKEND",
    ),
    # vLLM's meaning is already Brigade's behaviour.
    _accepted(
        "--trust-remote-code",
        "Brigade never runs model code from a checkpoint: it has its own code for every "
        "architecture it supports",
    ),
    _accepted(
        "--enable-auto-tool-choice",
        'tool calling is always on: a request with tools gets tool_choice "auto" unless it '
        "asks otherwise",
    ),
    _accepted(
        "--tool-call-parser",
        "tool calls are read in the hermes format (`<tool_call>JSON</tool_call>`), the only "
        "one; any other parser is an error",
        check=hermes,
        metavar="PARSER",
    ),
    _accepted(
        ("--runner", "--task", "--convert"),
        "one engine serves both /v1/chat/completions and /v1/embeddings (the decoder's "
        "pooled hidden states); auto, generate, pooling, embed and none all mean that",
        check=runner,
        metavar="RUNNER",
    ),
    _alias(
        "--pooler-config",
        "server.embedding_pooling",
        'how /v1/embeddings pools: {"pooling_type": "LAST"} (the default) or "MEAN"',
        parse=pooler_config,
        metavar="JSON",
    ),
    _accepted(
        ("--disable-log-requests", "--no-enable-log-requests"),
        "prompts are never logged; each request logs one request_finished event (token "
        "counts and timings)",
    ),
    _alias(
        "--enforce-eager",
        "executor.plugin",
        "the eager torch executor; without it a CUDA GPU gets the cuda-graph executor (a CPU "
        "is always eager)",
        arity="switch",
        parse=lambda _: "torch",
    ),
    _accepted("--disable-log-stats", "no periodic stats are logged; scrape GET /metrics"),
    _accepted(
        "--disable-uvicorn-access-log",
        "uvicorn runs at log level warning, so it writes no access log",
    ),
    _accepted(
        "--disable-custom-all-reduce",
        "tensor parallelism all-reduces through torch.distributed (gloo, NCCL); Brigade has no "
        "custom all-reduce",
    ),
    _accepted(
        "--max-log-len",
        "prompts are never logged, so there is nothing to shorten",
        check=str,
        metavar="N",
    ),
    # vLLM features Brigade does not have.
    _refused(("--pipeline-parallel-size", "-pp"), "pipeline parallelism is not implemented yet"),
    _refused(("--enable-expert-parallel", "-ep"), "expert parallelism is not implemented yet"),
    _refused(
        "--headless",
        "Brigade has no headless engine nodes: several machines run tensor-parallel ranks and "
        "generate's replicas through Ray (--distributed-executor-backend ray; "
        "docs/distributed.md)",
    ),
    _refused(
        ("--quantization", "-q"),
        "quantized inference is not implemented yet; a quantized GGUF file is dequantized on "
        "load to [model] dtype",
    ),
    _refused(
        "--gpu-memory-utilization",
        "use [kv] memory_fraction = F: the share of memory free after loading the weights that "
        "the KV pool takes (at most [kv] max_memory_gib)",
    ),
    _refused(
        "--kv-cache-memory-bytes",
        "use [kv] max_memory_gib = G (the pool's upper bound) or --num-gpu-blocks-override N",
    ),
    _refused("--cpu-offload-gb", "offloading weights to host memory is not implemented yet"),
    _refused(
        ("--kv-offloading-size", "--kv-offloading-backend"),
        "KV offloading is not implemented yet; preempted requests can swap their pages to host "
        'memory ([scheduler] preemption = "swap", --swap-space)',
    ),
    _refused("--calculate-kv-scales", "there is no fp8 KV cache yet"),
    _refused(
        ("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank"),
        "LoRA adapters are not implemented yet",
    ),
    _alias(
        "--speculative-config",
        "speculative.plugin",
        "speculative decoding as JSON: method ngram, suffix or draft_model (with model, the "
        "draft model's path), num_speculative_tokens, disable_by_batch_size, "
        "prompt_lookup_max/min, suffix_decoding_* (docs/speculative.md)",
        parse=speculative_config,
        metavar="JSON",
    ),
    _refused("--tokenizer", "the tokenizer is read from MODEL (its directory, or the GGUF file)"),
    _refused(
        "--tokenizer-mode", "the tokenizer is MODEL's own; choosing a mode is not implemented"
    ),
    _refused(
        (
            "--revision",
            "--tokenizer-revision",
            "--code-revision",
            "--download-dir",
            "--hf-token",
        ),
        "nothing is downloaded: a hub name in MODEL is looked up in the local Hugging Face "
        "cache (HF_HUB_CACHE, else HF_HOME/hub), where its refs/main snapshot is used; give a "
        "snapshot directory as MODEL for another revision",
    ),
    _refused(
        "--load-format",
        "the format follows MODEL: safetensors in a Hugging Face directory, or a GGUF file",
    ),
    _refused(("--hf-config-path", "--config-format"), "config.json is read from MODEL"),
    _refused(
        "--model-impl",
        "Brigade always runs its own model code (`brigade plugins` lists the architectures)",
    ),
    _refused("--skip-tokenizer-init", "text in and out needs the tokenizer; it is always loaded"),
    _refused("--hf-overrides", "overriding the model's config.json is not implemented yet"),
    _refused(
        ("--rope-scaling", "--rope-theta"),
        "RoPE comes from the model's config.json; overriding it is not implemented yet",
    ),
    _refused(
        "--disable-sliding-window",
        "sliding-window attention runs as the model's config.json says; turning it off is not "
        "implemented",
    ),
    _refused(
        ("--compilation-config", "-O", "--cuda-graph-sizes", "--max-seq-len-to-capture"),
        'CUDA graphs come from [executor] plugin = "cuda-graph", whose capture_sizes and '
        "mixed_capture_tokens set what is captured (docs/config.md)",
    ),
    _refused(
        ("--limit-mm-per-prompt", "--mm-processor-kwargs"),
        "multimodal input is not implemented yet: text only",
    ),
    _refused(
        "--override-generation-config",
        "sampling defaults come from the model (generation_config.json, a GGUF's "
        "general.sampling.*) or are OpenAI's: --generation-config auto|vllm",
    ),
    _refused(
        "--max-logprobs",
        "fixed: at most 20 top_logprobs (chat) and 5 logprobs (completions) per request",
    ),
    _refused("--logprobs-mode", _NOT_YET),
    _refused("--enable-prompt-embeds", _NOT_YET),
    _refused("--reasoning-parser", "reasoning output (reasoning_content) is not implemented yet"),
    _refused(
        ("--structured-outputs-config", "--guided-decoding-backend"),
        'structured output is the [grammar] station: plugin = "xgrammar" (the default) or a '
        "third-party grammar backend (`brigade plugins`)",
    ),
    _refused(
        "--logits-processors",
        "logits processors are registered plugins chosen by name (docs/plugins.md): "
        "[sampler] logits_processors",
    ),
    _refused(
        ("--long-prefill-token-threshold", "--max-num-partial-prefills"),
        "not implemented; --max-num-batched-tokens bounds the prefill of one step",
    ),
    _refused(
        "--async-scheduling",
        "not implemented yet: each step is scheduled after the previous one has run",
    ),
    _refused(
        "--scheduler-cls",
        'pick a scheduling policy by name: [scheduler] plugin = "fcfs", "priority", "lpm" or a '
        "third-party policy (`brigade plugins`)",
    ),
    _refused(
        "--prefix-caching-hash-algo",
        'the prefix cache is chosen by [kv] plugin ("paged": hash chain, "radix": token tree)',
    ),
    _refused(
        ("--kv-transfer-config", "--kv-events-config"),
        "KV transfer and KV events are not implemented yet",
    ),
    _refused("--enable-sleep-mode", _NOT_YET),
    _refused(
        "--enable-log-requests",
        "prompts are never logged; each request logs one request_finished event (token "
        "counts and timings)",
    ),
    _refused(
        "--uvicorn-log-level",
        "uvicorn's level is fixed at warning; Brigade's own events are structured logs",
    ),
    _refused(
        ("--otlp-traces-endpoint", "--collect-detailed-traces"),
        "tracing is not implemented yet; metrics are at GET /metrics",
    ),
    _refused(
        ("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs"),
        "TLS is not implemented: put a TLS-terminating proxy in front of brigade serve",
    ),
    _refused("--root-path", "not implemented: strip the path prefix in your proxy"),
    _refused("--uds", "a Unix socket is not implemented: use --host and --port"),
    _refused(
        ("--allowed-origins", "--allowed-methods", "--allowed-headers", "--allow-credentials"),
        "CORS is not implemented yet: no CORS headers are sent; add them in a proxy",
    ),
    _refused("--middleware", "extend Brigade with plugins (docs/plugins.md)"),
    _refused("--disable-fastapi-docs", "the OpenAPI schema is always served at /schema"),
    _refused("--response-role", "the role of a chat answer is always assistant; not configurable"),
    _refused(
        "--chat-template-content-format",
        "text content parts are always joined into one string (vLLM's string format)",
    ),
    _refused("--tool-parser-plugin", "tool calls are read in the hermes format only"),
    _refused(
        (
            "--return-tokens-as-token-ids",
            "--enable-prompt-tokens-details",
            "--enable-force-include-usage",
            "--enable-request-id-headers",
            "--enable-server-load-tracking",
        ),
        _NOT_YET,
    ),
)
"""Every vLLM ``serve`` flag ``brigade serve`` knows, by topic; ``--help`` (which leaves the
refused ones out) and docs/vllm.md list them by status, in this order within each status."""
