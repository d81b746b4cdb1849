"""Embeddings: pooling an embedding request's final hidden states into its vector.

An embedding request (``Request.pooling``) runs its prompt through the engine like any
prefill, chunked and batched with generation; it samples nothing. Each step hands the pooler
the hidden-state rows the executor returned for it; the chunk that ends the prompt makes the
vector and the request finishes.
"""

from __future__ import annotations

import torch

from brigade.interfaces import Request
from brigade.persistent_batch import PooledChunk

__all__ = ["Pooler"]


class Pooler:
    """Running sums of mean-pooled requests, across chunks and preemptions."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, chunk: PooledChunk, hidden: torch.Tensor) -> list[float] | None:
        """Take ``chunk``'s rows ``hidden`` ``[num_rows, hidden_size]`` (float32); return the
        request's vector when the chunk ends its prompt, else None."""
        request = chunk.request
        pooling = request.pooling
        assert pooling is not None
        if pooling.needs_every_position:
            total = hidden.sum(dim=0, dtype=torch.float32)
            if chunk.start:  # a chunk starting at 0 restarts the sum (recompute preemption)
                total = total + self._sums[request.request_id]
            if not chunk.completes:
                self._sums[request.request_id] = total
                return None
            self._sums.pop(request.request_id, None)
            vector = total / request.num_prompt_tokens
        else:
            if not chunk.completes:
                return None
            vector = hidden[-1]
        if pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return [float(x) for x in vector.cpu().tolist()]

    def check(self, chunk: PooledChunk) -> str | None:
        """Why ``chunk`` cannot be pooled (the KV manager served part of a mean-pooled
        prompt from its cache), or None."""
        request = chunk.request
        assert request.pooling is not None
        mean = request.pooling.needs_every_position
        if mean and chunk.start and request.request_id not in self._sums:
            return (
                f"{chunk.start} of its prompt tokens came from the prefix cache, so their "
                "hidden states were never computed for mean pooling (the KV manager must not "
                "match requests whose uses_prefix_cache is False)"
            )
        return None

    def drop(self, request: Request) -> None:
        """Forget ``request`` (it finished, failed or was aborted)."""
        self._sums.pop(request.request_id, None)
