"""The ``simulated`` executor: no weights, a roofline cost model and a virtual clock.

It reads only the model's shape from its config (``params.checkpoint.config``), charges each
step the time a named GPU would need (see ``docs/simulator.md``) to
:meth:`SimulatedExecutor.modelled_time_s` instead of sleeping (``models_time``: the simulator's
virtual clock advances by it), and returns token ids directly (``returns_token_ids``), so the
real scheduler and KV manager run at datacenter scale on a CPU. Output lengths come from the
workload: requests run to ``max_tokens`` with ``ignore_eos``.

Speculative decoding is modelled too: a request verifying drafts is 1 + k decode rows, charged
like any decode rows, and the id returned at a draft's position matches that draft with
probability ``draft_acceptance`` (see :meth:`SimulatedExecutor.execute`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from brigade.interfaces import (
    ConfigError,
    Executor,
    ExecutorParams,
    KVCacheSpec,
    ModelInput,
    ModelLoadError,
    option,
)

__all__ = [
    "GPUS",
    "CostModel",
    "GpuSpec",
    "ModelShape",
    "SimulatedExecutor",
    "SimulatedExecutorOptions",
    "StepProfile",
]

BYTES_PER_ELEMENT = 2
"""Weights, activations and KV are modelled in bf16."""
GIB = 1 << 30


@dataclasses.dataclass(frozen=True, slots=True)
class GpuSpec:
    """Datasheet figures of one GPU."""

    peak_flops: float
    """Dense bf16 FLOP/s."""
    bandwidth: float
    """HBM bytes/s."""
    memory_bytes: int
    link_bandwidth: float
    """NVLink bytes/s one GPU sends to the others (half the bidirectional datasheet figure)."""
    link_latency_s: float = 10e-6
    """Fixed cost of one all-reduce (launch and synchronisation), seconds."""


GPUS: dict[str, GpuSpec] = {
    # SXM, NVLink 4: 900 GB/s bidirectional
    "H100": GpuSpec(
        peak_flops=989e12, bandwidth=3.35e12, memory_bytes=80 * GIB, link_bandwidth=450e9
    ),
    "H200": GpuSpec(
        peak_flops=989e12, bandwidth=4.8e12, memory_bytes=141 * GIB, link_bandwidth=450e9
    ),
    # SXM 80GB, NVLink 3: 600 GB/s bidirectional
    "A100": GpuSpec(
        peak_flops=312e12, bandwidth=2.0e12, memory_bytes=80 * GIB, link_bandwidth=300e9
    ),
}


@dataclasses.dataclass(frozen=True)
class SimulatedExecutorOptions:
    """Options of the ``simulated`` executor."""

    gpu: str = option(
        "H100", help="GPU whose datasheet figures the cost model uses", choices=tuple(GPUS)
    )
    num_gpus: int = option(
        1,
        help="GPUs sharing the model by tensor parallelism: FLOP/s, bandwidth and memory add "
        "up, and every layer all-reduces the step's activations twice over NVLink",
        ge=1,
    )
    step_overhead_s: float = option(0.002, help="fixed cost of every step in seconds", ge=0)
    efficiency: float = option(
        0.6, help="fraction of peak FLOP/s and bandwidth reached", gt=0, le=1
    )
    profile: str = option(
        "", help="JSON calibration file of measured step times; '' = the analytic model"
    )
    seed: int = option(0, help="seed of the generator the returned token ids come from", ge=0)
    draft_acceptance: float = option(
        0.7,
        help="speculative decoding: probability that the id returned at a draft's position is "
        "that draft, independently at each position (all k drafts: p^k)",
        ge=0,
        le=1,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ModelShape:
    """What the cost model needs from ``config.json``."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> ModelShape:
        """Read a Llama-style config; ``ValueError`` names a missing or bad key."""

        def positive(key: str, default: int | None = None) -> int:
            value = hf_config.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
            return value

        hidden, heads = positive("hidden_size"), positive("num_attention_heads")
        return cls(
            num_layers=positive("num_hidden_layers"),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=positive("num_key_value_heads", heads),
            head_dim=positive("head_dim", hidden // heads or None),
            intermediate_size=positive("intermediate_size"),
            vocab_size=positive("vocab_size"),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        )

    @property
    def layer_params(self) -> int:
        """Parameters of the decoder layers (attention and gated MLP; norms neglected)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q_size + 2 * kv_size) + q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attention + mlp)

    @property
    def num_params(self) -> int:
        embeddings = self.vocab_size * self.hidden_size
        return self.layer_params + embeddings * (1 if self.tie_word_embeddings else 2)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * BYTES_PER_ELEMENT


@dataclasses.dataclass(frozen=True, slots=True)
class StepProfile:
    """Measured step times that replace the analytic model (see ``docs/simulator.md``)."""

    prefill_tokens_per_s: float
    decode_step_s_at: tuple[tuple[int, float], ...]
    """(decode batch size, step seconds), sorted by batch size."""

    @classmethod
    def load(cls, path: str | Path) -> StepProfile:
        """Read ``{"prefill_tokens_per_s": x, "decode_step_s_at": {"1": s, "64": s, ...}}``."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"simulator profile {path}: cannot read JSON: {exc}") from exc
        rate = data.get("prefill_tokens_per_s") if isinstance(data, dict) else None
        table = data.get("decode_step_s_at") if isinstance(data, dict) else None
        if not isinstance(rate, int | float) or rate <= 0:
            raise ConfigError(f"simulator profile {path}: prefill_tokens_per_s must be > 0")
        if not isinstance(table, dict) or not table:
            raise ConfigError(
                f"simulator profile {path}: decode_step_s_at must map batch sizes to seconds, "
                'e.g. {"1": 0.02, "64": 0.03}'
            )
        try:
            points = sorted((int(size), float(seconds)) for size, seconds in table.items())
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"simulator profile {path}: decode_step_s_at: {exc}") from exc
        if any(size < 1 or seconds <= 0 for size, seconds in points):
            raise ConfigError(f"simulator profile {path}: batch sizes and seconds must be > 0")
        return cls(float(rate), tuple(points))

    def decode_step_s(self, batch_size: int) -> float:
        """Linear interpolation of the table; linear extrapolation past its ends."""
        points = self.decode_step_s_at
        if len(points) == 1:
            return points[0][1]
        index = next((i for i, (size, _) in enumerate(points) if size >= batch_size), len(points))
        (x0, y0), (x1, y1) = points[min(max(index - 1, 0), len(points) - 2) :][:2]
        return max(0.0, y0 + (y1 - y0) * (batch_size - x0) / (x1 - x0))


@dataclasses.dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds one step takes: overhead + max(compute, memory) + communication on
    ``num_gpus`` GPUs."""

    shape: ModelShape
    gpu: GpuSpec
    num_gpus: int = 1
    efficiency: float = 0.6
    step_overhead_s: float = 0.002
    profile: StepProfile | None = None

    def step_time(self, query_lens: list[int], seq_lens: list[int], num_sampled: int) -> float:
        """A step whose rows compute ``query_lens`` new tokens up to ``seq_lens`` context."""
        if self.profile is not None:
            decodes = sum(1 for q in query_lens if q == 1)
            prefill_tokens = sum(q for q in query_lens if q > 1)
            decode_s = self.profile.decode_step_s(decodes) if decodes else 0.0
            return decode_s + prefill_tokens / self.profile.prefill_tokens_per_s
        return (
            self.step_overhead_s
            + max(
                self.compute_s(query_lens, seq_lens, num_sampled),
                self.memory_s(query_lens, seq_lens),
            )
            + self.communication_s(sum(query_lens))
        )

    def communication_s(self, num_tokens: int) -> float:
        """Tensor parallel's all-reduces: two per layer (after attention's output projection
        and after the MLP) of ``num_tokens`` x hidden bf16 activations, each a ring
        all-reduce (every GPU sends ``2 (n - 1) / n`` of the bytes) plus a fixed latency; not
        overlapped with compute. Zero on one GPU."""
        n = self.num_gpus
        if n == 1:
            return 0.0
        shape, gpu = self.shape, self.gpu
        message = num_tokens * shape.hidden_size * BYTES_PER_ELEMENT
        sent = 2 * (n - 1) / n * message
        one = gpu.link_latency_s + sent / (gpu.link_bandwidth * self.efficiency)
        return 2 * shape.num_layers * one

    def compute_s(self, query_lens: list[int], seq_lens: list[int], num_sampled: int) -> float:
        """Matmul FLOPs (2 per parameter per token; LM head only on sampled rows) + attention."""
        shape = self.shape
        lm_head = shape.vocab_size * shape.hidden_size
        matmul = 2 * (shape.layer_params * sum(query_lens) + lm_head * num_sampled)
        context = sum(q * s for q, s in zip(query_lens, seq_lens, strict=True))
        attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * context
        return (matmul + attention) / (self.gpu.peak_flops * self.num_gpus * self.efficiency)

    def memory_s(self, query_lens: list[int], seq_lens: list[int]) -> float:
        """Weights read once per step, every row's context KV read, the new tokens' KV written."""
        shape = self.shape
        weights = (shape.layer_params + shape.vocab_size * shape.hidden_size) * BYTES_PER_ELEMENT
        kv = (sum(seq_lens) + sum(query_lens)) * shape.kv_bytes_per_token
        return (weights + kv) / (self.gpu.bandwidth * self.num_gpus * self.efficiency)


class SimulatedExecutor(Executor):
    """Charges each step's modelled cost to :meth:`modelled_time_s` and returns random token
    ids."""

    returns_token_ids: ClassVar[bool] = True
    models_time: ClassVar[bool] = True

    def __init__(self, params: ExecutorParams, options: SimulatedExecutorOptions) -> None:
        self.params = params
        hf_config = params.checkpoint.config
        try:
            self.shape = ModelShape.from_hf_config(hf_config)
        except ValueError as exc:
            raise ModelLoadError(f"{params.model_path}: {exc}") from exc
        self.gpu = GPUS[options.gpu]
        self.num_gpus = options.num_gpus
        weight_bytes = self.shape.num_params * BYTES_PER_ELEMENT
        self.available_bytes = self.gpu.memory_bytes * options.num_gpus - weight_bytes
        if self.available_bytes <= 0:
            raise ConfigError(
                f"[executor] simulated: {weight_bytes / GIB:.1f} GiB of bf16 weights do not fit "
                f"in {options.num_gpus} x {options.gpu} ({self.gpu.memory_bytes / GIB:.0f} GiB "
                "each); raise num_gpus or choose a larger gpu"
            )
        profile = StepProfile.load(options.profile) if options.profile else None
        self.cost = CostModel(
            self.shape,
            self.gpu,
            options.num_gpus,
            options.efficiency,
            options.step_overhead_s,
            profile,
        )
        self.max_model_len = params.max_model_len or int(
            hf_config.get("max_position_embeddings") or 0
        )
        if self.max_model_len < 1:
            raise ConfigError(
                "[executor] simulated: config.json has no max_position_embeddings; "
                "set [model] max_model_len"
            )
        self.generator = torch.Generator().manual_seed(options.seed)
        self.draft_acceptance = options.draft_acceptance
        self._modelled_time_s = 0.0
        self.last_step_s = 0.0
        """The modelled cost of the latest step."""
        self.num_pages = 0

    @property
    def device(self) -> torch.device:
        """The CPU: the simulator returns token ids on the host."""
        return torch.device("cpu")

    def kv_cache_spec(self) -> KVCacheSpec:
        """bf16 K and V of every layer per page; GPU memory minus the weights is free."""
        return KVCacheSpec(
            num_layers=self.shape.num_layers,
            page_size=self.params.page_size,
            bytes_per_page=self.shape.kv_bytes_per_token * self.params.page_size,
            available_bytes=self.available_bytes,
            max_model_len=self.max_model_len,
            vocab_size=self.shape.vocab_size,
        )

    def initialize_kv_cache(self, num_pages: int, num_host_pages: int = 0) -> None:
        """Nothing to allocate: the KV pool exists only in the KV manager's accounting."""
        if num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {num_pages}")
        self.num_pages = num_pages

    def modelled_time_s(self) -> float:
        """The sum of every executed step's modelled cost, in seconds."""
        return self._modelled_time_s

    def execute(self, batch: ModelInput) -> torch.Tensor:
        """Charge the step's cost to :meth:`modelled_time_s`; return int64 token ids ``[S]``
        drawn from the seed.

        A logits row followed by a draft row of its request (speculative decoding: the next
        row's input id is the draft the returned id is checked against) returns that draft
        with probability ``draft_acceptance`` and any other id otherwise; every other row
        returns a uniformly random id."""
        query_lens = torch.diff(batch.query_start_loc_cpu).tolist()
        seq_lens = batch.seq_lens_cpu.tolist()
        num_sampled = int(batch.logits_indices.shape[0])
        self.last_step_s = self.cost.step_time(query_lens, seq_lens, num_sampled)
        self._modelled_time_s += self.last_step_s
        token_ids = torch.randint(
            0, self.shape.vocab_size, (num_sampled,), generator=self.generator, dtype=torch.int64
        )
        if batch.num_decodes > 1:
            self._answer_drafts(batch, token_ids)
        return token_ids

    def _answer_drafts(self, batch: ModelInput, token_ids: torch.Tensor) -> None:
        """Overwrite ``token_ids`` at the logits rows that verify a draft.

        A draft row is the decode row after its request's previous one: the same block table,
        one more token of context. Rows of two requests never share the page being written, so
        equal tables with consecutive lengths identify a request's rows. Draws from the
        generator only in steps that verify drafts, so runs without speculation are unchanged.
        """
        num_decodes = batch.num_decodes  # decode rows have one token: row index == token index
        seq_lens = batch.seq_lens_cpu[:num_decodes]
        follows = seq_lens[1:] == seq_lens[:-1] + 1  # [D - 1]: row i + 1 may continue row i
        candidates = follows.nonzero().squeeze(1)
        if candidates.numel() == 0:
            return
        tables = batch.block_tables
        follows[candidates] = (tables[candidates] == tables[candidates + 1]).all(dim=1)
        drafted = torch.zeros(batch.num_tokens, dtype=torch.bool)  # [T]: a draft row follows
        drafted[: num_decodes - 1] = follows
        logits_rows = batch.logits_indices  # [S]
        verifying = drafted[logits_rows].nonzero().squeeze(1)  # indices into token_ids
        if verifying.numel() == 0:
            return
        drafts = batch.input_ids[logits_rows[verifying] + 1]  # [V]
        accept = torch.rand(drafts.shape, generator=self.generator) < self.draft_acceptance
        # A rejection is any other id: draw from vocab - 1 ids and skip the draft's.
        others = torch.randint(0, self.shape.vocab_size - 1, drafts.shape, generator=self.generator)
        others += others >= drafts
        token_ids[verifying] = torch.where(accept, drafts, others)
