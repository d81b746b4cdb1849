"""Embeddings: pooling an embedding request's final hidden states into its vector.

An embedding request (``Request.pooling``) runs its prompt through the engine like any
prefill, chunked and batched with generation; it samples nothing. The persistent batch lays
out its chunk as a :class:`PooledChunk` (``PersistentBatch.prepare``), the executor returns
the chunk's hidden-state rows, and :meth:`Pooler.collect` hands each request its rows: the
chunk that ends the prompt makes the vector and the request finishes.
"""

from __future__ import annotations

import dataclasses

import torch

from brigade.interfaces import Request

__all__ = ["Pooled", "PooledChunk", "Pooler"]


@dataclasses.dataclass(frozen=True, slots=True)
class PooledChunk:
    """An embedding request's part of a step: which hidden-state rows are its."""

    request: Request
    num_rows: int
    """Its rows of the step's hidden states, consecutive, in ``StepPlan.pooled`` order: every
    token of the chunk (mean pooling) or the prompt's last token (last pooling, last chunk)."""
    start: int
    """Tokens computed before this chunk (0: the pooling starts afresh)."""
    completes: bool
    """The chunk ends the prompt: the vector can be made."""


@dataclasses.dataclass(frozen=True, slots=True)
class Pooled:
    """What one step's hidden states made of its embedding requests."""

    vectors: list[tuple[Request, list[float]]]
    """The requests whose prompt ended, each with its vector (they are finished)."""
    failures: dict[Request, str]
    """The requests that cannot be pooled -> why (they fail alone)."""


class Pooler:
    """Running sums of mean-pooled requests, across chunks and preemptions."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}

    def collect(self, chunks: tuple[PooledChunk, ...], hidden: torch.Tensor | None) -> Pooled:
        """Hand each chunk its rows of ``hidden`` ``[sum of num_rows, hidden_size]`` (the
        step's hidden states, in ``chunks`` order)."""
        pooled = Pooled([], {})
        offset = 0
        for chunk in chunks:
            rows = offset
            offset += chunk.num_rows
            error = self.check(chunk)
            if error is not None:
                pooled.failures[chunk.request] = error
                continue
            if not chunk.num_rows:
                continue
            assert hidden is not None  # the plan had hidden rows
            vector = self.add(chunk, hidden[rows : rows + chunk.num_rows])
            if vector is not None:
                pooled.vectors.append((chunk.request, vector))
        return pooled

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
