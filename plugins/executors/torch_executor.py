"""The eager PyTorch executor: one process, one device (CPU or a CUDA GPU).

It runs a model that splits at attention (``SplitCausalLM``) through a forward of its own
(:meth:`TorchExecutor.forward`): ``embed``, then on a CPU every layer of the step in one C++
call where the fused step covers it (``brigade.plugins.cpu``: ``fused_decode``), else layer by
layer (``attention_input``, ``attend``, ``finish_layer``), then ``final_norm``. It hands the
model the device's fused small operations (``fused_ops``: the C++ kernels on a CPU, Triton on a
GPU) and, on a CPU, swaps its linear layers for packed GEMMs (``cpu_linear``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from brigade.interfaces import (
    AcceptsLayerOps,
    CausalLM,
    ConfigError,
    Executor,
    ExecutorParams,
    KVCacheSpec,
    LayerOpsProvider,
    ModelArchitecture,
    ModelInput,
    ModelLoadError,
    ProvidesDecoderWeights,
    SplitCausalLM,
    option,
)
from brigade.interfaces.executor import DTYPE_NAMES
from brigade.model_input import SeqChunk, build_model_input
from brigade.plugins.cpu import (
    CPU_LINEAR_MODES,
    CpuDecodeLayers,
    advise_huge_pages,
    cpu_layer_ops,
    keep_freed_memory,
    use_cpu_linears,
)
from brigade.plugins.gpu import triton_layer_ops
from brigade.plugins.models import ARCHITECTURES, TensorParallel

if TYPE_CHECKING:
    from brigade.plugins.executors.compiled_forward import CompiledForward
    from brigade.plugins.executors.tp_ranks import RankGroup

__all__ = [
    "DEVICE_PATTERN",
    "TorchExecutor",
    "TorchExecutorOptions",
    "available_memory_bytes",
    "resolve_device",
]

logger = logging.getLogger(__name__)

DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"


@dataclasses.dataclass(frozen=True)
class TorchExecutorOptions:
    """Options of the ``torch`` executor."""

    device: str = option(
        "auto",
        help="'auto' (cuda if available, else cpu), 'cpu', 'cuda' or 'cuda:N'",
        pattern=DEVICE_PATTERN,
    )
    num_threads: int = option(0, help="torch CPU threads; 0 = leave torch's default", ge=0)
    compile: bool = option(
        False,
        help="on a CPU, run the forward under torch.compile (inductor fuses the work between "
        "attention calls and prepacks the weights); compiling takes about 100 s for a "
        "30-layer model on 2 cores at the first start (later starts reuse "
        "$BRIGADE_CACHE_DIR/inductor), and a failed compile falls back to eager with a "
        "warning. Off by default: on the CPUs measured so far it did not pay "
        "(docs/benchmarks.md). Ignored on CUDA (the cuda-graph executor has its own)",
    )
    cpu_linear: str = option(
        "panels",
        help="on a CPU, how linear layers and the LM head run: 'panels' = Brigade's GEMM on "
        "weights packed once at load into column panels (float32 and bfloat16), and on CPUs "
        "with AMX bfloat16 on Brigade's AMX tile GEMM (1.0-1.4x 'packed' at decode batch sizes, "
        "0.8-1.0x on prefill chunks of 1024-4096 rows); 'tiles' = the same (the tile GEMM's mode "
        "from when it was opt-in), 'packed' = oneDNN's matmul "
        "on weights reordered once at load into the layout its kernels read on this CPU, "
        "'onednn' = oneDNN on the weights as loaded, 'plain' = F.linear. A packed copy "
        "replaces the loaded weight; with tied embeddings the LM head gets its own "
        "(docs/benchmarks.md has the measurements behind the default). Not used with compile",
        choices=CPU_LINEAR_MODES,
    )
    reuse_freed_memory: bool = option(
        True,
        help="on a CPU with glibc, keep large freed buffers (a step's activations) in the "
        "process heap for the next step instead of returning them to the OS, which would fault "
        "them in again page by page every step (docs/benchmarks.md)",
    )
    kv_prefault: bool = option(
        True,
        help="on a CPU, commit the whole KV pool at start: ask Linux for transparent huge pages "
        "(madvise) and zero it, as vLLM-CPU allocates its KV space at start, so no step waits on "
        "the OS faulting fresh pages in (the mixed workload 4-5% faster) and scattered pages cost "
        "fewer TLB misses (docs/benchmarks.md); about 1 s per GiB at start here. false = each "
        "page is zeroed when a step first writes it, so memory is committed as it is used",
    )
    fused_ops: bool = option(
        True,
        help="run a decoder layer's small operations (RMSNorm, the residual add before the second "
        "norm, SiLU-mul, RoPE) fused: on a CPU in float32 or bfloat16 as Brigade's C++ kernels "
        "(built once, like the attention kernel), on a CUDA GPU as Triton kernels; false = "
        "torch's operations",
    )
    fused_decode: bool = option(
        True,
        help="on a CPU in float32 or bfloat16, with fused_ops, run all decoder layers of a step "
        "as one C++ call (decode steps, and steps whose prefill chunks take the cpu attention "
        "backend's C++ prefill kernel; the same kernels in the same order as the eager forward, so "
        "identical results, without Python's per-operation overhead); false = layer by layer",
    )
    tensor_parallel_size: int = option(
        1,
        help="split the model over this many ranks (processes on this machine: rank 0 in the "
        "engine, the others spawned; gloo on a CPU, NCCL over one GPU each from [executor] "
        "device on CUDA): attention heads, KV heads, MLP columns and the vocabulary are "
        "divided, and each rank reads only its slices of the weights. The model's attention "
        "heads and intermediate_size must divide by it, and its KV heads divide by it or it "
        "by them (KV heads are then replicated); not with compile (docs/distributed.md). On "
        "a CPU, one rank per core: data_parallel_size x tensor_parallel_size is at most the "
        "machine's cores",
        ge=1,
    )
    distributed_executor_backend: str = option(
        "mp",
        help="where ranks 1..N-1 of tensor_parallel_size (and the replicas of brigade generate "
        "and brigade serve --data-parallel-size) run: mp = processes on this machine; ray = Ray "
        "actors in a placement group on the cluster RAY_ADDRESS names (else a local one); needs "
        "the ray extra (docs/distributed.md)",
        choices=("mp", "ray"),
    )


def resolve_device(name: str) -> torch.device:
    """The torch device for option ``device``; ``RuntimeError`` if it is not usable here."""
    if not re.fullmatch(DEVICE_PATTERN, name):
        raise ValueError(f"device {name!r} is not allowed; allowed: auto, cpu, cuda, cuda:N")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {name!r}: CUDA is not available; use 'cpu' or 'auto'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RuntimeError(
                f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) visible"
            )
    return device


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on ``device`` now: CUDA's free bytes, or /proc/meminfo's MemAvailable."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


class TorchExecutor(Executor):
    """Loads an HF-format model with brigade's own modules and runs it eagerly."""

    supports_copy_pages: ClassVar[bool] = True
    returns_hidden_states: ClassVar[bool] = True

    def __init__(
        self,
        params: ExecutorParams,
        options: TorchExecutorOptions,
        rank: TensorParallel | None = None,
    ) -> None:
        """``rank``: this executor is that rank of a tensor-parallel group, started by rank 0
        (``brigade.plugins.executors.tp_worker``); None: rank 0, or no group."""
        self.params = params
        self._device = resolve_device(options.device)
        self.tp = rank
        """This executor's place in a tensor-parallel group; None without one."""
        if rank is None and options.tensor_parallel_size > 1:
            self.tp = TensorParallel(0, options.tensor_parallel_size)
        self.ranks: RankGroup | None = None
        """Rank 0's link to the other ranks; None on them and without a group."""
        if options.reuse_freed_memory and self._device.type == "cpu":
            keep_freed_memory()
        self._prefault = options.kv_prefault
        if options.num_threads:
            torch.set_num_threads(options.num_threads)  # process-wide, as torch allows
        elif self.tp is not None and rank is None and self._device.type == "cpu":
            from brigade.plugins.executors.tp_worker import cpu_threads

            torch.set_num_threads(cpu_threads(self.tp.size))  # the ranks share the cores
        self.attention = params.attention
        self.attention.check_device(str(self.device))
        checkpoint = params.checkpoint
        hf_config = dict(checkpoint.config)
        architecture = params.model_factory or _architecture_for(hf_config, params.model_path)
        architecture.validate_config(hf_config)
        self.dtype = _named_dtype("dtype", params.dtype)
        self.kv_cache_dtype = (
            self.dtype
            if params.kv_cache_dtype == "auto"
            else _named_dtype("kv_cache_dtype", params.kv_cache_dtype)
        )
        self.max_model_len = _max_model_len(params.max_model_len, hf_config)
        if self.tp is None:
            self.model: CausalLM = architecture.build(
                hf_config, self.attention, self.dtype, self.device
            )
            architecture.load_weights(self.model, checkpoint.weights(self.dtype, self.device))
        else:
            self.model = self._build_shard(architecture, hf_config, options)
        weights = (
            self.model.decoder_weights() if isinstance(self.model, ProvidesDecoderWeights) else None
        )
        if isinstance(self.model, torch.nn.Module):
            self.model.eval()
            if self.device.type == "cpu" and not options.compile:
                gate_up = [layer.gate_up_proj for layer in weights.layers] if weights else []
                use_cpu_linears(self.model, options.cpu_linear, gate_up=gate_up)
        if options.fused_ops and isinstance(self.model, AcceptsLayerOps):
            self.model.use_layer_ops(_layer_ops_provider(self.device))
        self.fused_step: CpuDecodeLayers | None = None
        """Every layer of a step in one C++ call on a CPU, where it covers the step (identical
        results); None where it never runs (``fused_decode`` or ``fused_ops`` off, CUDA, a
        tensor-parallel shard: the one-call step has no collectives)."""
        if (
            options.fused_ops
            and options.fused_decode
            and self.tp is None
            and self.device.type == "cpu"
            and isinstance(self.model, ProvidesDecoderWeights)
            and (weights := self.model.decoder_weights()) is not None  # the swapped linears
        ):
            self.fused_step = CpuDecodeLayers(weights)
        self.split: SplitCausalLM | None = (
            self.model if isinstance(self.model, SplitCausalLM) else None
        )
        """The model's pieces, which :meth:`forward` runs; None: the model runs whole."""
        self.forward_fn: Callable[..., torch.Tensor] = (
            self.forward if self.split is not None else self.model.forward
        )
        """The forward a step runs (a subclass may swap in a compiled one)."""
        self.compiled: CompiledForward | None = None
        """The compiled forward on a CPU (``compile`` option), else None."""
        num_layers = len(self.model.attention_layers)
        if options.compile and self.device.type == "cpu" and isinstance(self.model, SplitCausalLM):
            from brigade.plugins.executors.compiled_forward import CompiledForward

            self.compiled = CompiledForward(self.model, num_layers, eager=self.forward_fn)
            self.forward_fn = self.compiled
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._unzeroed: torch.Tensor | None = None
        """CPU pools: [num_pages] bool, True for pages not yet zeroed."""
        self.num_pages = 0
        self.host_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Swap pages in host memory (ids ``num_pages`` and up)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: Any,
    ) -> torch.Tensor:
        """The model's forward run by its pieces: ``embed``, then the step's layers in one C++
        call where :attr:`fused_step` takes the step, else layer by layer, then ``final_norm``;
        input_ids, positions [T] -> final-normed hidden states [T, hidden_size]."""
        model = self.split
        if model is None:
            raise RuntimeError("the model does not split at attention; call its own forward")
        hidden, cos, sin = model.embed(input_ids, positions)
        fused = self.fused_step
        if (
            fused is not None
            and (after := fused.run(hidden, cos, sin, kv_caches, attn_metadata)) is not None
        ):
            return model.final_norm(after)
        for index, kv_cache in enumerate(kv_caches):
            q, k, v = model.attention_input(index, hidden, cos, sin)
            attention = model.attend(index, q, k, v, kv_cache, attn_metadata)
            hidden = model.finish_layer(index, hidden, attention)
        return model.final_norm(hidden)

    def _build_shard(
        self,
        architecture: ModelArchitecture,
        hf_config: dict[str, object],
        options: TorchExecutorOptions,
    ) -> CausalLM:
        """This rank's shard; on rank 0, after starting the other ranks (which load theirs
        meanwhile) and before waiting for them to be ready."""
        from brigade.plugins.executors.tp_worker import check_split, rank_device, start_ranks

        tp = self.tp
        if tp is None:  # pragma: no cover - the caller checked
            raise RuntimeError("not a tensor-parallel executor")
        architecture = check_split(architecture, hf_config, tp.size, compile=options.compile)
        if tp.rank == 0:  # the checks above ran before any process starts
            self._device = rank_device(self.device, 0, tp.size)
            launcher = None
            if options.distributed_executor_backend == "ray":
                from brigade.plugins.executors.tp_ray import RayLauncher

                launcher = RayLauncher()
            self.ranks, tp = start_ranks(self.params, options, self.device, tp.size, launcher)
            self.tp = tp
            # An executor dropped without shutdown() still stops its ranks.
            weakref.finalize(self, self.ranks.stop)
        try:
            model = architecture.build(hf_config, self.attention, self.dtype, self.device, tp)
            architecture.load_checkpoint(model, self.params.checkpoint, self.dtype, self.device)
            if self.ranks is not None:
                self.ranks.wait("ready")
        except BaseException:
            self.shutdown_ranks()
            raise
        return model

    def _send(self, name: str, *args: Any) -> contextlib.AbstractContextManager[None]:
        """Have the other ranks call ``name(*args)`` too; the context guards rank 0's part."""
        if self.ranks is None:
            return contextlib.nullcontext()
        self.ranks.send(name, *args)
        return self.ranks.guard()

    def shutdown_ranks(self) -> None:
        """Stop the other ranks (rank 0; idempotent)."""
        if self.ranks is not None:
            self.ranks.stop()
            self.ranks = None

    @property
    def device(self) -> torch.device:
        """The device of the weights, the KV pool and the logits."""
        return self._device

    def _layer_shape(self, num_pages: int, index: int) -> tuple[int, ...]:
        layer = self.model.attention_layers[index]
        return self.attention.kv_cache_shape(
            num_pages, self.params.page_size, layer.num_kv_heads, layer.head_dim
        )

    def kv_cache_spec(self) -> KVCacheSpec:
        """Bytes per page over all layers' K and V, and the memory free now."""
        element_size = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        bytes_per_page = sum(
            2 * element_size * _numel(self._layer_shape(1, index))
            for index in range(len(self.model.attention_layers))
        )
        if self.tp is not None and self.device.type == "cpu":
            bytes_per_page *= self.tp.size  # every rank's pool comes out of the same memory
        return KVCacheSpec(
            num_layers=len(self.model.attention_layers),
            page_size=self.params.page_size,
            bytes_per_page=bytes_per_page,
            available_bytes=available_memory_bytes(self.device),
            max_model_len=self.max_model_len,
            vocab_size=self.model.vocab_size,
        )

    def initialize_kv_cache(self, num_pages: int, num_host_pages: int = 0) -> None:
        """K and V per layer; every page is zero before its first use (attention contract).

        On CUDA the pool is zeroed at once. On the CPU too with ``kv_prefault`` (the
        default), on huge pages where Linux gives them; without it pages are zeroed when a
        step first writes them, so the pool's memory is committed as it is used. Host (swap)
        pages are only written by :meth:`copy_pages` before they are read.
        """
        if self.kv_caches:
            raise RuntimeError("initialize_kv_cache was already called; it allocates once")
        if num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {num_pages}")
        with self._send("initialize_kv_cache", num_pages, num_host_pages):
            self._allocate_kv_cache(num_pages, num_host_pages)

    def _allocate_kv_cache(self, num_pages: int, num_host_pages: int) -> None:
        lazy = self.device.type == "cpu" and not self._prefault
        started = time.perf_counter()
        for index in range(len(self.model.attention_layers)):
            shape = self._layer_shape(num_pages, index)
            self.kv_caches.append((self._new_pool(shape), self._new_pool(shape)))
        if self.device.type == "cpu" and self._prefault:
            size = sum(k.nbytes + v.nbytes for k, v in self.kv_caches) / 2**30
            logger.info(
                "KV pool: %.2f GiB committed in %.1f s", size, time.perf_counter() - started
            )
        self._unzeroed = torch.ones(num_pages, dtype=torch.bool) if lazy else None
        self.num_pages = num_pages
        if self.device.type == "cpu":
            self._warm_up()
        pin = self.device.type == "cuda"
        for index in range(len(self.model.attention_layers) if num_host_pages else 0):
            shape = self._layer_shape(num_host_pages, index)
            self.host_caches.append(
                (
                    torch.empty(shape, dtype=self.kv_cache_dtype, pin_memory=pin),
                    torch.empty(shape, dtype=self.kv_cache_dtype, pin_memory=pin),
                )
            )

    def _new_pool(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One layer's K or V pool: zeroed on CUDA; on a CPU with ``kv_prefault`` advised onto
        huge pages before its first touch and zeroed (committed) now, else left unzeroed."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
        pool = torch.empty(shape, dtype=self.kv_cache_dtype)
        if self._prefault:
            advise_huge_pages(pool.data_ptr(), pool.nbytes)
            pool.zero_()
        return pool

    def _warm_up(self) -> None:
        """Do the one-time work of the first steps now, at start, not in the first request:
        a 2-token prefill and a 1-token decode step (building the CPU attention kernel,
        packing the LM head, compiling the forward when ``compile`` is on) in page 0, which
        is then zeroed again (or left marked unzeroed), so the garbage they write never
        reaches a request."""
        page_size = self.params.page_size
        table = [0] * -(-2 // page_size)
        batches = (
            build_model_input([SeqChunk([0, 0], 0, table)], page_size),
            build_model_input([SeqChunk([0], 1, table)], page_size),
        )
        started = time.perf_counter()
        for batch in batches:  # every rank warms up alike, in step: no command is sent
            self._run(batch)
        if self._unzeroed is not None:
            self._unzeroed[0] = True
        else:
            for key_cache, value_cache in self.kv_caches:
                key_cache[0].zero_()
                value_cache[0].zero_()
        if self.compiled is not None and self.compiled.failed is None:
            logger.info("compiled the forward in %.1f s", time.perf_counter() - started)

    def execute(self, batch: ModelInput) -> torch.Tensor:
        """Float32 logits [len(batch.logits_indices), vocab_size], on this executor's device."""
        self.check_batch(batch)  # a batch that fails here must not reach the ranks
        with self._send("execute", batch):
            return self._run(batch)

    def _run(self, batch: ModelInput) -> torch.Tensor:
        """:meth:`execute` on this rank alone."""
        batch = self.prepare_input(batch)
        with torch.inference_mode():
            return self.compute_logits(batch)

    def execute_with_hidden_states(self, batch: ModelInput) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 logits of ``logits_indices`` and final hidden states of ``hidden_indices``
        (eager forward: steps that pool are prefills, which graphs do not hold)."""
        if batch.hidden_indices is None:
            raise ValueError("execute_with_hidden_states needs a batch with hidden_indices")
        self.check_batch(batch)
        with self._send("execute_with_hidden_states", batch):
            return self._run_with_hidden_states(batch)

    def _run_with_hidden_states(self, batch: ModelInput) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.prepare_input(batch)
        assert batch.hidden_indices is not None
        with torch.inference_mode():
            metadata = self.attention.build_metadata(batch)
            hidden = self.forward_fn(batch.input_ids, batch.positions, self.kv_caches, metadata)
            pooled = hidden[batch.hidden_indices].float()
            if batch.logits_indices.numel() == 0:
                empty = torch.empty(0, self.model.vocab_size, device=self.device)
                return empty, pooled
            return self.model.compute_logits(hidden[batch.logits_indices]).float(), pooled

    def prepare_input(self, batch: ModelInput) -> ModelInput:
        """Check ``batch`` against the pool, zero fresh CPU pages, move it to the device."""
        self.check_batch(batch)
        if self._unzeroed is not None:
            self._zero_fresh_pages(self._unzeroed, batch.slot_mapping // batch.page_size)
        return batch.to(self.device, non_blocking=True)

    def check_batch(self, batch: ModelInput) -> None:
        """``RuntimeError`` before :meth:`initialize_kv_cache`, ``ValueError`` on a page size
        other than the pool's."""
        if not self.kv_caches:
            raise RuntimeError("call initialize_kv_cache before execute")
        if batch.page_size != self.params.page_size:
            raise ValueError(
                f"batch page_size {batch.page_size} differs from the KV pool's "
                f"{self.params.page_size}"
            )

    def compute_logits(self, batch: ModelInput) -> torch.Tensor:
        """Forward of a batch already on the device: float32 logits [S, vocab_size]."""
        metadata = self.attention.build_metadata(batch)
        hidden = self.forward_fn(
            batch.input_ids, batch.positions, self.kv_caches, metadata
        )  # [T, hidden_size]
        return self.model.compute_logits(hidden[batch.logits_indices]).float()

    def _zero_fresh_pages(self, unzeroed: torch.Tensor, pages: torch.Tensor) -> None:
        """Zero the pages among ``pages`` (host tensor) that no step has touched yet."""
        pages = torch.unique(pages)
        fresh = pages[unzeroed[pages]]
        if fresh.numel():
            for key_cache, value_cache in self.kv_caches:
                key_cache.index_fill_(0, fresh, 0)
                value_cache.index_fill_(0, fresh, 0)
            unzeroed[fresh] = False

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy page ``src[i]`` onto ``dst[i]`` in every layer's K and V (device or host)."""
        if len(src) != len(dst):
            raise ValueError(f"copy_pages: {len(src)} source pages but {len(dst)} destinations")
        if not src:
            return
        limit = self.num_pages + (self.host_caches[0][0].shape[0] if self.host_caches else 0)
        if min(*src, *dst) < 0 or max(*src, *dst) >= limit:
            raise ValueError(f"copy_pages: page ids must be in [0, {limit})")
        with self._send("copy_pages", list(src), list(dst)):
            self._copy_pages(src, dst)

    def _copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        source = torch.tensor(list(src), dtype=torch.int64)
        target = torch.tensor(list(dst), dtype=torch.int64)
        if self._unzeroed is not None:
            on_device = target < self.num_pages
            self._unzeroed[target[on_device]] = False  # whole pages are overwritten
        with torch.inference_mode():
            for from_host in (False, True):
                for to_host in (False, True):
                    pairs = ((source >= self.num_pages) == from_host) & (
                        (target >= self.num_pages) == to_host
                    )
                    if bool(pairs.any()):
                        self._copy(source[pairs], target[pairs], from_host, to_host)

    def _copy(
        self, source: torch.Tensor, target: torch.Tensor, from_host: bool, to_host: bool
    ) -> None:
        """One direction of :meth:`copy_pages`; ids are global, host ones offset by num_pages."""
        source = source - self.num_pages if from_host else source
        target = target - self.num_pages if to_host else target
        pools = (self.kv_caches, self.host_caches)
        for layer in range(len(self.kv_caches)):
            for kind in range(2):  # K, then V
                from_pool = pools[from_host][layer][kind]
                to_pool = pools[to_host][layer][kind]
                pages = from_pool.index_select(0, source.to(from_pool.device))
                # Device-to-host copies block, so the host pool is complete on return.
                pages = pages.to(to_pool.device, non_blocking=not to_host)
                to_pool.index_copy_(0, target.to(to_pool.device), pages)

    def shutdown(self) -> None:
        """Drop the weights and the KV pool; stop the other tensor-parallel ranks."""
        self.shutdown_ranks()
        self.kv_caches = []
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _layer_ops_provider(device: torch.device) -> LayerOpsProvider:
    """The fused small operations for a model on ``device``: the C++ kernels on a CPU, Triton
    on a CUDA GPU (each None for tensors it does not take)."""
    return cpu_layer_ops if device.type == "cpu" else triton_layer_ops


def _architecture_for(hf_config: dict[str, object], model_path: str) -> ModelArchitecture:
    names = hf_config.get("architectures")
    for name in names if isinstance(names, list) else []:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]()
    raise ModelLoadError(
        f"{model_path}: architecture {names} is not supported; "
        f"supported: {', '.join(sorted(ARCHITECTURES))}"
    )


def _named_dtype(field: str, name: str) -> torch.dtype:
    """The torch dtype ``ExecutorParams.<field>`` names (core resolved the model's 'auto')."""
    if name not in DTYPE_NAMES:
        allowed = ("auto", *DTYPE_NAMES) if field == "kv_cache_dtype" else DTYPE_NAMES
        raise ValueError(f"{field} {name!r} is not supported; allowed: {', '.join(allowed)}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def _max_model_len(requested: int, hf_config: dict[str, object]) -> int:
    limit = hf_config.get("max_position_embeddings")
    if requested == 0:
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(
                "max_model_len is 0 (the model's limit) but config.json has no "
                "max_position_embeddings; set [model] max_model_len"
            )
        return limit
    if isinstance(limit, int) and requested > limit:
        raise ConfigError(
            f"[model] max_model_len {requested} exceeds the model's max_position_embeddings "
            f"{limit}; allowed: up to {limit}, or 0 for the model's own limit"
        )
    return requested


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
