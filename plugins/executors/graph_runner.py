"""How the cuda-graph executor turns a callable into something it can replay.

Code that drives graphs follows one contract: the callable reads only tensors allocated before
the capture (static buffers) and either writes its results into such tensors or returns one
tensor, the graph's output, which every replay overwrites in place. :class:`CudaGraphRunner`
captures a CUDA graph. :class:`RerunGraphRunner` stands in for it where there is no GPU: it
runs the callable again on each replay and copies the result into the captured output, so the
executor's capture, buffer and replay logic runs (and is tested) on a CPU.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CapturedGraph", "CudaGraphRunner", "GraphRunner", "RerunGraphRunner"]

GraphFn = Callable[[], "torch.Tensor | None"]
"""A capturable step: reads static buffers, writes static buffers and/or returns one tensor."""


class CapturedGraph(abc.ABC):
    """One captured callable; ``output`` is what it returned at capture (None if nothing)."""

    output: torch.Tensor | None

    @abc.abstractmethod
    def replay(self) -> None:
        """Run the captured work again on what the static buffers hold now."""


class GraphRunner(abc.ABC):
    """Captures callables; graphs of one runner share memory and must replay one at a time."""

    @abc.abstractmethod
    def capture(self, fn: GraphFn) -> CapturedGraph:
        """Capture ``fn`` (call under ``torch.inference_mode``)."""


class _CudaGraph(CapturedGraph):
    def __init__(self, graph: torch.cuda.CUDAGraph, output: torch.Tensor | None) -> None:
        self.graph = graph
        self.output = output

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphRunner(GraphRunner):
    """``torch.cuda.CUDAGraph`` capture after ``warmup`` runs on a side stream.

    Every graph after the first shares the first one's memory pool: intermediates freed at the
    end of one capture are reused by the next, which is safe because graphs replay in turn on
    one stream. Capture the largest shapes first so the pool is sized once.
    """

    def __init__(self, device: torch.device, warmup: int = 2) -> None:
        self.device = device
        self.warmup = warmup
        self.pool: Any = None
        self._stream: torch.cuda.Stream | None = None

    def capture(self, fn: GraphFn) -> CapturedGraph:
        """Warm up (lazy inits, allocator, autotuning) on a side stream, then capture."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            for _ in range(self.warmup):
                fn()
        current.wait_stream(self._stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return _CudaGraph(graph, output)


class _Rerun(CapturedGraph):
    def __init__(self, fn: GraphFn, output: torch.Tensor | None) -> None:
        self.fn = fn
        self.output = output
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        result = self.fn()
        if self.output is not None and result is not None:
            self.output.copy_(result)


class RerunGraphRunner(GraphRunner):
    """Graphs imitated without CUDA: capture runs ``fn`` once, each replay runs it again.

    Faithful for callables that see a step only through static buffers and take no branch on
    values that change between replays (the executor's pieces and decode steps qualify: host
    values they branch on are fixed at capture). Each graph counts its replays (``replays``).
    """

    def capture(self, fn: GraphFn) -> CapturedGraph:
        """Run ``fn`` once; its result becomes the output that replays overwrite."""
        return _Rerun(fn, fn())
