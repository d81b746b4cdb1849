"""The fused decode step (``decode_layers``: every layer of a pure decode step in one C++ call)
gives the eager forward's logits bit for bit, on each architecture it covers, with each GEMM
mode, in float32 and bfloat16, across steps and shuffled pages; other steps and models keep the
eager layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from executor_helpers import PAGE_SIZE, ShuffledPages, make_executor, token_sequences

from brigade.model_input import SeqChunk, build_model_input
from brigade.models.create import create_model
from brigade.plugins.attention.cpu_kernels import cpu_ops
from brigade.plugins.executors.cpu_gemm import tiles_usable

TILES = pytest.mark.skipif(not tiles_usable(), reason="no AMX tiles: tiles mode is panels mode")
MODELS = {
    "llama": {},
    "mistral": {"sliding_window": 6},  # a window shorter than the contexts below
    "qwen2": {},  # biases on q, k, v
    "qwen3": {},  # qk norm: not covered, stays eager
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fused-decode")
    return {
        arch: create_model(root / arch, arch, overrides={"num_hidden_layers": 2, **extra})
        for arch, extra in MODELS.items()
    }


def decode_logits(executor: object, steps: int = 4) -> tuple[list[torch.Tensor], int]:
    """Prefill three prompts, then ``steps`` greedy decode steps of all three rows; returns
    each decode step's logits and how often ``decode_layers`` ran."""
    ops = cpu_ops()
    assert ops is not None, "the CPU kernels failed to build"
    calls = 0
    fusion = executor.model.fusion  # type: ignore[attr-defined]
    original = fusion.ops

    class Counting:
        def __getattr__(self, name: str) -> object:
            nonlocal calls
            calls += name == "decode_layers"
            return getattr(ops, name)

    fusion.ops = lambda x: Counting() if original(x) is not None else None
    pages = ShuffledPages(seed=3)
    prompts = token_sequences([5, 9, 3], seed=4)
    tables = [pages.take(len(p) + steps) for p in prompts]
    sequences = [list(p) for p in prompts]
    for prompt, table in zip(prompts, tables, strict=True):
        executor.execute(build_model_input([SeqChunk(prompt, 0, table)], PAGE_SIZE))  # type: ignore[attr-defined]
    # The first decode tokens: fixed, so both executors see the same inputs.
    next_tokens = [11, 22, 33]
    outputs = []
    for _ in range(steps):
        chunks = [
            SeqChunk([token], len(seq), table)
            for token, seq, table in zip(next_tokens, sequences, tables, strict=True)
        ]
        logits = executor.execute(build_model_input(chunks, PAGE_SIZE))  # type: ignore[attr-defined]
        outputs.append(logits)
        for seq, token in zip(sequences, next_tokens, strict=True):
            seq.append(token)
        next_tokens = logits.argmax(dim=-1).tolist()
    fusion.ops = original
    return outputs, calls


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize(
    "cpu_linear", ["panels", pytest.param("tiles", marks=TILES), "packed", "onednn", "plain"]
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_steps_equal_the_eager_layers(
    model_dirs: dict[str, Path], arch: str, cpu_linear: str, dtype: str
) -> None:
    fused = make_executor(model_dirs[arch], cpu_linear=cpu_linear, dtype=dtype)
    eager = make_executor(model_dirs[arch], cpu_linear=cpu_linear, fused_decode=False, dtype=dtype)
    ours, fused_calls = decode_logits(fused)
    theirs, eager_calls = decode_logits(eager)
    assert eager_calls == 0
    assert fused_calls == (0 if arch == "qwen3" else len(ours)), "the fused step did not run"
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(a, b), f"{arch}, {cpu_linear}, {dtype}, step {step}: logits differ"


def test_prefills_and_mixed_steps_keep_the_eager_layers(model_dirs: dict[str, Path]) -> None:
    executor = make_executor(model_dirs["llama"])
    _, calls = decode_logits(executor, steps=0)  # prefills only
    assert calls == 0
