"""Piecewise graphs: the dense parts of a forward captured per token count, attention eager.

A step that mixes a prefill chunk into a decode batch has ragged attention whose launch grid
and metadata change every step, but everything else in the forward is row-wise dense work
(embedding, norms, projections, RoPE, MLP) whose shapes depend only on the token count. So the
forward is cut at attention into ``num_layers + 1`` pieces, each captured as one graph per
bucket of ``capture_tokens``:

    piece 0      embedding, RoPE cos/sin, layer 0's input norm + qkv (+ qk norm) + RoPE
    piece i      layer i-1's o_proj + residual + MLP + residual, layer i's attention input
    piece L      layer L-1's o_proj + residual + MLP + residual, the final norm

A step of ``n`` tokens replays the pieces of the smallest bucket ``N >= n``; between them each
layer's attention runs eagerly on the first ``n`` rows only (the real tokens), with the step's
own metadata, and writes the real tokens' K/V. Rows ``n .. N-1`` are padding: they go through
the dense pieces on whatever the buffers hold (finite values from earlier steps or zeros),
never reach attention, so they write no KV, and their outputs are never read. Dense work is
row-wise, so padding rows cannot change real rows.

Pieces talk through static buffers sized for the largest bucket (a bucket uses their first
``N`` rows); the residual stream alternates between two buffers so that every piece reads one
and writes the other and a replay (or a capture's warm-up run) is idempotent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from brigade.interfaces import ModelInput, SplitCausalLM
from brigade.plugins.executors.graph_padding import bucket_for, check_capture_sizes
from brigade.plugins.executors.graph_runner import CapturedGraph, GraphFn, GraphRunner

__all__ = ["PiecewiseBuffers", "PiecewiseGraphs"]

Tensors3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class PiecewiseBuffers:
    """The static tensors every piece reads and writes, ``rows`` = the largest bucket."""

    input_ids: torch.Tensor
    """[rows] int64."""
    positions: torch.Tensor
    """[rows] int64."""
    hidden: torch.Tensor
    """[2, rows, H] residual stream; piece i reads ``hidden[(i - 1) % 2]``, writes ``[i % 2]``."""
    cos: torch.Tensor
    """[rows, D/2] RoPE cos, written by piece 0."""
    sin: torch.Tensor
    """[rows, D/2] RoPE sin, written by piece 0."""
    q: torch.Tensor
    """[rows, heads, D] the next attention's query."""
    k: torch.Tensor
    """[rows, kv_heads, D]."""
    v: torch.Tensor
    """[rows, kv_heads, D]."""
    attention: torch.Tensor
    """[rows, heads, D] the last attention's output (real rows written per step)."""

    @classmethod
    def allocate(cls, model: SplitCausalLM, rows: int, device: torch.device) -> PiecewiseBuffers:
        """Buffers shaped like the model's own pieces, found by running piece 0 on one token."""
        ids = torch.zeros(1, dtype=torch.int64, device=device)
        hidden, cos, sin = model.embed(ids, ids)
        q, k, v = model.attention_input(0, hidden, cos, sin)

        def zeros(like: torch.Tensor, *leading: int) -> torch.Tensor:
            return torch.zeros(*leading, *like.shape[1:], dtype=like.dtype, device=device)

        return cls(
            input_ids=torch.zeros(rows, dtype=torch.int64, device=device),
            positions=torch.zeros(rows, dtype=torch.int64, device=device),
            hidden=zeros(hidden, 2, rows),
            cos=zeros(cos, rows),
            sin=zeros(sin, rows),
            q=zeros(q, rows),
            k=zeros(k, rows),
            v=zeros(v, rows),
            attention=zeros(q, rows),
        )


class PiecewiseGraphs:
    """``num_layers + 1`` graphs per token bucket, and the step that replays them."""

    def __init__(
        self,
        model: SplitCausalLM,
        num_layers: int,
        capture_tokens: Sequence[int],
        runner: GraphRunner,
        device: torch.device,
    ) -> None:
        self.model = model
        self.num_layers = num_layers
        self.capture_tokens = check_capture_sizes(capture_tokens, "mixed_capture_tokens")
        self.runner = runner
        self.device = device
        self.buffers: PiecewiseBuffers | None = None
        self.graphs: dict[int, list[CapturedGraph]] = {}
        """bucket -> its pieces in order."""

    def bucket(self, num_tokens: int) -> int | None:
        """The captured token count that runs a step of ``num_tokens``; None = run eagerly."""
        return bucket_for(num_tokens, self.capture_tokens) if self.graphs else None

    def capture(self) -> None:
        """Allocate the buffers and capture every bucket's pieces, largest bucket first."""
        with torch.inference_mode():
            self.buffers = PiecewiseBuffers.allocate(
                self.model, self.capture_tokens[-1], self.device
            )
            for size in reversed(self.capture_tokens):
                self.graphs[size] = [
                    self.runner.capture(self._piece(index, size))
                    for index in range(self.num_layers + 1)
                ]

    def _piece(self, index: int, size: int) -> GraphFn:
        """The callable of piece ``index`` over the first ``size`` rows of the buffers."""
        buffers = self.buffers
        if buffers is None:
            raise RuntimeError("piecewise buffers are not allocated")
        model = self.model
        cos, sin = buffers.cos[:size], buffers.sin[:size]
        source, target = buffers.hidden[(index - 1) % 2, :size], buffers.hidden[index % 2, :size]

        def start_layer(layer: int, hidden: torch.Tensor) -> None:
            q, k, v = model.attention_input(layer, hidden, cos, sin)
            buffers.q[:size].copy_(q)
            buffers.k[:size].copy_(k)
            buffers.v[:size].copy_(v)

        def embed() -> None:
            hidden, new_cos, new_sin = model.embed(
                buffers.input_ids[:size], buffers.positions[:size]
            )
            target.copy_(hidden)
            cos.copy_(new_cos)
            sin.copy_(new_sin)
            start_layer(0, hidden)

        def between_layers() -> None:
            hidden = model.finish_layer(index - 1, source, buffers.attention[:size])
            target.copy_(hidden)
            start_layer(index, hidden)

        def last() -> None:
            hidden = model.finish_layer(index - 1, source, buffers.attention[:size])
            target.copy_(model.final_norm(hidden))

        if index == 0:
            return embed
        return last if index == self.num_layers else between_layers

    def run(
        self,
        batch: ModelInput,
        size: int,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: Any,
    ) -> torch.Tensor:
        """Final hidden states [n, H] of ``batch`` (on the device, ``n`` tokens <= ``size``).

        The result is a view of a static buffer: read it before the next step.
        """
        buffers, pieces = self.buffers, self.graphs[size]
        if buffers is None:
            raise RuntimeError("call capture before run")
        num_tokens = batch.num_tokens
        buffers.input_ids[:num_tokens].copy_(batch.input_ids, non_blocking=True)
        buffers.positions[:num_tokens].copy_(batch.positions, non_blocking=True)
        pieces[0].replay()
        for index, kv_cache in enumerate(kv_caches):
            attention = self.model.attend(
                index,
                buffers.q[:num_tokens],
                buffers.k[:num_tokens],
                buffers.v[:num_tokens],
                kv_cache,
                attn_metadata,
            )  # [n, heads, D]: real tokens only, so padding writes no K/V
            buffers.attention[:num_tokens].copy_(attention)
            pieces[index + 1].replay()
        return buffers.hidden[self.num_layers % 2, :num_tokens]

    def release(self) -> None:
        """Drop the graphs and buffers."""
        self.graphs = {}
        self.buffers = None
