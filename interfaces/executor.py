"""Executor: runs one batched forward pass over the paged KV cache."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from brigade.interfaces.attention import AttentionBackend
    from brigade.interfaces.batch import ModelInput
    from brigade.interfaces.model import Checkpoint

__all__ = ["DTYPE_NAMES", "Executor", "ExecutorParams", "KVCacheSpec"]

DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""The dtypes a model and its KV cache run in, by torch's names (``getattr(torch, name)``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ExecutorParams:
    """What core hands every executor at construction (plugin options come separately)."""

    model_path: str
    """Where the model's files are (a Hugging Face directory or a GGUF file); read them
    through :attr:`checkpoint`."""
    dtype: str
    """The model's dtype, one of :data:`DTYPE_NAMES`: core resolves ``[model] dtype = "auto"``
    to the checkpoint's own (API 2.0: before, an executor could be given 'auto')."""
    attention: AttentionBackend
    page_size: int
    kv_cache_dtype: str
    """'auto' (same as the model) or one of :data:`DTYPE_NAMES`."""
    max_model_len: int
    """0 = the model's max_position_embeddings."""
    seed: int = 0
    model_factory: Any = None
    """The ``ModelArchitecture`` for the checkpoint's ``architectures`` name, chosen by core."""
    checkpoint: Checkpoint = dataclasses.field(kw_only=True)
    """The opened model: its parsed config and its weights. Core opens the model once and
    hands every station this same object, so an executor never opens files itself (API 1.2;
    required in API 2.0: before, params a test built by hand could leave it out)."""


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The KV cache the loaded model needs, so core can size the page pool."""

    num_layers: int
    page_size: int
    bytes_per_page: int
    """K and V of all layers for one page."""
    available_bytes: int
    """Memory the executor can give the KV pool now (after weights)."""
    max_model_len: int
    vocab_size: int


class Executor(abc.ABC):
    """Owns the model weights, the KV tensors and the device; computes logits for a batch.

    Ownership: the executor allocates the KV tensors once (:meth:`initialize_kv_cache`) and
    never decides which pages a request uses: block tables and slot mappings arrive in the
    :class:`ModelInput`. It never mutates requests.
    """

    supports_copy_pages: ClassVar[bool] = False
    returns_token_ids: ClassVar[bool] = False
    """True: :meth:`execute` returns the chosen token ids ``[S]`` (int64) instead of logits,
    and core skips logits processors and the sampler (e.g. a simulator with no weights). Under
    speculative decoding the id returned at a row is checked against the next row's draft
    exactly as a sampled token would be: core accepts drafts while they match."""
    returns_hidden_states: ClassVar[bool] = False
    """True: :meth:`execute_with_hidden_states` works, so the engine serves embedding requests
    (API 2.1). Executors without it refuse them at admission."""
    models_time: ClassVar[bool] = False
    """True: :meth:`execute` does not spend a step's time but models it, and
    :meth:`modelled_time_s` says how much (the ``simulated`` executor). A driver that runs the
    engine in virtual time (``brigade.bench.simulate``) needs such an executor and advances the
    engine clock by it (API 1.3)."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where this executor's logits (or token ids) live; core samples on this device
        (API 2.0: before, core assumed the CPU when an executor had no ``device``)."""

    @abc.abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec:
        """Describe the KV cache this model needs per page and the memory left for it."""

    @abc.abstractmethod
    def initialize_kv_cache(self, num_pages: int, num_host_pages: int = 0) -> None:
        """Allocate K and V for ``num_pages`` device pages in every layer (called once).

        ``num_host_pages`` more pages, with ids ``num_pages .. num_pages + num_host_pages - 1``,
        live in host memory for swapping: they appear only in :meth:`copy_pages`, never in a
        block table. Executors without ``supports_copy_pages`` are given none.
        """

    @abc.abstractmethod
    def execute(self, batch: ModelInput) -> torch.Tensor:
        """Run one forward pass; return float32 logits ``[len(batch.logits_indices), vocab]``.

        Executors with ``returns_token_ids`` return int64 token ids
        ``[len(batch.logits_indices)]`` instead, one per sampled position.
        """

    def execute_with_hidden_states(self, batch: ModelInput) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`execute`, plus the final hidden states of the rows ``batch.hidden_indices``
        names: ``(logits [S, vocab], hidden [H, hidden_size])``, both float32 on
        :attr:`device`. "Final" is after the model's last norm, what the LM head reads.
        ``batch.logits_indices`` may be empty (a step of embedding prefills only): logits are
        then ``[0, vocab]``. Executors that set ``returns_hidden_states`` implement this
        (API 2.1); core calls it only for steps with ``hidden_indices``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not return hidden states")

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy page ``src[i]`` to ``dst[i]`` in every layer (forks, swap out and in).

        Ids may name device or host pages (see :meth:`initialize_kv_cache`), in any mix.
        The copy is complete before the next :meth:`execute` reads or writes those pages.
        Executors that set ``supports_copy_pages`` implement this.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support copy_pages")

    def modelled_time_s(self) -> float:
        """Seconds every :meth:`execute` so far would have taken on the modelled hardware, in
        total (0.0 before the first; it only grows). Executors that set ``models_time``
        implement this."""
        raise NotImplementedError(f"{type(self).__name__} does not model time")

    def shutdown(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Release devices, processes and memory; the executor is unusable afterwards."""
