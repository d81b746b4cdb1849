"""The ``cuda-graph`` executor: the eager torch executor plus CUDA graphs for decode steps.

Model loading, the KV pool, page copies and eager execution are :class:`TorchExecutor`'s.
This class adds, for pure decode steps, one captured graph per batch size in
``capture_sizes``: the step is padded up to the nearest captured size
(:mod:`graph_padding`), its host tensors are copied into persistent device buffers that every
graph reads, and the graph is replayed. Padding rows write and read a scratch page that no
block table names (the pool has one page more than core was told).

Steps with a prefill chunk (alone or mixed with decodes) run eagerly; docs/gpu.md says why
and what is left to do (piecewise capture around attention). Graphs need an attention backend
whose ``supports_cuda_graphs`` is True; with another, every step runs eagerly and a warning
is logged once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from brigade.interfaces import ExecutorParams, ModelInput, option
from brigade.model_input import model_input_to
from brigade.plugins.executors.graph_padding import (
    check_capture_sizes,
    graph_bucket,
    pad_decode_input,
    padding_input,
)
from brigade.plugins.executors.torch_executor import TorchExecutor, TorchExecutorOptions

__all__ = ["CudaGraphExecutor", "CudaGraphExecutorOptions"]

logger = logging.getLogger(__name__)

_STATIC_FIELDS = ("input_ids", "positions", "seq_lens", "block_tables", "slot_mapping")
"""The step-dependent fields copied into the static buffers before a replay."""


@dataclasses.dataclass(frozen=True)
class CudaGraphExecutorOptions:
    """Options of the ``cuda-graph`` executor."""

    capture_sizes: tuple[int, ...] = option(
        (1, 2, 4, 8, 16, 32, 64, 128, 256),
        help="decode batch sizes to capture; a step is padded up to the nearest one, larger "
        "decode steps run eagerly",
    )
    compile: bool = option(
        False, help="torch.compile the model; compile + graph capture time is logged at startup"
    )
    device: str = option("cuda", help="'cuda' or 'cuda:N'", pattern=r"cuda(:\d+)?")

    def __post_init__(self) -> None:
        check_capture_sizes(self.capture_sizes)


class CudaGraphExecutor(TorchExecutor):
    """Replays captured CUDA graphs for pure decode steps; everything else as ``torch``."""

    @classmethod
    def check_device(cls, device: str) -> None:
        """Raise ``RuntimeError`` unless a CUDA GPU is usable."""
        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise RuntimeError(
                f"the cuda-graph executor needs a CUDA GPU (device {device!r}, CUDA "
                f"{'available' if torch.cuda.is_available() else 'not available'}); "
                "use executor plugin 'torch'"
            )

    def __init__(self, params: ExecutorParams, options: CudaGraphExecutorOptions) -> None:
        self.check_device(options.device)
        super().__init__(params, TorchExecutorOptions(device=options.device))
        self.capture_sizes = check_capture_sizes(options.capture_sizes)
        self.graphs_enabled = type(self.attention).supports_cuda_graphs
        if not self.graphs_enabled:
            logger.warning(
                "attention backend %r does not support CUDA graphs; the cuda-graph executor "
                "runs every step eagerly",
                type(self.attention).name or type(self.attention).__name__,
            )
        self.max_pages = -(-self.max_model_len // params.page_size)
        """Block-table columns of the static buffers (enough for ``max_model_len``)."""
        self.compile = options.compile
        if options.compile:
            # Lazy: the compile cost lands on the first calls, i.e. on capture (or, without
            # graphs, on the first steps); the startup log reports it with the capture time.
            self.forward_fn = torch.compile(self.model.forward)
        self.scratch_page = -1
        self._static: ModelInput | None = None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        """size -> (graph, its static logits [size, vocab])."""

    def initialize_kv_cache(self, num_pages: int, num_host_pages: int = 0) -> None:
        """The pool plus one scratch page (id ``num_pages``) for padding rows; then capture."""
        super().initialize_kv_cache(num_pages + 1, num_host_pages)
        self.num_pages = num_pages  # host (swap) page ids still start at num_pages
        self.scratch_page = num_pages
        if not self.graphs_enabled:
            return
        largest = self.capture_sizes[-1]
        template = padding_input(
            largest, self.max_pages, self.scratch_page, self.params.page_size, self.max_model_len
        )
        self._static = model_input_to(template, self.device)
        started = time.perf_counter()
        pool = None
        for size in reversed(self.capture_sizes):  # largest first, so smaller ones share its pool
            graph, logits = self._capture(size, pool)
            pool = graph.pool()
            self._graphs[size] = (graph, logits)
        logger.warning(
            "%s %d CUDA graphs (decode batch sizes %s) in %.1f s",
            "compiled the model and captured" if self.compile else "captured",
            len(self._graphs),
            ", ".join(map(str, self.capture_sizes)),
            time.perf_counter() - started,
        )

    def _static_input(self, size: int) -> ModelInput:
        """The first ``size`` rows of the static buffers, as the batch a graph was captured on."""
        static = self._static
        if static is None:
            raise RuntimeError("call initialize_kv_cache before execute")
        sliced: dict[str, Any] = {
            name: getattr(static, name)[:size]
            for name in (*_STATIC_FIELDS, "logits_indices", "seq_lens_cpu")
        }
        sliced["query_start_loc"] = static.query_start_loc[: size + 1]
        sliced["query_start_loc_cpu"] = static.query_start_loc_cpu[: size + 1]
        return dataclasses.replace(static, num_decodes=size, **sliced)

    def _capture(self, size: int, pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        batch = self._static_input(size)
        with torch.inference_mode():
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: lazy inits, allocator, autotuning
                    self.compute_logits(batch)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.compute_logits(batch)
        return graph, logits

    def execute(self, batch: ModelInput) -> torch.Tensor:
        """Replay the graph for pure decode steps that fit; run other steps eagerly."""
        size = graph_bucket(batch, self.capture_sizes, self.max_pages) if self._graphs else None
        if size is None or self._static is None:
            return super().execute(batch)
        self.check_batch(batch)
        if self._unzeroed is not None:  # CPU pools only (tests)
            self._zero_fresh_pages(self._unzeroed, batch.slot_mapping // batch.page_size)
        padded = pad_decode_input(batch, size, self.max_pages, self.scratch_page)
        for name in _STATIC_FIELDS:
            getattr(self._static, name)[:size].copy_(getattr(padded, name), non_blocking=True)
        graph, logits = self._graphs[size]
        graph.replay()
        # The next replay overwrites the static logits: hand out a copy of the real rows.
        return logits[: batch.num_reqs].clone()  # [B, vocab]

    def shutdown(self) -> None:
        """Drop the graphs and static buffers, then the weights and the KV pool."""
        self._graphs = {}
        self._static = None
        super().shutdown()
