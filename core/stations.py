"""The engine's stations: one config table each, with the options every plugin of it shares."""

from __future__ import annotations

import dataclasses

from brigade.interfaces import option

__all__ = [
    "STATIONS",
    "GrammarSettings",
    "KVSettings",
    "ModelSettings",
    "NoSettings",
    "RouterSettings",
    "SamplerSettings",
    "SchedulerSettings",
    "ServerSettings",
    "SpeculativeSettings",
    "Station",
    "check_api_key",
]

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    path: str = option(
        "default",
        help="a GGUF file, a Hugging Face model directory, a hub name in the local Hugging "
        "Face cache, 'default' (SmolLM2-135M-Instruct) or 'random-tiny' (a random test model)",
    )
    dtype: str = option(
        "auto",
        help="weights and activations dtype; auto = the checkpoint's (float32 for quantized GGUF)",
        choices=DTYPES,
    )
    chat_template: str = option(
        "",
        help="a Jinja chat template: a file path (read once at start-up; only the operator's "
        "config names a template file, never a request) or the template itself; '' = the "
        "model's",
    )
    generation_config: str = option(
        "auto",
        help="sampling defaults of requests that leave them unset: auto = the model's "
        "recommendation (generation_config.json, a GGUF's general.sampling.*), none = "
        "OpenAI's (temperature 1, top_p 1)",
        choices=("auto", "none"),
    )
    max_model_len: int = option(
        0, help="longest sequence (prompt + output); 0 = the model's own limit", ge=0
    )
    seed: int = option(0, help="seed of the shared generator for unseeded requests", ge=0)


@dataclasses.dataclass(frozen=True)
class KVSettings:
    page_size: int = option(16, help="tokens per KV page", ge=1, le=4096)
    num_pages: int = option(
        0,
        help="KV pool size in pages; 0 = size from memory. A pool larger than the machine's "
        "memory, or than the executor's free memory after the weights, is a config error "
        "before it is allocated",
        ge=0,
    )
    memory_fraction: float = option(
        0.5, help="share of the memory free after loading weights given to KV", gt=0, le=1
    )
    max_memory_gib: float = option(4.0, help="upper bound of the KV pool in GiB", gt=0)
    cache_dtype: str = option("auto", help="KV cache dtype; auto = model dtype", choices=DTYPES)
    enable_prefix_caching: bool = option(True, help="reuse KV of shared prompt prefixes")
    swap_space_gib: float = option(
        1.0, help="host memory for swapped-out pages ([scheduler] preemption = 'swap')", ge=0
    )


@dataclasses.dataclass(frozen=True)
class SchedulerSettings:
    max_num_seqs: int = option(
        128,
        help="most requests in one step (the offline LLM API: 256 unless set); each holds a "
        "row of max_model_len token ids and one of the vocabulary's size from the start, "
        "which must fit the machine's memory",
        ge=1,
    )
    max_num_batched_tokens: int = option(
        2048,
        help="token budget of one step, shared by prefill chunks and decodes (the offline LLM "
        "API: 4096 unless set); one step's activations for this many tokens must fit the "
        "machine's memory",
        ge=1,
    )
    enable_chunked_prefill: bool = option(
        True, help="split long prompts across steps so decodes keep running"
    )
    preemption: str = option(
        "recompute",
        help="what a preempted request loses: its pages (recompute) or nothing (swap to "
        "host memory; recompute when the host pool is full)",
        choices=("recompute", "swap"),
    )


@dataclasses.dataclass(frozen=True)
class SpeculativeSettings:
    num_speculative_tokens: int = option(
        5, help="most draft tokens one request verifies in one step (k)", ge=1, le=64
    )
    max_tokens_per_step: int = option(
        8,
        help="drafts fill a step up to this many tokens (one per running request plus the "
        "drafts), the likeliest drafts first: on a CPU a step of up to ~8 rows costs about "
        "what a one-row step does (the weights are read once), more rows cost compute; on a "
        "GPU raise it to 64 or more",
        ge=1,
    )
    max_batch_size: int = option(
        8,
        help="speculate only in steps where at most this many requests run (vLLM's "
        "disable_by_batch_size)",
        ge=1,
    )
    min_acceptance_rate: float = option(
        0.1,
        help="a request whose acceptance rate (a moving average over its verifications) "
        "falls below this stops speculating for 16 steps, then tries one draft again",
        ge=0,
        le=1,
    )
    adaptive: bool = option(
        True,
        help="per-request draft length: after a step that rejected a draft a request proposes "
        "at most accepted + 1 tokens, and one more after each step that accepted them all, "
        "up to num_speculative_tokens; false = always num_speculative_tokens",
    )


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    logits_processors: tuple[str, ...] = option(
        (),
        help="registered logits_processor components every request goes through, in this "
        "order, after its own logit_bias and penalties and before min_tokens and the grammar "
        "mask; each one's options go in [sampler.logits_processor_options.<name>]",
    )


@dataclasses.dataclass(frozen=True)
class GrammarSettings:
    mask_budget_ms: float = option(
        100.0,
        help="longest a constrained request's grammar may take to compute one token's mask (or "
        "to accept one token), off the step loop: past it the request fails alone (400) and "
        "the others keep their pace",
        gt=0,
        le=60000,
    )


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    host: str = option("127.0.0.1", help="address to listen on")
    port: int = option(8000, help="TCP port", ge=0, le=65535)
    api_keys: tuple[str, ...] = option(
        (),
        help="accepted bearer tokens; empty = no authentication. Each key is one or more "
        "visible characters: no spaces, tabs, line breaks or control characters (an empty or "
        "blank key is an error, not an open server)",
    )
    served_model_name: str = option("", help="model id clients use; '' = the directory name")
    max_request_bytes: int = option(1 << 20, help="largest request body accepted", ge=1024)
    max_waiting_requests: int = option(
        256, help="requests waiting for their first token before new ones get 503", ge=1
    )
    requests_per_minute: int = option(0, help="per API key (or client); 0 = no limit", ge=0)
    tokens_per_minute: int = option(
        0, help="prompt + max tokens per API key (or client); 0 = no limit", ge=0
    )
    shutdown_timeout_s: float = option(
        30.0,
        help="on SIGTERM, how long running requests may take to finish; then they end with "
        "finish_reason 'abort'",
        ge=0,
    )
    header_timeout_s: float = option(
        10.0, help="a connection that has not sent a request's headers within this is closed", gt=0
    )
    body_timeout_s: float = option(
        30.0, help="a request body that has not fully arrived within this gets 408", gt=0
    )
    keep_alive_timeout_s: float = option(
        5.0, help="an idle keep-alive connection is closed after this", gt=0
    )
    max_connections: int = option(
        2048, help="open connections beyond this are closed at once (new requests: 503)", ge=1
    )
    metrics_names: str = option(
        "brigade",
        help="/metrics names: brigade (brigade:*), vllm (vLLM's vllm:* names and labels, for "
        "dashboards built for vLLM) or both",
        choices=("brigade", "vllm", "both"),
    )
    embedding_pooling: str = option(
        "last",
        help="how /v1/embeddings pools the model's final hidden states: last (the last "
        "token's, as vLLM pools decoder models) or mean (every token's; such requests skip "
        "the prefix cache)",
        choices=("last", "mean"),
    )
    embedding_normalize: bool = option(
        True, help="/v1/embeddings vectors have unit L2 norm (a request's normalize overrides)"
    )
    engine_process: bool = option(
        True,
        help="run the engine core in its own process, talking to the HTTP front end(s) over "
        "ZMQ; false runs it on a thread of the one HTTP process",
    )
    api_server_count: int = option(
        1,
        help="HTTP front-end processes sharing the port, all feeding the one engine process "
        "(more than 1 needs engine_process = true); at most 2 per CPU core of the machine",
        ge=1,
    )
    engine_step_timeout_s: float = option(
        120.0,
        help="an engine that makes no progress for this long (one step stuck in a plugin or "
        "a kernel) has failed: the server answers 503 and exits 1 so that its supervisor "
        "restarts it; 0 = never (else at least 1)",
        ge=0,
    )

    def __post_init__(self) -> None:
        for index, key in enumerate(self.api_keys):
            check_api_key(key, f"api_keys[{index}]")


def check_api_key(key: str, where: str) -> None:
    """``ValueError`` naming ``where`` unless ``key`` can be sent as a bearer token: one or
    more visible characters. An empty key would let a request with no key at all in (an
    absent or empty ``Authorization`` header presents the empty token); one with spaces or
    control characters cannot travel in an HTTP header as written."""
    if not key:
        problem = "is empty"
    elif key.strip() != key:
        problem = "starts or ends with whitespace" if key.strip() else "is only whitespace"
    elif bad := next((c for c in key if c.isspace() or not c.isprintable()), None):
        problem = f"holds {bad!r}, which cannot be part of a bearer token"
    else:
        return
    raise ValueError(
        f"{where} = {key!r} {problem}; an API key is one or more visible characters (no "
        "spaces, tabs, line breaks or control characters); to serve without "
        "authentication, configure no key at all"
    )


@dataclasses.dataclass(frozen=True)
class RouterSettings:
    data_parallel_size: int = option(
        1,
        help="engine replicas, each with its own scheduler and KV cache, behind the router: "
        "brigade generate and brigade serve run each in its own process (a Ray actor with "
        '[executor] distributed_executor_backend = "ray"); brigade bench simulates them with '
        "the simulated executor. On this machine's CPU, data_parallel_size x [executor] "
        "tensor_parallel_size is at most its cores (one rank per core); other local replicas "
        "at most 2 per core",
        ge=1,
    )


@dataclasses.dataclass(frozen=True)
class NoSettings:
    """A station whose table holds only its plugin's options."""


@dataclasses.dataclass(frozen=True, slots=True)
class Station:
    name: str
    kind: str | None
    """The component kind its ``plugin`` names; None for a table without a plugin."""
    default_plugin: str | None
    settings_type: type
    summary: str = ""
    """One line for the config reference."""
    chain_kind: str | None = None
    """The component kind that the setting ``<chain_kind>s`` lists by name, in order (the
    sampler's ``logits_processors``); each listed component's options are the sub-table
    ``[<station>.<chain_kind>_options.<name>]``."""

    @property
    def chain_key(self) -> str | None:
        """The setting that lists the chain (``logits_processors``); None without a chain."""
        return None if self.chain_kind is None else f"{self.chain_kind}s"

    @property
    def chain_options_key(self) -> str | None:
        """The sub-table of the chain's options (``logits_processor_options``)."""
        return None if self.chain_kind is None else f"{self.chain_kind}_options"


STATIONS: dict[str, Station] = {
    s.name: s
    for s in (
        Station(
            "model",
            None,
            None,
            ModelSettings,
            "Which model to load; the architecture comes from its config.json.",
        ),
        Station("kv", "kv", "paged", KVSettings, "The KV page pool and its manager."),
        Station(
            "scheduler",
            "scheduler",
            "fcfs",
            SchedulerSettings,
            "Who runs each step, under one token budget.",
        ),
        Station(
            "speculative",
            "proposer",
            None,
            SpeculativeSettings,
            "Speculative decoding: a proposer drafts tokens, one step verifies them exactly. "
            "Off unless `plugin` names a proposer.",
        ),
        Station("executor", "executor", "torch", NoSettings, "Runs the forward pass."),
        Station("attention", "attention", "sdpa", NoSettings, "Reads and writes the paged KV."),
        Station(
            "sampler",
            "sampler",
            "standard",
            SamplerSettings,
            "Chooses tokens from logits, after its logits processors.",
            chain_kind="logits_processor",
        ),
        Station(
            "grammar",
            "grammar",
            "xgrammar",
            GrammarSettings,
            "Structured output: compiles a request's grammar and masks its logits to it.",
        ),
        Station(
            "detokenizer",
            "detokenizer",
            "incremental",
            NoSettings,
            "Turns tokens into text and finds stop strings.",
        ),
        Station(
            "router",
            "router",
            "round-robin",
            RouterSettings,
            "Places each new request on one of the data-parallel engine replicas.",
        ),
        Station("server", None, None, ServerSettings, "The HTTP server of `brigade serve`."),
    )
}
"""Every table a config may contain, in the order a step visits them."""
