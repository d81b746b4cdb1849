"""Checkpoint and ModelArchitecture: a model's files, and the torch module that runs them."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from brigade.interfaces.attention import AttentionBackend, AttentionLayer

__all__ = ["CausalLM", "Checkpoint", "ModelArchitecture", "SplitCausalLM"]


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
