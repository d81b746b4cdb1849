"""vLLM's ``serve`` flags and what ``brigade serve`` does with each: the one table from which
the parser's arguments (:mod:`brigade.serve_args`) and the tables of docs/vllm.md are made.

A flag is one of three things:

- an **alias** of a config key: its value, mapped from vLLM's spelling where it differs
  (``--dtype half`` is ``float16``, ``--max-model-len 32K`` is 32768), becomes the ``--set``
  override of that key;
- **accepted**: vLLM's meaning is already what Brigade does; a one-line note says so;
- **refused**: Brigade has no such feature; a one-line error names the flag and, where there
  is one, the Brigade equivalent.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any, Literal

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


# --- vLLM values -> Brigade values --------------------------------------------------------

_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _token_count(text: str) -> int:
    """vLLM's human-readable integers: 4096; 4k = 4000 and 25.6k = 25600 (k m g t are powers
    of 1000); 32K = 32768 (K M G T are powers of 1024, whole numbers only)."""
    if text.strip().lower() in ("auto", "-1"):
        raise ValueError(
            "Brigade does not fit the length to memory (vLLM's auto and -1); leave the flag "
            "out for the model's own limit, or give a length"
        )
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if match is None or ("." in match[1] and match[2] not in _DECIMAL_SUFFIXES):
        raise ValueError(
            "expected a token count such as 4096, 4k (4000), 25.6k or 32K (32768); decimals "
            "only with k, m, g or t"
        )
    number, suffix = Decimal(match[1]), match[2]
    count = int(number * _DECIMAL_SUFFIXES.get(suffix, _BINARY_SUFFIXES.get(suffix, 1)))
    if count < 1:
        raise ValueError("expected at least 1 token")
    return count


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("expected an integer") from None


def _rank_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        raise ValueError("expected a whole number of ranks, 1 or more") from None
    if count < 1:
        raise ValueError("expected a whole number of ranks, 1 or more")
    return count


def _executor_backend(text: str) -> str:
    if text in ("mp", "uni"):
        return "mp"
    if text == "ray":
        return "ray"
    raise ValueError(
        "expected mp, uni or ray (external_launcher, torchrun starting every rank itself, is "
        "not supported: Brigade starts its ranks)"
    )


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise ValueError("expected a number of GiB >= 0")
    return value


def _choice(mapping: dict[str, str], *, refused: str = "") -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text in mapping:
            return mapping[text]
        allowed = f"allowed: {', '.join(mapping)}"
        raise ValueError(f"{refused}; {allowed}" if refused and text.startswith("fp8") else allowed)

    return parse


_dtype = _choice(
    {
        "auto": "auto",
        "half": "float16",
        "float16": "float16",
        "bfloat16": "bfloat16",
        "float": "float32",
        "float32": "float32",
    }
)
_kv_cache_dtype = _choice(
    {
        "auto": "auto",
        "bfloat16": "bfloat16",
        "float16": "float16",
        "half": "float16",
        "float32": "float32",
    },
    refused="there is no fp8 KV cache yet",
)
_scheduling_policy = _choice({"fcfs": "fcfs", "priority": "priority"})


def _device(text: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise ValueError("allowed: auto, cpu, cuda, cuda:N")
    return text


def _one_name(names: Sequence[str]) -> str:
    if len(names) > 1:
        raise ValueError(
            f"Brigade serves one model name and has no aliases yet, so a client naming "
            f"{names[1]!r} would get 404; give one name (put MODEL before the flags if "
            f"{names[-1]!r} was meant as the model)"
        )
    return names[0]


def _hermes(text: str) -> str:
    if text != "hermes":
        raise ValueError(
            "Brigade reads tool calls in the hermes format (`<tool_call>JSON</tool_call>`) only; "
            "allowed: hermes"
        )
    return text


def _runner(text: str) -> str:
    if text not in ("auto", "generate", "pooling", "embed", "none"):
        raise ValueError(
            "Brigade serves generation and embeddings from one engine and has no other "
            "runner (classify, score, reward, transcription: not implemented yet); allowed: "
            "auto, generate, pooling, embed, none"
        )
    return text


def _pooler_config(text: str) -> str:
    """vLLM's ``--pooler-config`` JSON -> ``server.embedding_pooling``."""
    try:
        config = json.loads(text)
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise ValueError('expected a JSON object such as \'{"pooling_type": "MEAN"}\'')
    others = sorted(set(config) - {"pooling_type"})
    if others:
        raise ValueError(
            f"only pooling_type is supported, not {', '.join(others)} (normalization: "
            "--set server.embedding_normalize=false)"
        )
    kind = str(config.get("pooling_type", "LAST")).upper()
    if kind not in ("LAST", "MEAN"):
        raise ValueError(f"pooling_type {kind} is not supported; allowed: LAST, MEAN")
    return kind.lower()


_SPECULATIVE_KEYS = {
    "num_speculative_tokens": "num_speculative_tokens",
    "disable_by_batch_size": "max_batch_size",
    "prompt_lookup_max": "max_n",
    "prompt_lookup_min": "min_n",
    "suffix_decoding_max_tree_depth": "max_depth",
    "suffix_decoding_max_cached_requests": "max_cached_requests",
    "suffix_decoding_max_spec_factor": "max_spec_factor",
    "suffix_decoding_min_token_prob": "min_probability",
    "model": "model",
}
"""vLLM's ``--speculative-config`` keys -> ``[speculative]`` keys (the method's options)."""
_METHOD_KEYS = frozenset(
    key
    for key in _SPECULATIVE_KEYS
    if key.startswith(("prompt_lookup", "suffix_decoding", "model"))
)
"""Keys that belong to one method (the prefix of its keys in ``_speculative_config``)."""
_SPECULATIVE_METHODS = {"ngram": "ngram", "suffix": "suffix", "draft_model": "draft-model"}
"""vLLM's method names -> Brigade's proposers."""


def _speculative_config(text: str) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` JSON -> the ``[speculative]`` keys it sets (``plugin``,
    the shared settings and the method's options)."""
    try:
        config = json.loads(text)
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise ValueError(
            'expected a JSON object such as \'{"method": "ngram", "num_speculative_tokens": 5}\''
        )
    method = config.get("method")
    if method is None and "model" in config:
        method = "draft_model"
    plugin = _SPECULATIVE_METHODS.get(method)  # type: ignore[arg-type]
    if plugin is None:
        raise ValueError(
            f"method {method!r} is not implemented yet (EAGLE, MTP and Medusa heads "
            f"included); allowed: {', '.join(_SPECULATIVE_METHODS)}"
        )
    # Each method's own keys: the others' are refused, not ignored.
    own = {"ngram": "prompt_lookup", "suffix": "suffix_decoding", "draft-model": "model"}[plugin]
    table: dict[str, Any] = {"plugin": plugin}
    unknown = []
    for key, value in config.items():
        if key == "method":
            continue
        target = _SPECULATIVE_KEYS.get(key)
        if target is None or (key in _METHOD_KEYS and not key.startswith(own)):
            unknown.append(key)
            continue
        table[target] = value
    if plugin == "draft-model" and "model" not in table:
        raise ValueError('method "draft_model" needs "model": the draft model\'s path')
    if unknown:
        allowed = ", ".join(
            k for k in _SPECULATIVE_KEYS if k not in _METHOD_KEYS or k.startswith(own)
        )
        raise ValueError(
            f"{', '.join(sorted(unknown))}: not supported with method {method!r}; "
            f"allowed: method, {allowed}"
        )
    return table


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
        parse=_one_name,
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
        "--port", "server.port", "TCP port (default 8000, as vLLM)", parse=_integer, metavar="PORT"
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
        parse=_token_count,
        metavar="LEN",
    ),
    _alias(
        "--dtype",
        "model.dtype",
        "weights and activations: auto (the checkpoint's dtype; vLLM's auto would run a "
        "float32 checkpoint in float16), half or float16, bfloat16, float or float32",
        parse=_dtype,
        metavar="DTYPE",
    ),
    _alias(
        "--kv-cache-dtype",
        "kv.cache_dtype",
        "auto (the model's dtype), bfloat16, float16 or half, float32; fp8 variants are "
        "refused (no fp8 KV cache yet)",
        parse=_kv_cache_dtype,
        metavar="DTYPE",
    ),
    _alias(
        "--seed",
        "model.seed",
        "seed of the shared generator for requests that set no seed",
        parse=_integer,
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
        parse=_choice({"auto": "auto", "vllm": "none"}),
        metavar="auto|vllm",
    ),
    _alias(
        "--block-size",
        "kv.page_size",
        "tokens per KV page (vLLM's block); `brigade config check` says which sizes the "
        "attention backend reads",
        parse=_integer,
        metavar="N",
    ),
    _alias(
        "--num-gpu-blocks-override",
        "kv.num_pages",
        "KV pool size in pages, instead of sizing the pool from memory",
        parse=_integer,
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
        "scoring them together once (the sdpa backend's C++ decode kernel on a CPU)",
        arity="switch",
        parse=lambda _: False,
    ),
    _alias(
        "--swap-space",
        "kv.swap_space_gib",
        "GiB of host memory for swapped-out KV pages, used only with [scheduler] "
        'preemption = "swap" (vLLM: per GPU)',
        parse=_gib,
        metavar="GIB",
    ),
    _alias("--max-num-seqs", "scheduler.max_num_seqs", "most requests in one step", parse=_integer),
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
        parse=_integer,
        metavar="N",
    ),
    _alias(
        "--max-num-batched-tokens",
        "scheduler.max_num_batched_tokens",
        "token budget of one step, shared by prefill chunks and decodes (2k, 8K as for "
        "--max-model-len)",
        parse=_token_count,
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
        parse=_scheduling_policy,
        metavar="POLICY",
    ),
    _alias(
        "--device",
        "executor.device",
        "auto, cpu, cuda or cuda:N (an option of the torch and cuda-graph executors)",
        parse=_device,
        metavar="DEVICE",
    ),
    _alias(
        ("--tensor-parallel-size", "-tp"),
        "executor.tensor_parallel_size",
        "ranks the model is split over: processes on this machine, one GPU each on CUDA (an "
        "option of the torch executor; docs/distributed.md)",
        parse=_rank_count,
        metavar="N",
    ),
    _alias(
        ("--data-parallel-size", "-dp"),
        "router.data_parallel_size",
        "engine replicas behind the router station, each in its own process (or Ray actor, with "
        "--distributed-executor-backend ray) with its share of the cores (docs/distributed.md)",
        parse=_rank_count,
        metavar="N",
    ),
    _alias(
        "--distributed-executor-backend",
        "executor.distributed_executor_backend",
        "where tensor-parallel ranks and the data-parallel replicas run: mp (processes on this "
        "machine; vLLM's uni means the same here) or ray (actors on a Ray cluster); vLLM's "
        "external_launcher is refused",
        parse=_executor_backend,
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
        check=_hermes,
        metavar="PARSER",
    ),
    _accepted(
        ("--runner", "--task", "--convert"),
        "one engine serves both /v1/chat/completions and /v1/embeddings (the decoder's "
        "pooled hidden states); auto, generate, pooling, embed and none all mean that",
        check=_runner,
        metavar="RUNNER",
    ),
    _alias(
        "--pooler-config",
        "server.embedding_pooling",
        'how /v1/embeddings pools: {"pooling_type": "LAST"} (the default) or "MEAN"',
        parse=_pooler_config,
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
        parse=_speculative_config,
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
"""Every vLLM ``serve`` flag ``brigade serve`` knows: aliases, then accepted, then refused (the
order of ``--help``, which leaves the refused ones out, and of docs/vllm.md)."""
