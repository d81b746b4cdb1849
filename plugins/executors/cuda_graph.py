"""The ``cuda-graph`` executor: the eager torch executor plus CUDA graphs for every step that fits.

Model loading, the KV pool, page copies and eager execution are :class:`TorchExecutor`'s.
This class adds two kinds of graphs, captured when the KV pool is allocated:

* **Decode graphs** (whole forward, attention included), one per batch size in
  ``capture_sizes``: a pure decode step is padded up to the nearest captured size
  (:mod:`graph_padding`), its host tensors are copied into persistent device buffers that every
  graph reads, and the graph is replayed. Padding rows write and read a scratch page that no
  block table names (the pool has one page more than core was told). These need an attention
  backend whose ``supports_cuda_graphs`` is True; with another they are skipped (warning
  logged once).
* **Piecewise graphs** (``piecewise = true``) for every other step of at most
  ``max(mixed_capture_tokens)`` tokens, e.g. chunked prefill mixing a prompt chunk into a
  decode batch: the dense work between attention calls is captured per token bucket and
  attention runs eagerly on the real tokens with the step's own metadata (:mod:`piecewise`).
  Any attention backend works, since attention is never captured. The model must split at
  attention (:class:`~brigade.interfaces.SplitCausalLM`; brigade's decoder does).

Steps larger than every bucket run eagerly. How graphs are captured is injectable
(:mod:`graph_runner`), so all of this runs on a CPU in tests with graphs imitated.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

import torch

from brigade.interfaces import ExecutorParams, ModelInput, SplitCausalLM, option
from brigade.plugins.executors.graph_padding import (
    check_capture_sizes,
    graph_bucket,
    pad_decode_input,
    padding_input,
)
from brigade.plugins.executors.graph_runner import CapturedGraph, CudaGraphRunner, GraphRunner
from brigade.plugins.executors.piecewise import PiecewiseGraphs
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
    piecewise: bool = option(
        True,
        help="run steps no decode graph takes (prefill chunks, mixed prefill + decode, large "
        "decode batches) as CUDA graphs of the dense layers, one set per token bucket, with "
        "attention eager; false = such steps run eagerly",
    )
    mixed_capture_tokens: tuple[int, ...] = option(
        (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048),
        help="token buckets of the piecewise graphs; a step is padded up to the nearest one, "
        "larger steps run eagerly",
    )
    compile: bool = option(
        False, help="torch.compile the model; compile + graph capture time is logged at startup"
    )
    device: str = option(
        "cuda", help="'cuda' or 'cuda:N'; 'auto' is 'cuda'", pattern=r"auto|cuda(:\d+)?"
    )

    def __post_init__(self) -> None:
        check_capture_sizes(self.capture_sizes)
        check_capture_sizes(self.mixed_capture_tokens, "mixed_capture_tokens")


class CudaGraphExecutor(TorchExecutor):
    """Replays captured graphs: decode graphs, else piecewise graphs, else eager (``torch``)."""

    @classmethod
    def check_device(cls, device: str) -> None:
        """Raise ``RuntimeError`` unless a CUDA GPU is usable."""
        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise RuntimeError(
                f"the cuda-graph executor needs a CUDA GPU (device {device!r}, CUDA "
                f"{'available' if torch.cuda.is_available() else 'not available'}); "
                "use executor plugin 'torch'"
            )

    def __init__(
        self,
        params: ExecutorParams,
        options: CudaGraphExecutorOptions,
        runner: GraphRunner | None = None,
    ) -> None:
        """``runner`` captures the graphs (default: CUDA graphs on this executor's device)."""
        device = "cuda" if options.device == "auto" else options.device
        self.check_device(device)
        super().__init__(params, TorchExecutorOptions(device=device))
        self.runner = runner if runner is not None else CudaGraphRunner(self.device)
        self.capture_sizes = check_capture_sizes(options.capture_sizes)
        self.graphs_enabled = type(self.attention).supports_cuda_graphs
        backend_name = type(self.attention).name or type(self.attention).__name__
        if not self.graphs_enabled:
            logger.warning(
                "attention backend %r does not support CUDA graphs; the cuda-graph executor "
                "captures no decode graphs%s",
                backend_name,
                " (piecewise graphs still run its steps)" if options.piecewise else "",
            )
        self.pieces: PiecewiseGraphs | None = None
        if options.piecewise and isinstance(self.model, SplitCausalLM):
            self.pieces = PiecewiseGraphs(
                self.model,
                len(self.model.attention_layers),
                options.mixed_capture_tokens,
                self.runner,
                self.device,
            )
        elif options.piecewise:
            logger.warning(
                "model %s does not split at attention; steps with prefill chunks run eagerly",
                type(self.model).__name__,
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
        self._graphs: dict[int, CapturedGraph] = {}
        """decode batch size -> its graph, whose output is the static logits [size, vocab]."""

    def initialize_kv_cache(self, num_pages: int, num_host_pages: int = 0) -> None:
        """The pool plus one scratch page (id ``num_pages``) for padding rows; then capture."""
        super().initialize_kv_cache(num_pages + 1, num_host_pages)
        self.num_pages = num_pages  # host (swap) page ids still start at num_pages
        self.scratch_page = num_pages
        started = time.perf_counter()
        captured = []
        if self.graphs_enabled:
            self._capture_decode_graphs()
            captured.append(
                f"{len(self._graphs)} decode graphs (batch sizes "
                f"{', '.join(map(str, self.capture_sizes))})"
            )
        if self.pieces is not None:
            self.pieces.capture()
            captured.append(
                f"{len(self.pieces.graphs) * (self.pieces.num_layers + 1)} piecewise graphs "
                f"(token counts {', '.join(map(str, self.pieces.capture_tokens))})"
            )
        if captured:
            logger.warning(
                "%s %s in %.1f s",
                "compiled the model and captured" if self.compile else "captured",
                " and ".join(captured),
                time.perf_counter() - started,
            )

    def _capture_decode_graphs(self) -> None:
        largest = self.capture_sizes[-1]
        template = padding_input(
            largest, self.max_pages, self.scratch_page, self.params.page_size, self.max_model_len
        )
        self._static = template.to(self.device)
        for size in reversed(self.capture_sizes):  # largest first: the rest reuse its pool
            step = functools.partial(self.compute_logits, self._static_input(size))
            with torch.inference_mode():
                self._graphs[size] = self.runner.capture(step)

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

    def execute(self, batch: ModelInput) -> torch.Tensor:
        """A decode graph if one holds the step, else piecewise graphs, else eager."""
        size = graph_bucket(batch, self.capture_sizes, self.max_pages) if self._graphs else None
        if size is not None:
            return self._replay_decode(batch, size)
        pieces = self.pieces
        tokens = pieces.bucket(batch.num_tokens) if pieces is not None else None
        if pieces is None or tokens is None:
            return super().execute(batch)
        batch = self.prepare_input(batch)
        with torch.inference_mode():
            metadata = self.attention.build_metadata(batch)  # from the real tokens only
            hidden = pieces.run(batch, tokens, self.kv_caches, metadata)  # [T, hidden_size]
            return self.model.compute_logits(hidden[batch.logits_indices]).float()

    def _replay_decode(self, batch: ModelInput, size: int) -> torch.Tensor:
        static = self._static
        if static is None:
            raise RuntimeError("call initialize_kv_cache before execute")
        self.check_batch(batch)
        if self._unzeroed is not None:  # CPU pools only (tests)
            self._zero_fresh_pages(self._unzeroed, batch.slot_mapping // batch.page_size)
        padded = pad_decode_input(batch, size, self.max_pages, self.scratch_page)
        for name in _STATIC_FIELDS:
            getattr(static, name)[:size].copy_(getattr(padded, name), non_blocking=True)
        graph = self._graphs[size]
        with torch.inference_mode():
            graph.replay()
        if graph.output is None:
            raise RuntimeError("a decode graph must return its logits")
        # The next replay overwrites the static logits: hand out a copy of the real rows.
        return graph.output[: batch.num_reqs].clone()  # [B, vocab]

    def shutdown(self) -> None:
        """Drop the graphs and static buffers, then the weights and the KV pool."""
        self._graphs = {}
        self._static = None
        if self.pieces is not None:
            self.pieces.release()
        super().shutdown()
