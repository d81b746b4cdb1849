"""ModelArchitecture: turns a Hugging Face config into a torch module that uses the paged KV."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from brigade.interfaces.attention import AttentionBackend, AttentionLayer

__all__ = ["CausalLM", "ModelArchitecture"]


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


class ModelArchitecture(abc.ABC):
    """One family of models, registered under the HF ``architectures`` names it serves.

    Register each name under kind ``"model"``, e.g.
    ``registry.add("model", "LlamaForCausalLM", LlamaArchitecture)``; the loader picks the
    factory from ``config.json``'s ``architectures`` list.
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
