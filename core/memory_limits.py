"""Memory the model and the settings allocate up front, held to this machine's memory before
anything is allocated (``brigade.limits`` holds the process counts to its cores).

The figures are lower bounds of what is allocated, read from the config and the checkpoint's
headers, so a config refused here could never have run: it would have ended in an allocator's
traceback or the kernel's out-of-memory killer, after the weights had loaded. A config is an
``EngineConfig`` typed ``Any``, as in ``brigade.limits``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from brigade import limits
from brigade.errors import ConfigError
from brigade.replica_devices import executor_device

if TYPE_CHECKING:
    from brigade.interfaces import Checkpoint
    from brigade.registry import Registry

__all__ = ["check_memory"]

GIB = 1 << 30
_ELEMENT_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True, slots=True)
class _Need:
    """Memory one setting (or the model) allocates up front."""

    what: str
    """The setting and its value, as the message names it."""
    bytes: int
    fix: str
    """What to change when it is the largest need."""


def check_memory(
    config: Any, registry: Registry, checkpoint: Checkpoint, *, ask_gpus: bool = True
) -> None:
    """``ConfigError`` naming the key, what it would need and what the machine has when the
    model's weights and the memory the settings allocate up front cannot fit this machine
    (its host memory, or its largest GPU's when that is larger).

    What is counted (each a lower bound): the weights at the model's dtype (from the
    checkpoint's headers) and its RoPE tables (``max_position_embeddings`` positions);
    ``[kv] num_pages`` x ``page_size`` tokens of K and V in every layer (the standard decoder
    layout: ``num_key_value_heads`` x ``head_dim`` per layer); ``[kv] swap_space_gib`` with
    ``preemption = "swap"``; ``[scheduler] max_num_seqs`` rows of ``max_model_len`` token ids
    and a vocabulary-wide row each; ``max_num_batched_tokens`` tokens of one step's
    activations (hidden state and MLP). An executor that models time (the simulated one)
    allocates no weights, KV or activations here: only the rows count. Without ``ask_gpus``
    (a process that should not start CUDA: the server's supervisor) a model that may run on
    a GPU is not checked here: its engine checks it.
    """
    from brigade.models.tensor_shapes import checkpoint_tensor_shapes

    shape = _ModelShape.of(checkpoint.config, config["model"].settings)
    if shape is None:
        return  # the architecture's validation names what is missing
    scheduler = config["scheduler"].settings
    max_model_len = config["model"].settings.max_model_len or shape.max_positions
    needs = [
        _Need(
            f"[scheduler] max_num_seqs = {scheduler.max_num_seqs} rows of max_model_len = "
            f"{max_model_len} token ids and a {shape.vocab_size}-token vocabulary",
            scheduler.max_num_seqs * (max_model_len * 8 + shape.vocab_size * 4),
            "lower [scheduler] max_num_seqs or [model] max_model_len",
        )
    ]
    on_gpu = False
    if not limits.executor_models_time(config, registry):
        needs += _allocations(config, shape, checkpoint_tensor_shapes(checkpoint))
        on_gpu = not limits.runs_on_cpu(executor_device(config)) and limits.cuda_available()
    if on_gpu and not ask_gpus:
        return
    memory = limits.machine_memory(gpus=on_gpu)
    total = sum(need.bytes for need in needs)
    if total <= memory.largest:
        return
    largest = max(needs, key=lambda need: need.bytes)
    raise ConfigError(
        f"{config.source}: {largest.what} would need {_size(largest.bytes)} of memory "
        f"({_size(total)} with everything else counted); {memory.describe()}: {largest.fix}"
    )


def _allocations(
    config: Any, shape: _ModelShape, shapes: Mapping[str, tuple[int, ...]]
) -> list[_Need]:
    """What an executor that runs the model allocates: weights, RoPE, KV, swap, a step."""
    kv, scheduler = config["kv"].settings, config["scheduler"].settings
    needs = [
        _Need(
            f"the model's weights ({shape.dtype})",
            shape.weights_bytes(shapes),
            "use a smaller model, or a smaller dtype ([model] dtype)",
        ),
        _Need(
            f"the model's max_position_embeddings = {shape.max_positions} (its RoPE tables)",
            shape.max_positions * shape.head_dim * 4,
            "the model's config asks for more positions than this machine holds",
        ),
        _Need(
            f"[scheduler] max_num_batched_tokens = {scheduler.max_num_batched_tokens} (one "
            "step's activations)",
            scheduler.max_num_batched_tokens * shape.activation_bytes_per_token(),
            "lower [scheduler] max_num_batched_tokens",
        ),
    ]
    if kv.num_pages:
        cache_dtype = shape.dtype if kv.cache_dtype == "auto" else kv.cache_dtype
        per_page = kv.page_size * shape.kv_bytes_per_token(_ELEMENT_SIZES[cache_dtype])
        needs.append(
            _Need(
                f"[kv] num_pages = {kv.num_pages} (pages of {kv.page_size} tokens, "
                f"{_size(per_page)} each)",
                kv.num_pages * per_page,
                "lower [kv] num_pages, or set 0 to size the pool from the memory free",
            )
        )
    if scheduler.preemption == "swap":
        needs.append(
            _Need(
                f"[kv] swap_space_gib = {kv.swap_space_gib:g}",
                int(kv.swap_space_gib * GIB),
                "lower [kv] swap_space_gib",
            )
        )
    return needs


def _size(num_bytes: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} bytes"


@dataclasses.dataclass(frozen=True, slots=True)
class _ModelShape:
    """The sizes of the standard decoder that the memory estimate reads from a config."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    dtype: str

    @classmethod
    def of(cls, hf_config: Mapping[str, Any], settings: Any) -> _ModelShape | None:
        """The sizes ``hf_config`` gives, at the dtype ``[model]`` ``settings`` resolve to;
        None when a size is missing or not an integer."""
        from brigade.models.loader import resolve_dtype_name

        def size(key: str, default: Any = None) -> int | None:
            value = hf_config.get(key, default)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        heads, hidden = size("num_attention_heads"), size("hidden_size")
        if not heads or not hidden:
            return None
        values = {
            "num_layers": size("num_hidden_layers"),
            "hidden_size": hidden,
            "intermediate_size": size("intermediate_size", 0),
            "num_heads": heads,
            "num_kv_heads": size("num_key_value_heads", heads),
            "head_dim": size("head_dim") or hidden // heads,
            "vocab_size": size("vocab_size"),
            "max_positions": size("max_position_embeddings", 0),
        }
        if any(v is None or v < 0 for v in values.values()):
            return None
        try:
            dtype = resolve_dtype_name(settings.dtype, hf_config)
        except ValueError:
            return None
        return cls(dtype=dtype, **{k: int(v or 0) for k, v in values.items()})

    @property
    def element_size(self) -> int:
        return _ELEMENT_SIZES[self.dtype]

    def kv_bytes_per_token(self, element_size: int) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    def activation_bytes_per_token(self) -> int:
        """One token's hidden state and MLP activations (gate and up) in one step."""
        return (self.hidden_size + 2 * self.intermediate_size) * self.element_size

    def weights_bytes(self, shapes: Mapping[str, tuple[int, ...]]) -> int:
        """The weights at the model's dtype: what the config builds (the embedding, each
        layer's projections and MLP), or the checkpoint's tensors when they hold more."""
        from brigade.models.tensor_shapes import num_elements

        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        per_layer = (
            self.hidden_size * (2 * q_size + 2 * kv_size)  # q, k, v and o
            + 3 * self.hidden_size * self.intermediate_size  # gate, up and down
        )
        built = self.vocab_size * self.hidden_size + self.num_layers * per_layer
        return max(built, num_elements(shapes)) * self.element_size
