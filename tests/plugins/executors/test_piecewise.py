"""Piecewise graphs (mixed prefill + decode steps) of the cuda-graph executor.

On the CPU, graphs are imitated by :class:`RerunGraphRunner` (capture runs a piece once, a
replay runs it again on the static buffers), so everything but CUDA's own capture runs here:
bucketing by token count, the split of the decoder at attention, padding rows in the static
buffers, attention on the real tokens only, logits rows, the eager fallback above the largest
bucket, and the executor inside the real engine. Logits are compared with the eager ``torch``
executor in fp32. The ``gpu``-marked test captures real CUDA graphs and compares bf16 logits
(scripts/gpu_check.sh runs it).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import pytest
import torch

from brigade import LLM, SamplingParams
from brigade.errors import ConfigError
from brigade.interfaces import (
    AttentionBackend,
    ExecutorParams,
    ModelInput,
    NoOptions,
    SplitCausalLM,
    option,
)
from brigade.model_input import SeqChunk, build_model_input
from brigade.models.checkpoint import open_checkpoint
from brigade.models.create import create_model
from brigade.options import build_options
from brigade.plugins.attention.sdpa import SdpaBackend
from brigade.plugins.executors import cuda_graph
from brigade.plugins.executors.cuda_graph import CudaGraphExecutor, CudaGraphExecutorOptions
from brigade.plugins.executors.graph_runner import RerunGraphRunner
from brigade.plugins.executors.piecewise import PiecewiseGraphs
from brigade.plugins.executors.torch_executor import TorchExecutor, TorchExecutorOptions
from brigade.registry import load_registry
from brigade.testing.parity import assert_same_greedy_outputs

PAGE = 4
TOKENS = (8, 16, 32)
"""Token buckets of the CPU tests: steps of 1..32 tokens are graphed, larger ones eager."""
ATOL = 2e-5
"""fp32 logits (and KV): piecewise vs eager run the same modules, but GEMMs over a padded
bucket may block differently from GEMMs over the real rows. Measured max difference 8.7e-6."""
HAS_CUDA = torch.cuda.is_available()


class ImitatedGraphExecutor(CudaGraphExecutor):
    """The cuda-graph executor on the CPU, its graphs imitated by :class:`RerunGraphRunner`."""

    @classmethod
    def check_device(cls, device: str) -> None:
        """Accept the CPU."""


def params(model: Path, backend: AttentionBackend | None = None) -> ExecutorParams:
    return ExecutorParams(
        model_path=str(model),
        dtype="float32",
        attention=backend or SdpaBackend(NoOptions()),
        page_size=PAGE,
        kv_cache_dtype="auto",
        max_model_len=96,
        checkpoint=open_checkpoint(str(model)),
    )


def executors(model: Path, num_pages: int = 64) -> tuple[TorchExecutor, ImitatedGraphExecutor]:
    eager = TorchExecutor(params(model), TorchExecutorOptions(device="cpu"))
    options = CudaGraphExecutorOptions(capture_sizes=(1, 4), mixed_capture_tokens=TOKENS)
    graphed = ImitatedGraphExecutor(
        params(model), dataclasses.replace(options, device="cpu"), runner=RerunGraphRunner()
    )
    for executor in (eager, graphed):
        executor.initialize_kv_cache(num_pages)
        # Zero the whole pool again after the warm-up and the captures, so the pools of the
        # two executors can be compared page for page, the scratch page included.
        assert executor._unzeroed is None  # committed at start ([executor] kv_prefault)
        for pool in executor.kv_caches:
            pool[0].zero_()
            pool[1].zero_()
    return eager, graphed


def replays(executor: CudaGraphExecutor) -> dict[int, int]:
    """bucket -> how often its first piece was replayed."""
    pieces = executor.pieces
    assert pieces is not None
    return {size: getattr(graphs[0], "replays", 0) for size, graphs in pieces.graphs.items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        arch: create_model(root / arch, arch, overrides={"num_hidden_layers": 3})
        for arch in ("llama", "qwen2", "qwen3")  # plain; qkv bias; qk norm
    }


# --- options and bucketing ----------------------------------------------------------------


def test_mixed_capture_tokens_are_sorted_and_checked() -> None:
    options = build_options(
        CudaGraphExecutorOptions, {"mixed_capture_tokens": [64, 16, 16]}, "[executor]"
    )
    assert options.mixed_capture_tokens == (64, 16, 16)  # checked, kept as written
    for bad in ([], [16, 0]):
        with pytest.raises(ConfigError, match="mixed_capture_tokens"):
            build_options(CudaGraphExecutorOptions, {"mixed_capture_tokens": bad}, "[executor]")
    with pytest.raises(ConfigError, match="piecewise"):
        build_options(CudaGraphExecutorOptions, {"piecewise": "yes"}, "[executor]")


def test_steps_are_bucketed_by_token_count_after_capture(models: dict[str, Path]) -> None:
    _eager, graphed = executors(models["llama"])
    pieces = graphed.pieces
    assert pieces is not None
    assert pieces.capture_tokens == TOKENS
    assert [pieces.bucket(n) for n in (1, 8, 9, 16, 17, 32, 33)] == [8, 8, 16, 16, 32, 32, None]
    # One graph per piece: embedding + layer 0's attention input, one per layer boundary, and
    # the last layer's MLP + final norm.
    assert {size: len(graphs) for size, graphs in pieces.graphs.items()} == {8: 4, 16: 4, 32: 4}
    assert pieces.buffers is not None
    hidden_size = json.loads((models["llama"] / "config.json").read_text())["hidden_size"]
    assert pieces.buffers.hidden.shape == (2, 32, hidden_size)  # ping-pong, largest bucket
    fresh = PiecewiseGraphs(pieces.model, 3, TOKENS, RerunGraphRunner(), torch.device("cpu"))
    assert fresh.bucket(4) is None  # nothing captured yet: every step runs eagerly


@runtime_checkable
class _SplitMore(Protocol):
    def a_method_no_model_has(self) -> None: ...


def test_a_model_that_does_not_split_at_attention_runs_mixed_steps_eagerly(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert isinstance(
        TorchExecutor(params(models["llama"]), TorchExecutorOptions(device="cpu")).model,
        SplitCausalLM,
    )
    monkeypatch.setattr(cuda_graph, "SplitCausalLM", _SplitMore)
    _eager, graphed = executors(models["llama"])
    assert graphed.pieces is None
    assert "does not split at attention; steps with prefill chunks run eagerly" in caplog.text


# --- parity with the eager executor ---------------------------------------------------------


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (length,), generator=generator).tolist()


def assert_same_logits(
    eager: TorchExecutor, graphed: CudaGraphExecutor, batch: ModelInput
) -> torch.Tensor:
    expected, got = eager.execute(batch), graphed.execute(batch)
    assert got.shape == expected.shape == (batch.logits_indices.shape[0], eager.model.vocab_size)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    return got


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_mixed_steps_match_eager(models: dict[str, Path], arch: str) -> None:
    eager, graphed = executors(models[arch])
    prompts = [prompt(n, seed) for seed, n in enumerate((7, 5, 9, 30))]
    tables = [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9, 10], list(range(11, 25))]
    # Three prompts prefilled at once: 21 tokens, padded to 32.
    prefill = build_model_input(
        [SeqChunk(p, 0, t) for p, t in zip(prompts[:3], tables[:3], strict=True)], PAGE
    )
    assert_same_logits(eager, graphed, prefill)
    assert replays(graphed) == {8: 0, 16: 0, 32: 1}
    # Three decodes next to the long prompt's first chunk (3 + 10 tokens, padded to 16), then
    # next to its second chunk with every decode's logits and two of the chunk's (ragged).
    context = [len(p) for p in prompts[:3]]
    decodes = [SeqChunk([40 + r], context[r], tables[r]) for r in range(3)]
    first = build_model_input([*decodes, SeqChunk(prompts[3][:10], 0, tables[3])], PAGE)
    assert_same_logits(eager, graphed, first)
    decodes = [SeqChunk([50 + r], context[r] + 1, tables[r]) for r in range(3)]
    second = build_model_input([*decodes, SeqChunk(prompts[3][10:22], 10, tables[3])], PAGE)
    two_rows = dataclasses.replace(
        second, logits_indices=torch.tensor([0, 1, 2, 9, 14])
    )  # 15 tokens, padded to 16
    assert_same_logits(eager, graphed, two_rows)
    assert replays(graphed) == {8: 0, 16: 2, 32: 1}
    # Pure decode of four rows: sdpa has no decode graphs, so it runs in the 8-token bucket.
    context = [c + 2 for c in context] + [22]
    decodes = [SeqChunk([60 + r], context[r], tables[r]) for r in range(4)]
    assert_same_logits(eager, graphed, build_model_input(decodes, PAGE))
    assert replays(graphed) == {8: 1, 16: 2, 32: 1}
    # Larger than the largest bucket: eager, no replay.
    big = build_model_input(
        [SeqChunk([70 + r], context[r] + 1, tables[r]) for r in range(3)]
        + [SeqChunk(prompt(40, 9), 0, list(range(30, 40)))],
        PAGE,
    )
    assert_same_logits(eager, graphed, big)
    assert replays(graphed) == {8: 1, 16: 2, 32: 1}
    # The KV every step wrote is the eager executor's, page for page: padding rows (which
    # never reach attention) wrote none, here or in the scratch page.
    for (eager_k, eager_v), (graph_k, graph_v) in zip(
        eager.kv_caches, graphed.kv_caches, strict=True
    ):
        torch.testing.assert_close(graph_k[:64], eager_k, atol=ATOL, rtol=0)
        torch.testing.assert_close(graph_v[:64], eager_v, atol=ATOL, rtol=0)
        assert not graph_k[64].any()
        assert not graph_v[64].any()


def test_padding_rows_do_not_change_real_rows(models: dict[str, Path]) -> None:
    """The same step replayed over garbage in the padding rows gives the same logits."""
    eager, graphed = executors(models["llama"])
    batch = build_model_input([SeqChunk(prompt(11, 3), 0, [0, 1, 2])], PAGE)  # 11 of 16 rows
    first = assert_same_logits(eager, graphed, batch)
    pieces = graphed.pieces
    assert pieces is not None
    assert pieces.buffers is not None
    buffers = pieces.buffers
    with torch.inference_mode():  # the padding rows: other tokens, positions, activations
        buffers.input_ids[11:].fill_(255)
        buffers.positions[11:].fill_(90)
        buffers.attention[11:].normal_(generator=torch.Generator().manual_seed(0))
    again = graphed.execute(batch)  # rewrites the same KV slots with the same values
    torch.testing.assert_close(again, first, atol=0, rtol=0)


def test_attention_sees_only_the_real_tokens_with_the_steps_metadata(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _eager, graphed = executors(models["llama"])
    model = graphed.model
    assert isinstance(model, SplitCausalLM)
    attend = model.attend
    seen: list[tuple[int, int, int, int, int, int]] = []

    def spy(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any) -> Any:
        metadata = rest[-1]
        rows = (q.shape[0], k.shape[0], v.shape[0], metadata.slot_mapping.shape[0])
        seen.append((index, *rows, metadata.num_decodes))
        return attend(index, q, k, v, *rest)

    monkeypatch.setattr(model, "attend", spy)
    batch = build_model_input(
        [SeqChunk([1], 4, [0, 1]), SeqChunk([2], 6, [2, 3]), SeqChunk(prompt(9, 1), 0, [4, 5, 6])],
        PAGE,
    )  # 2 decodes and a 9-token chunk: 11 tokens in the 16-token bucket
    graphed.execute(batch)
    assert replays(graphed)[16] == 1
    assert seen == [(layer, 11, 11, 11, 11, 2) for layer in range(3)]


# --- inside the engine ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ImitatedOptions:
    mixed_capture_tokens: tuple[int, ...] = option(TOKENS, help="token buckets")


def make_imitated(params: ExecutorParams, options: ImitatedOptions) -> ImitatedGraphExecutor:
    cuda_options = CudaGraphExecutorOptions(mixed_capture_tokens=options.mixed_capture_tokens)
    return ImitatedGraphExecutor(
        params, dataclasses.replace(cuda_options, device="cpu"), runner=RerunGraphRunner()
    )


def test_engine_steps_through_piecewise_graphs_match_eager(models: dict[str, Path]) -> None:
    registry = load_registry()
    registry.add("executor", "imitated-graphs", make_imitated, options=ImitatedOptions)
    base = [
        f"model.path={models['qwen3']}",
        "model.dtype=float32",
        "kv.page_size=4",
        "kv.num_pages=128",
        "attention.plugin=sdpa",
        "scheduler.max_num_batched_tokens=24",  # long prompts are chunked next to decodes
    ]
    prompts = [prompt(n, 20 + n) for n in (5, 33, 12, 50, 3)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)

    def run(*settings: str) -> tuple[list[Any], LLM]:
        llm = LLM(overrides=[*base, *settings], registry=registry)
        outputs = llm.generate(prompts, greedy)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], llm

    expected, _ = run("executor.plugin=torch", "executor.device=cpu")
    got, llm = run("executor.plugin=imitated-graphs")
    assert_same_greedy_outputs(got, expected, atol=1e-4, label="piecewise graphs")
    executor = llm.engine.executor
    assert isinstance(executor, ImitatedGraphExecutor)
    counts = replays(executor)
    assert counts[32] > 0  # full 24-token steps: chunks mixed with decodes
    assert counts[8] > 0  # the last decode-only steps


# --- GPU: real CUDA graphs, bf16 ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_piecewise_graphs_match_eager_in_bf16(models: dict[str, Path]) -> None:
    from brigade.plugins.attention.triton_backend import TritonBackend, triton_interpreting

    if triton_interpreting():
        pytest.skip("needs compiled triton kernels (TRITON_INTERPRET is set)")

    def make(kind: str, dtype: str) -> TorchExecutor:
        gpu_params = dataclasses.replace(
            params(models["llama"], TritonBackend()), dtype=dtype, max_model_len=512
        )
        if kind == "eager":
            return TorchExecutor(gpu_params, TorchExecutorOptions(device="cuda"))
        options = CudaGraphExecutorOptions(capture_sizes=(1, 4), mixed_capture_tokens=(16, 64))
        return CudaGraphExecutor(gpu_params, options)

    reference = make("eager", "float32")
    eager = make("eager", "bfloat16")
    graphed = make("graphs", "bfloat16")
    for executor in (reference, eager, graphed):
        executor.initialize_kv_cache(96)
    assert isinstance(graphed, CudaGraphExecutor)
    assert graphed.pieces is not None
    assert {size: len(graphs) for size, graphs in graphed.pieces.graphs.items()} == {16: 4, 64: 4}
    prompts = [prompt(n, seed) for seed, n in enumerate((9, 14, 6, 40))]
    tables = [list(range(8 * r, 8 * r + 8)) for r in range(3)] + [list(range(40, 60))]
    steps = [
        build_model_input(
            [SeqChunk(p, 0, t) for p, t in zip(prompts[:3], tables[:3], strict=True)], PAGE
        ),  # 29 tokens -> the 64 bucket
        build_model_input(
            [SeqChunk([7 + r], len(prompts[r]), tables[r]) for r in range(3)]
            + [SeqChunk(prompts[3][:11], 0, tables[3])],
            PAGE,
        ),  # 3 decodes + an 11-token chunk -> the 16 bucket
        build_model_input(
            [SeqChunk([9 + r], len(prompts[r]) + 1, tables[r]) for r in range(3)]
            + [SeqChunk(prompts[3][11:], 11, tables[3])],
            PAGE,
        ),  # 3 decodes + a 29-token chunk -> the 64 bucket
        build_model_input(
            [SeqChunk([11 + r], len(prompts[r]) + 2, tables[r]) for r in range(3)]
            + [SeqChunk([5], 40, tables[3])],
            PAGE,
        ),  # 4 decodes -> the decode graph of size 4, reading KV the pieces' steps wrote
    ]
    for batch in steps:
        exact = reference.execute(batch)
        eager_error = (eager.execute(batch) - exact).abs().max().item()
        graphed_error = (graphed.execute(batch) - exact).abs().max().item()
        # bf16 by tolerance only: the graphs must be about as close to fp32 as eager bf16 is.
        assert graphed_error <= 2 * eager_error + 1e-2, (graphed_error, eager_error)
