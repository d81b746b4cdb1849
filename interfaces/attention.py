"""AttentionBackend: how a model layer reads and writes the paged KV cache."""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from brigade.interfaces.batch import ModelInput

__all__ = ["AttentionBackend", "AttentionLayer", "PageSizeRule"]


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionLayer:
    """What a backend needs to know about one attention layer (fixed at model build)."""

    layer_index: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    """Each query sees at most this many most recent keys (itself included); None = all."""


@dataclasses.dataclass(frozen=True, slots=True)
class PageSizeRule:
    """The KV page sizes a backend can read: a multiple of ``multiple_of`` in [minimum, maximum]."""

    multiple_of: int = 1
    minimum: int = 1
    maximum: int | None = None

    def allows(self, page_size: int) -> bool:
        if page_size < self.minimum or page_size % self.multiple_of:
            return False
        return self.maximum is None or page_size <= self.maximum

    def describe(self) -> str:
        if self.maximum == self.minimum:
            return f"exactly {self.minimum}"
        upper = f", at most {self.maximum}" if self.maximum is not None else ""
        if self.multiple_of > 1:
            return f"a multiple of {self.multiple_of}, at least {self.minimum}{upper}"
        return f"at least {self.minimum}{upper}"


class AttentionBackend(abc.ABC):
    """Computes attention for a ragged batch against the paged KV cache.

    The KV pool is, per layer, a K and a V tensor shaped by :meth:`kv_cache_shape` (by
    default ``[num_pages, page_size, num_kv_heads, head_dim]``). The executor allocates them;
    the backend writes the step's new K/V into them (at ``slot_mapping``) and reads a request's
    context through its block table. A backend never allocates or frees pages. Every slot of
    a page in a request's block table holds finite values (the executor zeroes a page before
    its first use; afterwards it holds stale K/V of earlier requests), so a backend may read
    whole pages and mask what lies past the request's length.

    Lifecycle per step: the executor calls :meth:`build_metadata` once, then
    :meth:`forward` once per layer with the same metadata object.
    """

    name: ClassVar[str] = ""
    supports_sliding_window: ClassVar[bool] = False
    supports_cuda_graphs: ClassVar[bool] = False
    """Pure decode steps can be captured in a CUDA graph and replayed: :meth:`forward` reads
    only device tensors that :meth:`build_metadata` took from the batch (no host sync, no
    allocation outside the graph's pool), and what it derives from host maxima stays valid for
    any replay whose values are at most those of the capture batch."""

    @classmethod
    def supported_page_sizes(cls, options: Any) -> PageSizeRule:
        """Page sizes this backend can read (``config check`` rejects others)."""
        return PageSizeRule()

    @classmethod  # noqa: B027 - an optional hook whose default accepts every device
    def check_device(cls, device: str) -> None:
        """Raise ``RuntimeError`` with a clear reason if the backend cannot run on ``device``."""

    def kv_cache_shape(
        self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's K (and, separately, V) cache tensor."""
        return (num_pages, page_size, num_kv_heads, head_dim)

    @abc.abstractmethod
    def build_metadata(self, batch: ModelInput) -> Any:
        """Derive this step's per-batch attention metadata, once, before the layers run.

        Host-side maxima come from the batch's ``*_cpu`` fields; nothing here may force a
        device sync per layer.
        """

    @abc.abstractmethod
    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: Any,
    ) -> torch.Tensor:
        """Write the new K/V into ``kv_cache``, then attend.

        query: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads,
        head_dim] (already rotated). Returns [num_tokens, num_heads, head_dim]. Each token
        attends to its request's cached context and causally to the new tokens before it
        (and to itself), limited by ``layer.sliding_window``.
        """
