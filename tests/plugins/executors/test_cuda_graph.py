"""The cuda-graph executor: bucketing and padding on the CPU; graph replay on a GPU.

CPU tests cover everything that does not need CUDA: which captured size a step uses, how a
decode batch is padded, and that padding rows (aimed at the scratch page) change neither the
real rows' attention output nor any real page, with the sdpa and triton backends; and, with
graphs imitated by ``RerunGraphRunner``, decode graphs and piecewise graphs (mixed steps;
more in tests/plugins/executors/test_piecewise.py) against the eager executor in the triton
interpreter. The ``gpu``-marked tests compare graph replay with the eager executor
(scripts/gpu_check.sh).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from brigade.errors import ConfigError
from brigade.interfaces import AttentionBackend, Checkpoint, ExecutorParams, ModelInput, NoOptions
from brigade.model_input import SeqChunk, build_model_input
from brigade.models.checkpoint import open_checkpoint
from brigade.models.create import create_model
from brigade.options import build_options
from brigade.plugins.attention.sdpa import SdpaBackend
from brigade.plugins.attention.triton_backend import (
    TritonAttentionOptions,
    TritonBackend,
    triton_interpreting,
)
from brigade.plugins.executors.cuda_graph import CudaGraphExecutor, CudaGraphExecutorOptions
from brigade.plugins.executors.graph_padding import (
    bucket_for,
    check_capture_sizes,
    graph_bucket,
    pad_decode_input,
)
from brigade.plugins.executors.graph_runner import RerunGraphRunner
from brigade.plugins.executors.torch_executor import TorchExecutor, TorchExecutorOptions
from brigade.testing.attention import naive_attention, random_attention_case

PAGE = 4
SIZES = (1, 2, 4, 8)
HAS_CUDA = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(
    not HAS_CUDA or triton_interpreting(), reason="needs CUDA and compiled triton kernels"
)


def decode_batch(num_rows: int, first_page: int = 0) -> ModelInput:
    """``num_rows`` decode rows with contexts of 5, 6, ... tokens on pages of ``PAGE``."""
    chunks = []
    for row in range(num_rows):
        context = 5 + row
        pages = -(-(context + 1) // PAGE)
        table = list(range(first_page + 3 * row, first_page + 3 * row + pages))
        chunks.append(SeqChunk([10 + row], context, table))
    return build_model_input(chunks, PAGE)


def test_capture_sizes_are_sorted_and_checked() -> None:
    assert check_capture_sizes((8, 1, 4, 4)) == (1, 4, 8)
    with pytest.raises(ValueError, match="at least one"):
        check_capture_sizes(())
    with pytest.raises(ValueError, match="positive"):
        check_capture_sizes((0, 4))
    with pytest.raises(ConfigError, match="positive"):
        build_options(CudaGraphExecutorOptions, {"capture_sizes": [4, -1]}, "[executor]")


@pytest.mark.parametrize(
    ("num_reqs", "bucket"), [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, None)]
)
def test_a_step_runs_in_the_smallest_size_that_holds_it(num_reqs: int, bucket: int | None) -> None:
    assert bucket_for(num_reqs, SIZES) == bucket


def test_only_pure_decode_steps_that_fit_are_graphed() -> None:
    assert graph_bucket(decode_batch(3), SIZES, max_pages=8) == 4
    mixed = build_model_input(
        [SeqChunk([1], 5, [0, 1]), SeqChunk([2, 3, 4], 0, [2])], PAGE
    )  # a decode and a prefill chunk
    assert graph_bucket(mixed, SIZES, max_pages=8) is None
    prefill = build_model_input([SeqChunk([1, 2], 0, [0])], PAGE)
    assert graph_bucket(prefill, SIZES, max_pages=8) is None
    assert graph_bucket(decode_batch(9), SIZES, max_pages=8) is None  # larger than any size
    assert graph_bucket(decode_batch(2), SIZES, max_pages=1) is None  # tables too wide
    no_logits = dataclasses.replace(decode_batch(2), logits_indices=torch.tensor([1]))
    assert graph_bucket(no_logits, SIZES, max_pages=8) is None


def test_padding_keeps_real_rows_and_aims_the_rest_at_the_scratch_page() -> None:
    batch = decode_batch(3)
    scratch = 40
    padded = pad_decode_input(batch, 8, max_pages=5, scratch_page=scratch)
    assert padded.num_reqs == 8
    assert padded.is_pure_decode
    assert torch.equal(padded.input_ids[:3], batch.input_ids)
    assert torch.equal(padded.positions[:3], batch.positions)
    assert torch.equal(padded.slot_mapping[:3], batch.slot_mapping)
    assert torch.equal(padded.seq_lens[:3], batch.seq_lens)
    width = batch.block_tables.shape[1]
    assert torch.equal(padded.block_tables[:3, :width], batch.block_tables)
    assert bool((padded.block_tables[:3, width:] == scratch).all())
    # Padding rows: one token of context, written to and read from the scratch page only.
    assert torch.equal(padded.slot_mapping[3:], torch.full((5,), scratch * PAGE))
    assert bool((padded.block_tables[3:] == scratch).all())
    assert torch.equal(padded.seq_lens[3:], torch.ones(5, dtype=torch.int32))
    assert torch.equal(padded.query_start_loc, torch.arange(9, dtype=torch.int32))
    assert torch.equal(padded.logits_indices, torch.arange(8))
    with pytest.raises(ValueError, match="at most 2 rows"):
        pad_decode_input(batch, 2, max_pages=5, scratch_page=scratch)


def _backends() -> list[AttentionBackend]:
    backends: list[AttentionBackend] = [SdpaBackend(NoOptions())]
    try:
        TritonBackend.check_device("cuda" if HAS_CUDA else "cpu")
    except RuntimeError:
        return backends
    # Forced splits leave most of them empty for these short contexts, as a graph captured
    # for a long context does at replay.
    return [*backends, TritonBackend(TritonAttentionOptions(num_kv_splits=8, decode_block_n=16))]


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: type(b).name)
def test_padding_rows_change_no_real_page_nor_real_output(backend: AttentionBackend) -> None:
    device = "cuda" if HAS_CUDA else "cpu"
    case = random_attention_case(
        [1, 1, 1], [6, 15, 20], num_heads=4, num_kv_heads=2, head_dim=32, page_size=PAGE
    )
    generator = torch.Generator().manual_seed(1)
    scratch = case.kv_cache[0].shape[0]  # one page past the pool, as the executor adds
    pools = tuple(
        torch.cat([pool, torch.randn(1, *pool.shape[1:], generator=generator)]).to(device)
        for pool in case.kv_cache
    )
    host_batch = case.batch.to("cpu")
    padded = pad_decode_input(host_batch, 8, max_pages=8, scratch_page=scratch)
    # As at capture: host maxima of the longest context a replay may bring.
    padded = dataclasses.replace(
        padded, seq_lens_cpu=torch.full((8,), 32, dtype=torch.int32), max_seq_len=32
    )

    def pad_rows(tensor: torch.Tensor) -> torch.Tensor:
        extra = torch.randn(5, *tensor.shape[1:], generator=generator) * 100.0
        return torch.cat([tensor.cpu(), extra]).to(device)

    query, key, value = (pad_rows(t) for t in (case.query, case.key, case.value))
    kv_cache = (pools[0].clone(), pools[1].clone())
    metadata = backend.build_metadata(padded.to(device))
    output = backend.forward(case.layer, query, key, value, kv_cache, metadata)

    torch.testing.assert_close(output[:3].double().cpu(), naive_attention(case), atol=2e-5, rtol=0)
    assert torch.isfinite(output).all()
    for before, after, new in zip(pools, kv_cache, (case.key, case.value), strict=True):
        expected = before[:scratch].flatten(0, 1).clone()  # real pages only
        expected[case.batch.slot_mapping.cpu()] = new.cpu()
        assert torch.equal(after[:scratch].flatten(0, 1).cpu(), expected.cpu())


@pytest.mark.skipif(HAS_CUDA, reason="checks the error given without CUDA")
def test_selecting_it_without_cuda_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"needs a CUDA GPU.*use executor plugin 'torch'"):
        CudaGraphExecutor.check_device("cuda")
    params = ExecutorParams(
        model_path=str(tmp_path / "never-read"),
        dtype="float32",
        attention=SdpaBackend(NoOptions()),
        page_size=PAGE,
        kv_cache_dtype="auto",
        max_model_len=0,
        checkpoint=UnreadCheckpoint(),
    )
    with pytest.raises(RuntimeError, match="use executor plugin 'torch'"):
        CudaGraphExecutor(params, CudaGraphExecutorOptions())


class UnreadCheckpoint(Checkpoint):
    """A model that fails the test when any part of it is read."""

    path = format = name = "never-read"

    @property
    def config(self) -> Mapping[str, Any]:
        raise AssertionError("the config was read")

    def weights(
        self, dtype: torch.dtype, device: torch.device | str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        raise AssertionError("the weights were read")

    def tokenizer(self) -> Any:
        raise AssertionError("the tokenizer was read")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        raise AssertionError("the EOS ids were read")


class CpuGraphExecutor(CudaGraphExecutor):
    """The cuda-graph executor on the CPU, given a :class:`RerunGraphRunner`: "capture" runs
    the step once on the static buffers, "replay" runs it again on whatever they hold now (with
    the capture's host maxima), so a replay sees the step only through the buffers, as a real
    one does."""

    @classmethod
    def check_device(cls, device: str) -> None:
        """Accept the CPU."""


def _decode_step(prompts: list[list[int]], tables: list[list[int]], step: int) -> ModelInput:
    chunks = [SeqChunk([3 + step], len(p) + step, t) for p, t in zip(prompts, tables, strict=True)]
    return build_model_input(chunks, PAGE)


@pytest.mark.skipif(
    not triton_interpreting() or HAS_CUDA, reason="imitates graphs with the triton interpreter"
)
def test_imitated_replay_matches_eager_on_cpu(tmp_path: Path) -> None:
    model = create_model(tmp_path / "llama", overrides={"num_hidden_layers": 2})

    def params() -> ExecutorParams:
        return ExecutorParams(
            model_path=str(model),
            dtype="float32",
            attention=TritonBackend(TritonAttentionOptions(num_kv_splits=4, decode_block_n=16)),
            page_size=PAGE,
            kv_cache_dtype="auto",
            max_model_len=64,
            checkpoint=open_checkpoint(str(model)),
        )

    eager = TorchExecutor(params(), TorchExecutorOptions(device="cpu"))
    options = CudaGraphExecutorOptions(capture_sizes=(1, 4), mixed_capture_tokens=(16,))
    graphed = CpuGraphExecutor(
        params(), dataclasses.replace(options, device="cpu"), runner=RerunGraphRunner()
    )
    for executor in (eager, graphed):
        executor.initialize_kv_cache(32)
    assert graphed.scratch_page == 32
    assert graphed.kv_caches[0][0].shape[0] == 33  # the pool plus the scratch page

    prompts = [[5, 17, 9, 3, 11], [2, 8, 30], [40, 41, 42, 43, 44, 45, 46]]
    tables = [[3, 0, 9], [5, 1], [7, 2, 4]]
    prefill = build_model_input(
        [SeqChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)], PAGE
    )
    # 15 tokens: piecewise graphs (16-token bucket), attention eager in the interpreter.
    torch.testing.assert_close(graphed.execute(prefill), eager.execute(prefill), atol=1e-4, rtol=0)
    for step in range(3):  # 3 rows padded to 4; contexts cross page boundaries
        decode = _decode_step(prompts, tables, step)
        expected = eager.execute(decode)
        got = graphed.execute(decode)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    single = _decode_step(prompts[:1], tables[:1], 3)  # the size-1 graph
    torch.testing.assert_close(graphed.execute(single), eager.execute(single), atol=1e-4, rtol=1e-4)
    # Two decodes next to a new prompt's chunk (piecewise), then three decodes (the size-4
    # graph) reading KV the piecewise step wrote.
    prompts.append([50, 51, 52, 53, 54, 55])
    tables.append([6, 8])
    mixed = build_model_input(
        [SeqChunk([3], len(prompts[r]) + 3, tables[r]) for r in (1, 2)]
        + [SeqChunk(prompts[3], 0, tables[3])],
        PAGE,
    )
    torch.testing.assert_close(graphed.execute(mixed), eager.execute(mixed), atol=1e-4, rtol=0)
    after = build_model_input(
        [SeqChunk([4], len(prompts[r]) + 4, tables[r]) for r in (1, 2)]
        + [SeqChunk([7], len(prompts[3]), tables[3])],
        PAGE,
    )
    torch.testing.assert_close(graphed.execute(after), eager.execute(after), atol=1e-4, rtol=0)
    replays = {size: getattr(graph, "replays", 0) for size, graph in graphed._graphs.items()}
    assert replays == {1: 1, 4: 4}  # every decode step ran in a graph, none eagerly
    assert graphed.pieces is not None
    assert getattr(graphed.pieces.graphs[16][0], "replays", 0) == 2  # prefill and mixed
    used = sorted({page for table in tables for page in table})
    for (eager_k, eager_v), (graph_k, graph_v) in zip(
        eager.kv_caches, graphed.kv_caches, strict=True
    ):
        torch.testing.assert_close(graph_k[used], eager_k[used], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(graph_v[used], eager_v[used], atol=1e-5, rtol=1e-5)


# --- GPU: replay equals eager ------------------------------------------------------------


@pytest.fixture(scope="module")
def executors(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[TorchExecutor, CudaGraphExecutor]:
    model = create_model(tmp_path_factory.mktemp("m") / "llama", overrides={"num_hidden_layers": 2})

    def params() -> ExecutorParams:
        return ExecutorParams(
            model_path=str(model),
            dtype="float32",
            attention=TritonBackend(),
            page_size=PAGE,
            kv_cache_dtype="auto",
            max_model_len=256,
            checkpoint=open_checkpoint(str(model)),
        )

    eager = TorchExecutor(params(), TorchExecutorOptions(device="cuda"))
    graphed = CudaGraphExecutor(params(), CudaGraphExecutorOptions(capture_sizes=SIZES))
    for executor in (eager, graphed):
        executor.initialize_kv_cache(96)
    return eager, graphed


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("num_rows", [1, 3, 8])
def test_graph_replay_matches_eager_logits(
    executors: tuple[TorchExecutor, CudaGraphExecutor], num_rows: int
) -> None:
    eager, graphed = executors
    generator = torch.Generator().manual_seed(num_rows)
    prompts = [
        torch.randint(0, 200, (4 + 3 * row,), generator=generator) for row in range(num_rows)
    ]
    tables = [list(range(8 * row, 8 * row + 8)) for row in range(num_rows)]
    prefill = build_model_input(
        [SeqChunk(p.tolist(), 0, t) for p, t in zip(prompts, tables, strict=True)], PAGE
    )
    # The prefill runs in piecewise graphs (the default 16..2048-token buckets).
    torch.testing.assert_close(
        graphed.execute(prefill), eager.execute(prefill), atol=1e-4, rtol=1e-4
    )
    for step in range(3):  # the graph is replayed with new lengths each step
        decode = build_model_input(
            [SeqChunk([7 + step], len(p) + step, t) for p, t in zip(prompts, tables, strict=True)],
            PAGE,
        )
        torch.testing.assert_close(
            graphed.execute(decode), eager.execute(decode), atol=1e-4, rtol=1e-4
        )


@pytest.mark.gpu
@gpu_only
def test_mixed_steps_match_eager(executors: tuple[TorchExecutor, CudaGraphExecutor]) -> None:
    eager, graphed = executors
    first = build_model_input([SeqChunk(list(range(1, 9)), 0, [70, 71, 72])], PAGE)
    for executor in executors:
        executor.execute(first)
    mixed = build_model_input(
        [SeqChunk([9], 8, [70, 71, 72]), SeqChunk(list(range(20, 31)), 0, [80, 81, 82])], PAGE
    )  # a decode next to an 11-token prefill chunk: piecewise graphs (16 tokens) vs eager
    torch.testing.assert_close(graphed.execute(mixed), eager.execute(mixed), atol=1e-4, rtol=1e-4)
    decode = build_model_input(
        [SeqChunk([10], 9, [70, 71, 72]), SeqChunk([5], 11, [80, 81, 82])], PAGE
    )  # then the decode graph, reading KV the piecewise step wrote
    torch.testing.assert_close(graphed.execute(decode), eager.execute(decode), atol=1e-4, rtol=1e-4)
    assert graphed.execute(decode).shape == (2, eager.model.vocab_size)
