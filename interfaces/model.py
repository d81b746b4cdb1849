"""Checkpoint and ModelArchitecture: a model's files, and the torch module that runs them.

A built model (:class:`CausalLM`) may offer its executor capabilities, each a
``runtime_checkable`` protocol the executor checks with ``isinstance``: a forward split at
attention (:class:`SplitCausalLM`), fused small operations handed in (:class:`AcceptsLayerOps`
taking :class:`LayerOps`) and its layers as data (:class:`ProvidesDecoderWeights`). A model
imports no executor, attention backend or kernels of a device: what runs fused is the
executor's choice.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from brigade.interfaces.attention import AttentionBackend, AttentionLayer

__all__ = [
    "AcceptsLayerOps",
    "CausalLM",
    "Checkpoint",
    "DecoderLayerWeights",
    "DecoderWeights",
    "LayerOps",
    "LayerOpsProvider",
    "ModelArchitecture",
    "ProvidesDecoderWeights",
    "SplitCausalLM",
]


class Checkpoint(abc.ABC):
    """A model's files as core opened them from ``[model] path``: a Hugging Face directory
    (config.json, safetensors, tokenizer.json) or a GGUF file.

    Core opens one per engine and hands the same object to the executor
    (``ExecutorParams.checkpoint``: config and weights) and to samplers
    (``SamplerParams.checkpoint``: the tokenizer). Reading :attr:`config` or the tokenizer
    never reads weights. Plugins only read a checkpoint; core owns it. Core's checkpoints
    pickle as the files to reopen, so an executor may hand one to another process (its
    tensor-parallel ranks).
    """

    path: str
    """The directory or the (first) GGUF file."""
    format: str
    """``"hf"`` or ``"gguf"``."""
    name: str
    """A short name for logs and the default served model id."""

    @property
    @abc.abstractmethod
    def config(self) -> Mapping[str, Any]:
        """The model's configuration in Hugging Face ``config.json`` keys (for a GGUF file,
        its metadata translated), including ``architectures`` and ``dtype``."""

    @abc.abstractmethod
    def weights(
        self, dtype: torch.dtype, device: torch.device | str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight under its Hugging Face name, floating ones as ``dtype`` on ``device``
        (quantized GGUF tensors dequantized), one tensor at a time; a progress bar on a
        terminal. Raises ``ModelLoadError`` naming the file for a corrupt or missing one."""

    def weight_slices(
        self,
        dtype: torch.dtype,
        device: torch.device | str,
        slice_of: Callable[[str], tuple[int, int, int] | None],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`weights`, each tensor narrowed to ``slice_of(name)`` = ``(dim, start,
        length)`` (clipped at the tensor's end; None: the whole tensor), for a
        tensor-parallel rank that holds a slice. This default reads every tensor whole and
        narrows it (a GGUF file's quantized tensors are dequantized whole); a checkpoint that
        can read a slice alone (safetensors) overrides it (API 2.3)."""
        for name, tensor in self.weights(dtype, device):
            part = slice_of(name)
            if part is None:
                yield name, tensor
                continue
            dim, start, length = part
            end = min(start + length, tensor.shape[dim])
            yield name, tensor.narrow(dim, start, end - start).clone()

    @abc.abstractmethod
    def tokenizer(self) -> Any:
        """The model's tokenizer (a transformers ``PreTrainedTokenizerFast``), built on the
        first call and shared afterwards; None when the checkpoint has no tokenizer at all
        (a config-only directory, which serves token-id prompts only)."""

    @property
    @abc.abstractmethod
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a generation."""

    def sampling_defaults(self) -> Mapping[str, float]:
        """The model's recommended sampling parameters (any of ``temperature``, ``top_p``,
        ``top_k``, ``min_p``, ``repetition_penalty``), for requests that leave them unset, as
        vLLM applies ``generation_config.json``; empty when the files recommend none."""
        return {}

    def describe(self) -> str:
        """What the files hold beyond the config, for the start-up banner (e.g. a GGUF's
        tensor types); empty when there is nothing to add."""
        return ""


class CausalLM(Protocol):
    """What an executor needs from a built model (a ``torch.nn.Module``)."""

    attention_layers: Sequence[AttentionLayer]
    """One entry per layer, in order: the KV cache shape of each layer derives from it."""
    vocab_size: int

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: Any,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] -> [num_rows, vocab_size] float logits."""
        ...


@runtime_checkable
class SplitCausalLM(CausalLM, Protocol):
    """The piecewise capability of a :class:`CausalLM`: its forward is ``embed``, then per
    layer ``attention_input`` -> ``attend`` -> ``finish_layer``, then ``final_norm`` (the
    decoder in ``brigade.plugins.models`` has it). Executors that cut the forward at attention
    (piecewise CUDA graphs, the compiled CPU forward) check for it with ``isinstance``; a model
    without it runs whole."""

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T] ids and positions -> (residual stream [T, H], RoPE cos, sin [T, D/2])."""
        ...

    def attention_input(
        self, index: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``index``: residual stream -> q [T, heads, D], k, v [T, kv_heads, D]."""
        ...

    def attend(
        self,
        index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: Any,
    ) -> torch.Tensor:
        """Layer ``index``'s attention (writes K/V): -> [T, heads, D]."""
        ...

    def finish_layer(
        self, index: int, hidden: torch.Tensor, attention: torch.Tensor
    ) -> torch.Tensor:
        """Layer ``index``: residual stream and attention output -> next residual stream."""
        ...

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] -> the hidden states ``compute_logits`` reads."""
        ...


class LayerOps(Protocol):
    """A decoder layer's small operations between its GEMMs, as a backend runs them fused.

    The executor knows the device's kernels (Brigade's C++ kernels on a CPU, Triton on a GPU);
    a model that takes them (:class:`AcceptsLayerOps`) calls these instead of its torch
    operations. Each returns new tensors and leaves its inputs as they were; rows ([T, ...])
    may be strided views (the q/k/v or gate/up columns of a fused projection's output), the
    last dimension contiguous. Arithmetic is float32 in transformers' order, rounded to the
    activation dtype where transformers' torch operations round.
    """

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, size], weight [size] -> ``weight * x / sqrt(mean(x^2) + eps)`` [T, size]."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add before a norm: x, delta [T, size] -> (``x + delta``, its
        :meth:`rms_norm`), both [T, size]."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2 * width] (gate, then up) -> ``silu(gate) * up`` [T, width]."""
        ...

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary embedding (halves rotated, as Llama's): q [T, heads, head_dim], k [T,
        kv_heads, head_dim], cos, sin [T, head_dim // 2] -> rotated (q, k), contiguous."""
        ...

    def gate_up_silu(self, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``silu_mul(linear(x))``: a gate_up projection ([gate, up] halves) and the SiLU-mul
        after it, x [T, in] -> [T, out // 2]. A backend may fuse the activation into the GEMM
        (the CPU's gate_up projections packed in pairs compute it as they store the output)."""
        ...


LayerOpsProvider = Callable[["torch.Tensor"], "LayerOps | None"]
"""What an executor hands a model (:meth:`AcceptsLayerOps.use_layer_ops`): for a tensor of
the forward, the fused operations that take tensors like it (device, dtype), or None where the
model's own torch operations run."""


@runtime_checkable
class AcceptsLayerOps(Protocol):
    """The capability of a :class:`CausalLM` whose layers run their small operations through
    :class:`LayerOps` when an executor hands it some (Brigade's decoder has it). An executor
    checks for it with ``isinstance``; a model without it keeps its own operations."""

    def use_layer_ops(self, provider: LayerOpsProvider | None) -> None:
        """From now on ask ``provider`` for the operations of each eager forward's tensors
        (None from it, or ``provider=None``: the model's torch operations). The model owns the
        choice under ``torch.compile``: while compiling it runs its torch operations, which the
        compiler fuses, and never calls the provider."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class DecoderLayerWeights:
    """One layer of a plain pre-norm decoder as data: ``h += o_proj(attention(rope(qkv_proj(
    rms_norm(h)))))``, then ``h += down_proj(silu_mul(gate_up_proj(rms_norm(h))))``.

    The modules are the model's own (an executor may have swapped them: the CPU's packed
    GEMMs); whoever reads them only calls them or reads their weights. Shapes are this rank's.
    """

    input_norm: torch.Tensor
    """[hidden_size] weight of the RMSNorm before attention."""
    qkv_proj: torch.nn.Module
    """[hidden_size] -> [(heads + 2 * kv_heads) * head_dim]: q, then k, then v."""
    o_proj: torch.nn.Module
    """[heads * head_dim] -> [hidden_size]."""
    post_attention_norm: torch.Tensor
    """[hidden_size] weight of the RMSNorm before the MLP."""
    gate_up_proj: torch.nn.Module
    """[hidden_size] -> [2 * intermediate_size]: gate, then up."""
    down_proj: torch.nn.Module
    """[intermediate_size] -> [hidden_size]."""
    attention: AttentionLayer
    """The layer's heads, head size, scale and sliding window."""
    backend: AttentionBackend
    """The attention backend the layer calls (writes K/V, attends)."""
    qk_norm: bool
    """Whether q and k are RMS-normed per head before RoPE (Qwen3): a step of this layer is
    then not the plain shape above."""


@dataclasses.dataclass(frozen=True, slots=True)
class DecoderWeights:
    """A decoder's layers as data (:class:`ProvidesDecoderWeights`), for an executor that runs
    them its own way (the CPU's fused step: every layer of a step in one C++ call)."""

    layers: tuple[DecoderLayerWeights, ...]
    rms_norm_eps: float
    """The epsilon of every RMSNorm of the layers."""
    intermediate_size: int
    """The MLP's width on this rank (``gate_up_proj`` outputs twice as many columns)."""


@runtime_checkable
class ProvidesDecoderWeights(Protocol):
    """The capability of a :class:`CausalLM` that can describe its layers as
    :class:`DecoderWeights` (Brigade's decoder has it)."""

    def decoder_weights(self) -> DecoderWeights | None:
        """The layers as they are now (computed on each call: an executor may swap linear
        modules after the build), or None when the model is not a plain pre-norm RMSNorm,
        SiLU-gated decoder. Reading it changes nothing."""
        ...


class ModelArchitecture(abc.ABC):
    """One family of models, registered under the HF ``architectures`` names it serves.

    Register each name under kind ``"model"``, e.g.
    ``registry.add("model", "LlamaForCausalLM", LlamaArchitecture)``; core picks the factory
    from the checkpoint config's ``architectures`` list (a GGUF file's architecture is
    translated to the same names).
    """

    @abc.abstractmethod
    def validate_config(self, hf_config: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` naming the key if the config is one this family cannot run."""

    @abc.abstractmethod
    def build(
        self,
        hf_config: Mapping[str, Any],
        attention: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
    ) -> CausalLM:
        """Create the module with uninitialised weights on ``device`` in ``dtype``."""

    @abc.abstractmethod
    def load_weights(self, model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into ``model``, fusing where the module fuses.

        Raise ``ValueError`` naming the tensor on an unexpected name, a shape mismatch or a
        missing weight.
        """
