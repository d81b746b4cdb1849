"""Sampler and LogitsProcessor: from a batch of logits to token ids."""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any

from brigade.interfaces.request import Request

if TYPE_CHECKING:
    import torch

__all__ = ["LogitsProcessor", "SampleOutput", "Sampler"]


@dataclasses.dataclass(frozen=True, slots=True)
class SampleOutput:
    token_ids: torch.Tensor
    """[num_rows] int64 sampled ids (the step's one device-to-host sync reads these)."""
    logprobs: torch.Tensor | None = None
    """[num_rows, 1 + N] float32 log probability of the sampled token, then the top-N."""
    logprob_token_ids: torch.Tensor | None = None
    """[num_rows, 1 + N] int64 token ids matching ``logprobs``."""


class LogitsProcessor(abc.ABC):
    """One stage of the chain that edits logits before sampling (penalties, bias, grammar).

    Rows are persistent-batch rows: a request keeps its row while it runs. State is kept per
    row in tensors so :meth:`apply` is one vectorised call for the whole batch; rows never
    registered with :meth:`add` must be left untouched.
    """

    @abc.abstractmethod
    def add(self, row: int, request: Request) -> None:
        """Start tracking ``request`` in ``row`` (a no-op when it needs nothing here)."""

    @abc.abstractmethod
    def remove(self, row: int) -> None:
        """Forget ``row``; it may be reused by another request."""

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Edit ``logits`` [num_rows, vocab] (in place allowed) for batch rows ``rows``."""

    @abc.abstractmethod
    def accept(self, row: int, token_ids: list[int]) -> None:
        """Record tokens accepted for ``row``."""

    def rollback(self, row: int, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding)."""
        raise NotImplementedError(f"{type(self).__name__} does not support rollback")


class Sampler(abc.ABC):
    """Chooses one token per row, vectorised over the batch.

    Per-request parameters live in per-row tensors that core keeps in the persistent batch
    (``state``); a sampler never loops over requests in Python on the hot path.
    """

    @abc.abstractmethod
    def sample(self, logits: torch.Tensor, state: Any) -> SampleOutput:
        """logits: [num_rows, vocab] float32 after the logits-processor chain."""
